"""The real engines' own code, located and run on CPU (tests and preflights only, never the library's run path).

  sources.py   where Miles, Megatron-LM and SGLang's sources are (the user's checkout, the vendored pins, a
               cache), and `engine_python` to run their code in a subprocess with GPU-only imports stubbed
  stubs.py     the stubs of GPU-only modules (sgl_kernel, flashinfer, transformer_engine, ...)
"""
