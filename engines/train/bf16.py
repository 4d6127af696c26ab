"""BF16 autocast for the embedded trainer, fast on CPUs without native BF16 matrix units.

Under `torch.autocast("cpu", dtype=torch.bfloat16)` every matmul rounds its inputs to BF16, multiplies with
float32 accumulation and returns BF16. On a CPU without AVX-512 (oneDNN reports no BF16 support, e.g. AMD Zen 3)
torch runs those matmuls on a reference path: measured here 0.86 GFLOP/s against 77 in float32, which made a
tiny-cpu GRPO step 3.3x slower than in float32 (20.9 s vs 6.3 s for 256 samples).

There the matmuls are emulated with the same arithmetic: operands rounded to BF16 and widened back (exact),
multiplied in float32 (products of BF16 values are exact in float32, sums accumulate in float32 as oneDNN's do),
result rounded to BF16. The casts are autograd ops, so the backward matmuls also see BF16-rounded operands and
produce BF16-rounded gradients, as autocast's BF16 backward does. Values differ from the native path only by the
order of float32 summation. Every other op still goes through autocast (its float32 and promotion lists).

    with bf16_autocast():            # = torch.autocast("cpu", dtype=torch.bfloat16), emulated matmuls if needed
        logits = model(input_ids).logits

V4RL_BF16_MATMUL=native|emulated overrides the choice (tests compare the two).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

MATMUL_ENV = "V4RL_BF16_MATMUL"
_MATMULS = frozenset({
    F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__,
    torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.addmm, torch.Tensor.addmm, torch.baddbmm,
    torch.Tensor.baddbmm, torch.einsum,
})
"""Autocast's BF16 matmuls as the model calls them (F.linear, @, bmm, einsum, ...)."""
_AUTOCAST_INPUTS = (torch.float32, torch.bfloat16, torch.float16)
"""The floating dtypes autocast casts to BF16 (float64 passes through it unchanged)."""


@functools.cache
def native_bf16_matmul() -> bool:
    """Whether this CPU multiplies BF16 natively (oneDNN's check: AVX-512 BW/VL/DQ or better)."""
    choice = os.environ.get(MATMUL_ENV, "").strip().lower()
    if choice in ("native", "emulated"):
        return choice == "native"
    if choice:
        raise ValueError(f"{MATMUL_ENV}={choice!r}: use 'native' or 'emulated' (or leave it unset to decide from "
                         "the CPU)")
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _widen(value):
    if isinstance(value, torch.Tensor) and value.dtype in _AUTOCAST_INPUTS:
        return value.to(torch.bfloat16).float()
    if isinstance(value, (list, tuple)):  # einsum's operands may come as one list
        return type(value)(_widen(v) for v in value)
    return value


class EmulatedBF16Matmuls(TorchFunctionMode):
    """Inside autocast(cpu, bfloat16): each matmul as float32 on BF16-rounded operands, result rounded to BF16."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _MATMULS or not torch.is_autocast_enabled("cpu") \
                or torch.get_autocast_dtype("cpu") != torch.bfloat16:
            return func(*args, **kwargs)
        with torch.autocast("cpu", enabled=False):
            out = func(*_widen(args), **{k: _widen(v) for k, v in kwargs.items()})
        return out.to(torch.bfloat16)


@contextlib.contextmanager
def bf16_autocast(enabled: bool = True):
    """torch.autocast("cpu", dtype=bfloat16, enabled=enabled), with emulated matmuls where BF16 is not native."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled))
        if enabled and not native_bf16_matmul():
            stack.enter_context(EmulatedBF16Matmuls())
        yield
