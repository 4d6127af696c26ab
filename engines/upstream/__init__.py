"""The real engines' own code, located and run on CPU: v4rl's proof that what it hands Miles, Megatron-LM and SGLang
is what they accept (preflights, `v4rl verify-ckpt --miles-dir`, `v4rl plan --sglang-dir`, `v4rl rehearse`, the
conformance suite). Never on the run path of a training; never copied into the repository.

The entry point is `sources.engine_python(code, paths)`: a subprocess with the engines' trees on sys.path and their
GPU-only imports stubbed; everything below runs through it.

  sources.py                  where the trees are (a checkout, the vendored pins, a cache) and engine_python
  stubs.py                    the stubs of GPU-only modules (sgl_kernel, flashinfer, transformer_engine, ...)
  probes/                     scripts that run inside those subprocesses (Miles' parse_args, model, launcher) and
                              the CPU stand-ins of the GPU kernels (transformer_engine, tilelang, TileKernels)
  miles_preflight.py          Miles' own parse_args on the exact argv and env of the job
  miles_model_check.py        Miles' own Megatron model against v4rl's torch_dist (keys, a forward)
  miles_launcher_compare.py   the job against Miles' own launcher's command
  megatron_fit.py             whether a Megatron-LM checkout fits a Miles generation
  sglang_preflight.py         the SGLang the cluster runs taking one weight update as a fresh load
  sglang_model_check.py       SGLang's DeepSeek-V4 model loading and updating v4rl's checkpoints (host side)
  sglang_model_probe.py       the same, inside the SGLang subprocess
  rehearsal/                  `v4rl rehearse`: Miles' own train.py on CPU with v4rl's engine as its SGLang
"""
