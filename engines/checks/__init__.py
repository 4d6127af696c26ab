"""Checks that run a real engine's own code on CPU against what v4rl hands it (preflights, `v4rl plan --sglang-dir`).

  sglang_preflight.py     the cluster preflight's SGLang check: the job's own SGLANG_* mode and expert format
  sglang_model_check.py   host side: builds the start checkpoints and updates, runs the probe, reads its report
  sglang_model_probe.py   runs in a subprocess with SGLang's source: SGLang's DeepSeek-V4 model loads and updates

The engines' sources and the stubs of their GPU-only imports are engines/upstream.
"""
