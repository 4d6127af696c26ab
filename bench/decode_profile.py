"""Where one decode step's time goes, for the rollout benches (bench/rollout.py, bench/rollout_sweep.py).

`step_profiles` runs one batched decode step on each side after the same prefill: ours (model.decode, through
the fused kernels as the rollout engine runs it) and transformers (a cached forward of one token per row), and
reports for each the aten ops dispatched per step, the wall time per step and the profiler self time of the
aten matmul kernels; for ours also the time inside each fused kernel (`kernels_ms`, wall time per step of
every call of engines/model/fused.py's entry points: a native call is not an aten op, and our matmuls run
inside `linear` and `moe`) and what remains of those same steps (`other_ms`: Python, the remaining torch ops,
allocation).

    from bench.decode_profile import step_profiles
    with torch.inference_mode():
        ours, theirs = step_profiles(model, reference, prompt_ids, next_ids, steps=10)
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

MATMUL_OPS = frozenset({"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm"})
FUSED_ENTRY_POINTS = ("hc_pre", "hc_post", "rms_norm", "heads_norm_rope", "kv_store", "compress_step",
                      "indexer_select", "attend", "linear", "moe", "sample")


def step_profiles(ours_model, reference, ids: torch.Tensor, tokens: torch.Tensor, steps: int
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(ours, transformers) profiles of one decode step of len(ids) rows (call under inference_mode)."""
    from engines.model import DecodeBatch

    batch = DecodeBatch.from_caches(ours_model.cfg, ours_model.prefill(ids)[1])
    ours = profile_step(lambda: ours_model.decode(tokens, batch), steps)
    with fused_kernel_times() as kernel_ms:
        t0 = time.perf_counter()
        for _ in range(steps):
            ours_model.decode(tokens, batch)
        timed_ms = (time.perf_counter() - t0) * 1e3 / steps
    ours["kernels_ms"] = {name: ms / steps for name, ms in kernel_ms.most_common()}
    ours["other_ms"] = timed_ms - sum(ours["kernels_ms"].values())  # same steps as the kernels' times
    past = reference(input_ids=ids, use_cache=True).past_key_values
    theirs = profile_step(lambda: reference(input_ids=tokens[:, None], past_key_values=past, use_cache=True), steps)
    return ours, theirs


class _CountOps(TorchDispatchMode):
    """Counts the aten ops dispatched while active (below autograd: what actually runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def profile_step(step: Callable[[], Any], steps: int) -> dict[str, float]:
    for _ in range(3):  # warm-up (allocator, caches grown past their first doubling)
        step()
    with _CountOps() as counted:
        step()
    step_ms = min(timed(step) for _ in range(steps)) * 1e3
    matmul_ms = matmul_ms_per_call(step, steps)
    return {"ops": counted.count, "step_ms": step_ms, "matmul_ms": matmul_ms, "matmul_share": matmul_ms / step_ms}


def matmul_ms_per_call(fn: Callable[[], Any], repeats: int) -> float:
    """Profiler self time of the aten matmul kernels per call of fn, in ms."""
    from torch.profiler import profile

    with profile() as prof:
        for _ in range(repeats):
            fn()
    return sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in MATMUL_OPS) / repeats / 1e3


@contextlib.contextmanager
def fused_kernel_times() -> Iterator[Counter]:
    """Milliseconds spent in each fused-kernel entry point while active (wall time, summed over calls)."""
    from engines.model import fused

    spent: Counter = Counter()
    originals = {name: getattr(fused, name) for name in FUSED_ENTRY_POINTS}

    def timed(name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += (time.perf_counter() - t0) * 1e3
        return call

    for name, fn in originals.items():
        setattr(fused, name, timed(name, fn))
    try:
        yield spent
    finally:
        for name, fn in originals.items():
            setattr(fused, name, fn)


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
