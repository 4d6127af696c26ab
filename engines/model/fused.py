"""Fused native kernels for our model (fused.c, fused_gemm.c, fused.h), as tensor-level calls.

A decode step of a small DeepSeek-V4 is thousands of tiny torch ops (mHC weights, norms, RoPE, the compressors'
window step, the lightning indexer, sink attention, routing, one matmul chain per expert), each paying eager
PyTorch's per-op cost; a prefill attends to every earlier position although only the window and the chosen
entries count. The C kernels compute each chain in one call, in float32 with the same formulas, and multiply
through one packed-panel GEMM (weights laid out once by `pack`); sums run in another order and exp/cos come
from libm, so results differ from the torch ops by rounding only. engines/model/fused_model.py runs whole
forwards and decode steps with them; engines/model/fused_check.py judges them once per model config before
first use (no further from float64 than the torch ops, times its ERROR_FACTOR).

The library is built like kernels.py's (same cache, same atomic write), with -O3 and `-march=native` (the cache
key then covers the CPU's feature flags; where the compiler refuses it, portable flags), and loaded with
ctypes, which releases the GIL during a call. `V4RL_NATIVE_KERNELS=0` turns it off with the other native
kernels, `V4RL_FUSED_DECODE=0` only this one; without a compiler, or when the check fails, the torch ops run,
with one warning. The check's verdict is kept beside the library for later processes (`saved_check`;
`V4RL_FUSED_CHECK_CACHE=0` checks in every process).

    from engines.model import fused
    fused.status()     # {"enabled": True, "library": ".../libv4rl_fused-<hash>.so", "error": None, "checked": {...},
                       #  "check_details": {...}}
    .venv/bin/python -m pytest tests/test_kernels.py tests/test_model.py -q
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engines.model import kernels

SOURCES = (Path(__file__).with_name("fused.c"), Path(__file__).with_name("fused_gemm.c"))
HEADERS = (Path(__file__).with_name("fused.h"), Path(__file__).with_name("sinkhorn.h"))
FLAG_SETS = (("-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno"),
             ("-O3", "-fPIC", "-shared", "-fno-math-errno"))
"""-march=native first (AVX-512/AVX2 dot products), portable flags where the compiler refuses it.
-fno-math-errno lets sqrtf inline; no -ffast-math: infinities (masked gates) must stay IEEE."""

_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_library = kernels.NativeLibrary(SOURCES, FLAG_SETS, {
    "v4rl_hc_pre": (None, [_P, _I64, _I64, _I64, _P, _P, _P, _F32, _F32, _I64, _P, _F32, _INT, _P, _P, _P, _INT]),
    "v4rl_hc_post": (None, [_P, _I64, _I64, _I64, _P, _P, _P, _P, _INT]),
    "v4rl_rms_norm": (None, [_P, _I64, _I64, _I64, _P, _F32, _P]),
    "v4rl_heads_norm_rope": (None, [_P, _I64, _I64, _I64, _I64, _F32, _INT, _P, _P, _I64, _P]),
    "v4rl_kv_store": (None, [_P, _I64, _I64, _I64, _P, _F32, _P, _P, _I64, _P, _P, _I64]),
    "v4rl_compress_step": (None, [_P, _P, _I64, _I64, _I64, _I64, _I64, _INT, _P, _P, _P, _P, _I64, _P, _P, _P,
                                  _P, _F32, _P, _I64]),
    "v4rl_indexer_select": (None, [_P, _I64, _I64, _I64, _P, _I64, _P, _I64, _I64, _P, _I64, _I64, _P, _INT]),
    "v4rl_attend": (None, [_P, _I64, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _I64, _P, _I64, _P, _F32, _P, _P,
                           _I64, _P, _INT]),
    "v4rl_linear": (None, [_P, _I64, _I64, _P, _I64, _I64, _I64, _P, _I64, _INT]),
    "v4rl_sample": (None, [_P, _I64, _I64, _P, _P, _P, _P]),
    "v4rl_moe": (_INT, [_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _F32, _P, _P, _P, _P, _F32, _P, _P, _INT]),
}, HEADERS)
_checked: dict[str, bool] = {}
"""Verdict of the fused check per model config (fused_model.shape_signature)."""
_check_details: dict[str, dict[str, Any]] = {}
"""Its numbers per config (fused_check.CheckResult.details: worst ratio, rows judged, seconds, the problem)."""


def enabled() -> bool:
    return kernels.enabled() and os.environ.get("V4RL_FUSED_DECODE", "1").strip().lower() not in (
        "0", "false", "no", "off")


def library() -> ctypes.CDLL | None:
    """The loaded library (built on first call), or None when disabled or unavailable."""
    return _library.load() if enabled() else None


def reset() -> None:
    _library.reset()
    _checked.clear()
    _check_details.clear()


def status() -> dict[str, Any]:
    return {"enabled": enabled(), "library": _library.path, "error": _library.error, "checked": dict(_checked),
            "check_details": {k: dict(v) for k, v in _check_details.items()}}


def record_check(signature: str, ok: bool, details: dict[str, Any] | None = None) -> None:
    _checked[signature] = ok
    if details is not None:
        _check_details[signature] = details


def check_cache_enabled() -> bool:
    """`V4RL_FUSED_CHECK_CACHE=0` runs the fused check in every process (see saved_check)."""
    return os.environ.get("V4RL_FUSED_CHECK_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def _check_file(signature: str) -> Path | None:
    """Where the check's verdict on `signature` is kept: beside the library it judged (whose name covers the C
    sources, compiler, flags and CPU), under a key covering the config, torch's version and the Python of both
    paths it compares (engines/model/*.py: the torch ops, the fused calls, the check itself)."""
    if _library.path is None or not check_cache_enabled():
        return None
    key = hashlib.sha256(f"{signature}\0{torch.__version__}\0{_model_code_digest()}".encode()).hexdigest()[:16]
    return Path(_library.path).with_name(f"{Path(_library.path).stem}.check-{key}.json")


@functools.cache
def _model_code_digest() -> str:
    """sha256 of engines/model/*.py, read once per process (saved_check and save_check both ask)."""
    digest = hashlib.sha256()
    for source in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()


def saved_check(signature: str) -> bool | None:
    """The verdict an earlier process recorded with save_check for this library, config and code (and records it
    here), or None: then the check runs (about 8 CPU-s on the tiny-cpu shape, at every engine start otherwise)."""
    path = _check_file(signature)
    try:
        saved = json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or saved.get("signature") != signature or not isinstance(saved.get("passed"), bool):
        return None
    record_check(signature, saved["passed"], saved.get("details"))
    return saved["passed"]


def save_check(signature: str, ok: bool, details: dict[str, Any]) -> None:
    """Keeps a verdict for later processes (atomically; a cache that cannot be written only costs the next check)."""
    path = _check_file(signature)
    if path is None:
        return
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        partial.write_text(json.dumps({"signature": signature, "passed": ok, "details": details}))
        os.replace(partial, path)
    except OSError:
        partial.unlink(missing_ok=True)


def checked(signature: str) -> bool | None:
    return _checked.get(signature)


# ---------------------------------------------------------------------------------------------- calls
def ptr(t: torch.Tensor | None) -> int | None:
    """Address of a float32/int64 CPU tensor whose rows are contiguous (checked: a kernel reads raw memory)."""
    if t is None:
        return None
    if (t.device.type != "cpu" or t.dtype not in (torch.float32, torch.int64)
            or (t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1)):
        raise ValueError(f"fused kernels need float32/int64 CPU tensors with contiguous rows; got {t.dtype} "
                         f"on {t.device} with strides {t.stride()}")
    return t.data_ptr()


def row_stride(t: torch.Tensor) -> int:
    return t.stride(0) if t.dim() > 1 else t.shape[-1]


def hc_pre(streams: torch.Tensor, fn_packed: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, cfg,
           norm_w: torch.Tensor, norm_eps: float, threads: int, *, head: bool = False
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(post [B, hc], comb [B, hc, hc], normed x [B, D]) of streams [B, hc, D]; head=True: hc_head + norm (x only).
    fn_packed: the mHC projection `pack`ed."""
    B, hc, D = streams.shape
    post, comb, x = streams.new_empty(B, hc), streams.new_empty(B, hc, hc), streams.new_empty(B, D)
    _library.lib.v4rl_hc_pre(ptr(streams), B, hc, D, ptr(fn_packed), ptr(base), ptr(scale), cfg.rms_norm_eps,
                             cfg.hc_eps, max(1, cfg.hc_sinkhorn_iters), ptr(norm_w), norm_eps, int(head), ptr(post),
                             ptr(comb), ptr(x), threads)
    return post, comb, x


def hc_post(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, threads: int
            ) -> torch.Tensor:
    B, hc, D = streams.shape
    out = torch.empty_like(streams)
    _library.lib.v4rl_hc_post(ptr(streams), B, hc, D, ptr(y), ptr(post), ptr(comb), ptr(out), threads)
    return out


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    B, n = x.shape
    out = x.new_empty(B, n)
    _library.lib.v4rl_rms_norm(ptr(x), row_stride(x), B, n, ptr(w), eps, ptr(out))
    return out


def heads_norm_rope(x: torch.Tensor, heads: int, dim: int, eps: float, cos: torch.Tensor, sin: torch.Tensor, *,
                    norm: bool = True) -> torch.Tensor:
    B = x.shape[0]
    out = x.new_empty(B, heads, dim)
    _library.lib.v4rl_heads_norm_rope(ptr(x), row_stride(x), B, heads, dim, eps, int(norm), ptr(cos), ptr(sin),
                                      cos.shape[-1], ptr(out))
    return out


def kv_store(x: torch.Tensor, w: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
             positions: torch.Tensor, window: torch.Tensor) -> None:
    B, W, dim = window.shape
    _library.lib.v4rl_kv_store(ptr(x), row_stride(x), B, dim, ptr(w), eps, ptr(cos), ptr(sin), cos.shape[-1],
                               ptr(positions), ptr(window), W)


def compress_step(kv: torch.Tensor, gate: torch.Tensor, positions: torch.Tensor, slots, compressor) -> None:
    """attention.Compressor.step for one token per row (slots: a CompressorSlots with capacity for this step)."""
    B, rate, width = slots.buffer_kv.shape
    d = compressor.out_dim
    _library.lib.v4rl_compress_step(
        ptr(kv), ptr(gate), row_stride(kv), B, rate, width, d, int(compressor.overlap), ptr(positions),
        ptr(slots.buffer_kv), ptr(slots.buffer_gate), ptr(slots.entries), slots.entries.shape[1],
        ptr(slots.overlap_kv), ptr(slots.overlap_gate), ptr(compressor.ape), ptr(compressor.norm.weight),
        compressor.norm.eps, ptr(compressor.inv_freq), compressor.inv_freq.shape[0])


def indexer_select(q: torch.Tensor, wraw: torch.Tensor, keys: torch.Tensor, rate: int, positions: torch.Tensor,
                   topk: int, threads: int) -> torch.Tensor:
    """Indices [rows, topk] of the entries each query keeps (ascending, -1 after the last). keys [B, cap, dim];
    q [rows, heads, dim] with rows = B (decode) or B * S (prefill, sequence-major)."""
    rows, heads, dim = q.shape
    sel = torch.empty(rows, topk, dtype=torch.int64)
    _library.lib.v4rl_indexer_select(ptr(q), rows, heads, dim, ptr(wraw), row_stride(wraw), ptr(keys), keys.shape[1],
                                     rate, ptr(positions), rows // keys.shape[0], topk, ptr(sel), threads)
    return sel


def attend(q: torch.Tensor, window: torch.Tensor, positions: torch.Tensor, entries: torch.Tensor | None, rate: int,
           sel: torch.Tensor | None, sinks: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, threads: int, *,
           sliding_window: int = 0, seq_len: int = 0) -> torch.Tensor:
    """Sink attention for q [rows, heads, dim]: decode (window = the ring [B, W, dim]) or, with seq_len, prefill
    (window = the K=V rows [B * seq_len, dim] of whole sequences, `sliding_window` of them seen per query)."""
    rows, heads, dim = q.shape
    W = window.shape[1] if not seq_len else sliding_window
    out = torch.empty_like(q)
    _library.lib.v4rl_attend(ptr(q), rows, heads, dim, ptr(window), W, seq_len, ptr(positions), ptr(entries),
                             0 if entries is None else entries.shape[1], max(rate, 1), ptr(sel),
                             0 if sel is None else sel.shape[1], ptr(sinks), dim ** -0.5, ptr(cos), ptr(sin),
                             cos.shape[-1], ptr(out), threads)
    return out


PANEL = 32
"""Output columns per panel of a packed weight (fused.c's packed GEMM)."""


def pack(w: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """A weight [groups*N, K] (or [N, K]) laid out for fused.c's GEMM: [groups, ceil(N/PANEL), K, PANEL], panel p
    holding output columns p*PANEL.. of each group (zero past N)."""
    w = w.detach().float().reshape(groups, -1, w.shape[-1])
    n = w.shape[1]
    w = F.pad(w, (0, 0, 0, -n % PANEL))
    return w.view(groups, -1, PANEL, w.shape[-1]).transpose(2, 3).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, n_out: int, threads: int) -> torch.Tensor:
    """x [M, groups*K] (rows contiguous, any row stride) @ W^T with W `pack`ed: [M, groups*n_out]; groups > 1 is a
    block-diagonal (grouped) linear layer, group g reading columns g*K.. and writing columns g*n_out.."""
    groups, _, K, _ = packed.shape
    M = x.shape[0]
    out = x.new_empty(M, groups * n_out)
    _library.lib.v4rl_linear(ptr(x), row_stride(x), M, ptr(packed), groups, n_out, K, ptr(out), groups * n_out,
                             threads)
    return out


def moe(x: torch.Tensor, token_ids: torch.Tensor, plan, threads: int, chosen: torch.Tensor | None = None
        ) -> torch.Tensor:
    """layers.MoE for x [B, D] (plan: fused_model's MoEPlan with the packed weights); `chosen` (int64 [B, k]),
    if given, receives the experts each row was routed to."""
    B, D = x.shape
    out = x.new_empty(B, D)
    if _library.lib.v4rl_moe(ptr(x), B, D, plan.inter, plan.n_experts, plan.k, ptr(plan.gate), ptr(plan.bias),
                             ptr(plan.tid2eid), ptr(token_ids), plan.scaling, ptr(plan.w13), ptr(plan.w2),
                             ptr(plan.s13), ptr(plan.s2), plan.limit, ptr(out), ptr(chosen), threads) != 0:
        raise MemoryError(f"v4rl_moe could not allocate its scratch ({B} rows x {plan.k} experts, hidden {D})")
    return out


def sample(rows: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor) -> tuple[list[int], list[float]]:
    """Inverse-CDF tokens and RAW logprobs of logits rows [B, V] (engines/rollout/sampling.py `sample_rows`)."""
    B, V = rows.shape
    tokens, logprobs = torch.empty(B, dtype=torch.int64), torch.empty(B, dtype=torch.float32)
    _library.lib.v4rl_sample(ptr(rows), B, V, ptr(temperatures), uniforms.data_ptr(), ptr(tokens), ptr(logprobs))
    return tokens.tolist(), logprobs.tolist()
