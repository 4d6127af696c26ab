"""Pins the weight formats of checkpoints/quant.py: error bounds, scale rules, bit layouts, transformers parity.

Bounds checked here:
  FP8 E4M3 (3 mantissa bits): |w - deq| <= 2**-4 * |w| for values in the normal range, and
    <= 2**-10 * scale (half the subnormal step 2**-9) below it; no value saturates.
  FP4 E2M1: |w - deq| <= half the local grid step (0.5 / 1 / 2 on [0,2] / [2,4] / [4,6]) times the scale,
    and deq is the nearest grid point (ties to even code).
Bit layouts are compared with transformers' own Fp8Dequantize (nibble order, block dequant), so a
checkpoint we write reads the same in transformers.

    .venv/bin/python -m pytest tests/test_quant.py -q        (CPU, a few seconds)
"""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from checkpoints.quant import (
    FP4_E2M1_VALUES,
    UE8M0,
    dequantize_fp4_e2m1,
    dequantize_fp8_blockwise,
    expand_block_scale,
    fnuz_to_fp8,
    fp8_to_fnuz,
    is_power_of_two,
    pow2_ceil,
    quantize_fp4_e2m1,
    quantize_fp8_blockwise,
    scale_to_float32,
    tensor_checksum,
    to_ue8m0,
    unpack_fp4_e2m1,
)

NUM_GPUS = 0
GRID = torch.tensor(sorted({abs(v) for v in FP4_E2M1_VALUES}))


def _weight(m: int, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Mixed magnitudes per block so scales differ and small values reach the subnormal range.
    return torch.randn(m, n, generator=g) * torch.logspace(-3, 1, m)[:, None]


# ---------------------------------------------------------------------------------------------- FP8
@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (1, 5), (128, 128), (129, 1)])
@pytest.mark.parametrize("scale_fmt", ["ue8m0", "fp32"])
def test_fp8_round_trip_within_bound(shape, scale_fmt):
    w = _weight(*shape)
    q, s = quantize_fp8_blockwise(w, scale_fmt=scale_fmt)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert tuple(s.shape) == (-(-shape[0] // 128), -(-shape[1] // 128))
    assert s.dtype == (UE8M0 if scale_fmt == "ue8m0" else torch.float32)
    deq = dequantize_fp8_blockwise(q, s, out_dtype=torch.float32)
    per_elem_scale = expand_block_scale(s, shape, (128, 128))
    bound = torch.maximum(2**-4 * w.abs(), 2**-10 * per_elem_scale) * (1 + 1e-6)
    assert bool(((deq - w).abs() <= bound).all()), (deq - w).abs().div(bound).max()
    assert q.float().abs().max() <= 448


def test_ue8m0_scale_is_smallest_power_of_two_without_overflow():
    w = _weight(300, 260)
    q, s = quantize_fp8_blockwise(w, scale_fmt="ue8m0")
    assert is_power_of_two(s)
    sf = scale_to_float32(s)
    padded = torch.nn.functional.pad(w, (0, 384 - 260, 0, 384 - 300))
    amax = padded.reshape(3, 128, 3, 128).abs().amax(dim=(1, 3))
    assert bool((amax / sf <= 448).all())  # no overflow past e4m3's max
    assert bool((amax / sf > 224).all())  # and not a power of two too large (rounded *up*, once)


def test_fp32_scale_is_amax_over_448_and_zero_block_gets_one():
    w = _weight(256, 128)
    w[:128] = 0
    q, s = quantize_fp8_blockwise(w, scale_fmt="fp32")
    assert s[0, 0] == 1 and bool((q[:128].float() == 0).all())
    assert torch.allclose(s[1, 0], w[128:].abs().max() / 448, rtol=0, atol=0)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale_fmt", ["ue8m0", "fp32", "uint8"])
def test_fp8_dequant_matches_transformers_bit_for_bit(out_dtype, scale_fmt):
    w = _weight(256, 384, seed=1)
    q, s = quantize_fp8_blockwise(w, scale_fmt="fp32" if scale_fmt == "fp32" else "ue8m0")
    if scale_fmt == "uint8":  # MXFP8-style exponent bytes
        s = s.view(torch.uint8)
    theirs = Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=out_dtype)
    ours = dequantize_fp8_blockwise(q, s, out_dtype=out_dtype)
    assert ours.dtype == theirs.dtype and torch.equal(ours.view(torch.int16 if out_dtype == torch.bfloat16
                                                                  else torch.int32),
                                                      theirs.view(torch.int16 if out_dtype == torch.bfloat16
                                                                  else torch.int32))


def test_fp8_scale_shape_mismatch_is_refused():
    q, s = quantize_fp8_blockwise(_weight(200, 130))
    with pytest.raises(ValueError, match=r"expected \(2, 2\)"):
        dequantize_fp8_blockwise(q, s[:1])


# ---------------------------------------------------------------------------------------------- FP4
def _local_half_step(mag: torch.Tensor) -> torch.Tensor:
    return torch.where(mag <= 2, 0.25, torch.where(mag <= 4, 0.5, 1.0))


@pytest.mark.parametrize("shape", [(128, 128), (3, 64), (1, 32)])
def test_fp4_round_trip_within_half_grid_step(shape):
    w = _weight(*shape, seed=2)
    packed, s = quantize_fp4_e2m1(w)
    assert packed.dtype == torch.int8 and tuple(packed.shape) == (shape[0], shape[1] // 2)
    assert s.dtype == UE8M0 and tuple(s.shape) == (shape[0], shape[1] // 32)
    sf = scale_to_float32(s).repeat_interleave(32, dim=1)
    deq = dequantize_fp4_e2m1(packed, s, out_dtype=torch.float32)
    x = w / sf
    assert bool((x.abs() <= 6).all())
    assert bool(((deq - w).abs() <= _local_half_step(x.abs()) * sf).all())
    # nearest grid point, exactly
    nearest = (x.abs()[..., None] - GRID).abs().min(dim=-1).values
    assert torch.equal((deq / sf - x).abs(), nearest)


def test_fp4_scale_is_tight_power_of_two():
    w = _weight(64, 128, seed=3)
    _, s = quantize_fp4_e2m1(w)
    assert is_power_of_two(s)
    ratio = w.reshape(64, 4, 32).abs().amax(-1) / scale_to_float32(s)
    assert bool((ratio <= 6).all()) and bool((ratio > 3).all())


def test_fp4_ties_round_to_even_code():
    x = torch.zeros(1, 32)
    x[0, :10] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.1, 6.0, -6.0])
    packed, s = quantize_fp4_e2m1(x)
    assert scale_to_float32(s).item() == 1.0
    deq = dequantize_fp4_e2m1(packed, s, out_dtype=torch.float32)[0, :10]
    assert deq.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, 6.0, -6.0]
    assert not torch.signbit(deq[7])  # a tiny negative rounds to +0, not -0


def test_fp4_nibble_order_matches_transformers_unpack():
    every_byte = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.int8).reshape(8, 32)
    theirs = Fp8Dequantize(None)._unpack_fp4(every_byte)
    assert torch.equal(unpack_fp4_e2m1(every_byte), theirs)
    # and the packer puts even columns in the low nibble: column 0 = 0.5 (code 1), column 1 = 6 (code 7)
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 0.5, 6.0
    packed, _ = quantize_fp4_e2m1(x)
    assert packed.view(torch.uint8)[0, 0].item() == 0x71


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fp4_dequant_matches_transformers_bit_for_bit(out_dtype):
    w = _weight(128, 256, seed=4)
    packed, s = quantize_fp4_e2m1(w)
    theirs = Fp8Dequantize(None)._dequantize_one(packed, s, output_dtype=out_dtype)
    assert torch.equal(dequantize_fp4_e2m1(packed, s, out_dtype=out_dtype), theirs)


def test_fp4_refuses_input_dim_not_multiple_of_group():
    with pytest.raises(ValueError, match="multiple of the scale group"):
        quantize_fp4_e2m1(torch.randn(4, 48))


# ---------------------------------------------------------------------------------------------- UE8M0
def test_ue8m0_helpers():
    b = torch.tensor([0, 1, 100, 127, 128, 254], dtype=torch.uint8)
    expect = torch.tensor([2.0**-127, 2.0**-126, 2.0**-27, 1.0, 2.0, 2.0**127])
    assert torch.equal(scale_to_float32(b), expect)
    assert torch.equal(to_ue8m0(expect).view(torch.uint8), b)
    assert torch.equal(scale_to_float32(b.view(UE8M0)), expect)
    assert torch.equal(pow2_ceil(torch.tensor([1.0, 1.5, 3.0, 0.3, 2.0**-130, 0.0078125])),
                       torch.tensor([1.0, 2.0, 4.0, 0.5, 2.0**-127, 0.0078125]))
    with pytest.raises(ValueError, match="powers of two"):
        to_ue8m0(torch.tensor([3.0]))
    with pytest.raises(TypeError):
        scale_to_float32(torch.tensor([1], dtype=torch.int32))


# ---------------------------------------------------------------------------------------------- fnuz
def _every_fp8_code() -> torch.Tensor:
    codes = [b for b in range(256) if b & 0x7F != 0x7F]  # all but the two e4m3fn NaNs
    return torch.tensor(codes, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn).reshape(1, -1)


@pytest.mark.parametrize("make_scale", [lambda: to_ue8m0(torch.tensor([[2.0**-7]])),
                                        lambda: torch.tensor([[0.013]]),
                                        lambda: torch.tensor([[120]], dtype=torch.uint8)],
                         ids=["e8m0", "fp32", "uint8"])
def test_fnuz_round_trip_exact_including_negative_zero(make_scale):
    scale = make_scale()
    q = _every_fp8_code()
    block = (1, q.shape[1])
    qz, sz = fp8_to_fnuz(q, scale)
    assert qz.dtype == torch.float8_e4m3fnuz and sz.dtype == scale.dtype
    assert torch.equal(scale_to_float32(sz), 2 * scale_to_float32(scale))
    # same value as the e4m3fn original, and no fnuz NaN (0x80) anywhere
    assert torch.equal(qz.float() * scale_to_float32(sz), q.float() * scale_to_float32(scale))
    assert not bool((qz.view(torch.uint8) == 0x80).any())
    back, s_back = fnuz_to_fp8(qz, sz)
    assert torch.equal(back.float() * scale_to_float32(s_back), q.float() * scale_to_float32(scale))
    assert s_back.dtype == scale.dtype and torch.equal(scale_to_float32(s_back), scale_to_float32(scale))
    bits, back_bits = q.view(torch.uint8), back.view(torch.uint8)
    neg_zero = bits == 0x80
    assert torch.equal(back_bits[~neg_zero], bits[~neg_zero]) and bool((back_bits[neg_zero] == 0).all())
    assert dequantize_fp8_blockwise(back, s_back, block=block).equal(dequantize_fp8_blockwise(q, scale, block=block))


def test_fnuz_refuses_nan_and_unrepresentable_240():
    nan = torch.tensor([[0x7F]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="NaN"):
        fp8_to_fnuz(nan, torch.tensor([[1.0]]))
    fnuz_max = torch.tensor([[0x7F]], dtype=torch.uint8).view(torch.float8_e4m3fnuz)
    with pytest.raises(ValueError, match="240"):
        fnuz_to_fp8(fnuz_max, torch.tensor([[1.0]]))


# ---------------------------------------------------------------------------------------------- checksum
def test_tensor_checksum_sees_bytes_dtype_and_shape():
    t = torch.arange(12, dtype=torch.float32)
    base = tensor_checksum(t)
    assert tensor_checksum(t.clone()) == base and len(base) == 64
    assert tensor_checksum(t.reshape(3, 4)) != base
    assert tensor_checksum(t.view(torch.int32)) != base
    flipped = t.clone()
    flipped.view(torch.int32)[5] ^= 1
    assert tensor_checksum(flipped) != base
    assert tensor_checksum(t.reshape(3, 4).t()) == tensor_checksum(t.reshape(3, 4).t().contiguous())
    q, s = quantize_fp8_blockwise(t.reshape(3, 4))
    for x in (q, s, torch.tensor(True), torch.tensor(1.5)):
        assert len(tensor_checksum(x)) == 64
