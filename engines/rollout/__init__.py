"""Rollout: our SGLang-compatible CPU engine and server, and the client/launcher for real SGLang.

  engine.py    continuous-batching DeepSeek-V4 engine (prefill + cached decode, prefix cache, pause modes)
  weights.py   weights held as stored (FP8/FP4 + scales), update validation, runtime rebuild, checksums
  protocol.py  SGLang /generate request parsing and response shapes
  control.py   the control routes' request bodies (SGLang's field names, defaults, required bodies)
  health.py    SGLang's one-token health probe (/health, /health_generate)
  info.py      /model_info and /server_info (SGLang's fields; model_path moving with disk updates)
  weights_checker.py  /weights_checker actions (snapshot, reset_tensors, compare, checksum)
  server.py    FastAPI server with SGLang's native routes (`v4rl serve-rollout`)
  sglang.py    the one client for both servers (timeouts, connect-only retries, error bodies)
  fidelity.py  the post-update gate (bit-exact probe logprobs + runtime checksums vs a fresh engine)
  launcher.py  real SGLang on Ray + NCCL/RCCL weight sync (GPU clusters)
  fused_pairs.py      SGLang's fused weight pairs; distributed-update buckets that never split one
  update_settings.py  SGLang settings every engine v4rl starts gets so updates round-trip (SGLANG_OPT_FP8_WO_A_GEMM)
  sampling.py  sampling primitives and the simple batched `generate` used by bootstrap/demo
"""
