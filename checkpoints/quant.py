"""Weight quantization formats of DeepSeek-V4 checkpoints, in plain torch (CPU-friendly, no kernels).

- FP8 E4M3 with one scale per 128x128 block (attention, shared experts, and the routed experts of the
  public FP8 repackage). The stored scale is the *dequantization* multiplier, DeepSeek's `scale_inv`:
  `w[i, j] ≈ float(q[i, j]) * scale[i // 128, j // 128]`. Scales are either UE8M0 (a power of two,
  stored as `torch.float8_e8m0fnu`, rounded *up* so `|w| / scale <= 448`) or plain fp32 (`amax / 448`).
  Ragged edges are fine: the last block row/column is simply smaller.
- FP4 E2M1 (MXFP4-style) routed experts: values {0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6}, two per byte
  (low nibble = even column, high nibble = odd column, the order transformers unpacks), stored as
  int8 `[out, in/2]` with a UE8M0 scale per 1x32 block along the input dim, `[out, in/32]`.
- e4m3fn <-> e4m3fnuz (ROCm MI300-class): the same bits mean half the value in fnuz, so the scale doubles.
- `tensor_checksum`: a sha256 over dtype, shape and raw bytes, to compare tensors across engines.

Dequantization always computes in fp32 and casts last, so on full blocks it is bit-identical to
transformers' `Fp8Dequantize._dequantize_one` (`(q.float() * s.float()).to(out_dtype)`).

    >>> q, s = quantize_fp8_blockwise(torch.randn(200, 130))
    >>> w = dequantize_fp8_blockwise(q, s, out_dtype=torch.float32)

Run the checks: `.venv/bin/python -m pytest tests/test_quant.py -q`.
"""

from __future__ import annotations

import hashlib
from typing import Literal

import torch

FP8_E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
FP4_E2M1_MAX = 6.0
"""Largest E2M1 magnitude."""
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""Value of each 4-bit code (bit 3 = sign); the table transformers and DeepSeek use."""
UE8M0 = torch.float8_e8m0fnu
"""Storage dtype of power-of-two scales (value 2**(byte - 127); byte 0xFF is NaN)."""
_UE8M0_MIN_EXP, _UE8M0_MAX_EXP = -127, 127
# Magnitudes where round-to-nearest-even sends a tie *up* (the upper neighbour has the even code).
_FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_FP4_TIES_UP = (0.75, 1.75, 3.5)

ScaleFmt = Literal["ue8m0", "fp32"]


# ---------------------------------------------------------------------------------------------- scales
def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x (x > 0), exactly, clamped to the UE8M0 range [2**-127, 2**127]; float32."""
    x = x.to(torch.float32)
    mantissa, exponent = torch.frexp(x)  # x = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)  # already a power of two
    exponent = exponent.clamp(_UE8M0_MIN_EXP, _UE8M0_MAX_EXP)
    return torch.ldexp(torch.ones_like(x), exponent)


def scale_to_float32(scale: torch.Tensor) -> torch.Tensor:
    """Read a stored scale as fp32 multipliers: float8_e8m0fnu, uint8 exponent bytes (2**(b-127)) or floats."""
    if scale.dtype == torch.uint8:
        return scale.view(UE8M0).to(torch.float32)  # same bits; the e8m0 -> fp32 cast is exact
    if scale.dtype == UE8M0 or scale.dtype.is_floating_point:
        return scale.to(torch.float32)
    raise TypeError(f"a scale must be float8_e8m0fnu, uint8 exponent bytes or a float dtype; got {scale.dtype}")


def to_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Store exact powers of two as float8_e8m0fnu; raises if any value is not a power of two in range."""
    s = scale.to(torch.float32)
    mantissa, exponent = torch.frexp(s)
    ok = (mantissa == 0.5) & (exponent - 1 >= _UE8M0_MIN_EXP) & (exponent - 1 <= _UE8M0_MAX_EXP)
    if not bool(ok.all()):
        bad = s[~ok].flatten()[:4].tolist()
        raise ValueError(f"UE8M0 scales must be powers of two in [2**-127, 2**127]; got e.g. {bad}. "
                         "Round with pow2_ceil first.")
    # Build the byte directly: torch's fp32 -> e8m0 cast rounds to nearest, which is right here but not promised.
    return (exponent - 1 + 127).to(torch.uint8).view(UE8M0)


def is_power_of_two(t: torch.Tensor) -> bool:
    """True when every element of a (fp32-readable) scale is an exact positive power of two."""
    mantissa, _ = torch.frexp(scale_to_float32(t))
    return bool((mantissa == 0.5).all())


# ---------------------------------------------------------------------------------------------- FP8 blocks
def _pad_to_blocks(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    bm, bn = block
    m, n = w.shape
    pm, pn = (-m) % bm, (-n) % bn
    return torch.nn.functional.pad(w, (0, pn, 0, pm)) if pm or pn else w


def quantize_fp8_blockwise(
    w: torch.Tensor,
    *,
    block: tuple[int, int] = (128, 128),
    scale_fmt: ScaleFmt = "ue8m0",
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight to FP8 with one dequantization scale per block.

    Returns `(q, scale)`: q has w's shape and `fp8_dtype`; scale is `[ceil(M/bm), ceil(N/bn)]`,
    float8_e8m0fnu for "ue8m0" (power of two >= amax/fp8_max) or float32 for "fp32" (amax/fp8_max).
    All-zero blocks get scale 1.
    """
    if w.ndim != 2:
        raise ValueError(f"quantize_fp8_blockwise wants a 2-D weight; got shape {tuple(w.shape)}")
    if scale_fmt not in ("ue8m0", "fp32"):
        raise ValueError(f"scale_fmt must be 'ue8m0' or 'fp32'; got {scale_fmt!r}")
    fp8_max = float(torch.finfo(fp8_dtype).max)
    bm, bn = block
    m, n = w.shape
    padded = _pad_to_blocks(w.detach().to(torch.float32), block)
    gm, gn = padded.shape[0] // bm, padded.shape[1] // bn
    tiles = padded.reshape(gm, bm, gn, bn)
    amax = tiles.abs().amax(dim=(1, 3))
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("cannot quantize a weight with inf/NaN values to FP8")
    if scale_fmt == "ue8m0":
        scale = torch.where(amax > 0, pow2_ceil(amax / fp8_max), torch.ones_like(amax))
    else:
        scale = torch.where(amax > 0, amax / fp8_max, torch.ones_like(amax))
    scaled = tiles / scale[:, None, :, None]
    q = scaled.clamp(-fp8_max, fp8_max).to(fp8_dtype).reshape(padded.shape)[:m, :n].contiguous()
    return q, (to_ue8m0(scale) if scale_fmt == "ue8m0" else scale)


def expand_block_scale(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Per-element fp32 multipliers of a block scale, cropped to `shape` (ragged edges included)."""
    bm, bn = block
    m, n = shape
    want = (-(-m // bm), -(-n // bn))
    if tuple(scale.shape) != want:
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match weight {tuple(shape)} with "
                         f"{bm}x{bn} blocks; expected {want}")
    s = scale_to_float32(scale)
    return s.repeat_interleave(bm, dim=0).repeat_interleave(bn, dim=1)[:m, :n]


def dequantize_fp8_blockwise(
    q: torch.Tensor,
    scale: torch.Tensor,
    *,
    block: tuple[int, int] = (128, 128),
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """`q.float() * scale[i // bm, j // bn]` in fp32, then cast to out_dtype."""
    if q.ndim != 2:
        raise ValueError(f"dequantize_fp8_blockwise wants a 2-D weight; got shape {tuple(q.shape)}")
    return (q.to(torch.float32) * expand_block_scale(scale, tuple(q.shape), block)).to(out_dtype)


# ---------------------------------------------------------------------------------------------- FP4 E2M1
def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values (already divided by their scale, |x| <= 6) to the nearest E2M1 code, ties to even."""
    mag = x.abs()
    idx = torch.zeros_like(mag, dtype=torch.int64)
    for mid in _FP4_MIDPOINTS:  # a tie (mag == mid) stays on the lower neighbour ...
        idx += mag > mid
    for mid in _FP4_TIES_UP:  # ... except where the upper neighbour has the even mantissa
        idx += mag == mid
    idx = idx.clamp(max=7)
    sign = ((x < 0) & (idx > 0)).to(idx.dtype) << 3  # no -0: a tiny negative becomes +0
    return (idx | sign).to(torch.uint8)


def quantize_fp4_e2m1(w: torch.Tensor, *, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight `[out, in]` to packed FP4 E2M1 with a UE8M0 scale per 1x`group` block.

    Returns `(packed, scale)`: packed is int8 `[out, in/2]` (low nibble = column 2k, high = 2k+1),
    scale is float8_e8m0fnu `[out, in/group]`, the power of two with `amax / scale <= 6`.
    """
    if w.ndim != 2:
        raise ValueError(f"quantize_fp4_e2m1 wants a 2-D weight; got shape {tuple(w.shape)}")
    out, inp = w.shape
    if inp % group or group % 2:
        raise ValueError(f"FP4 experts need the input dim ({inp}) to be a multiple of the scale group ({group}, "
                         "itself even); pad the weight or use FP8 experts (expert_dtype='fp8')")
    x = w.detach().to(torch.float32).reshape(out, inp // group, group)
    amax = x.abs().amax(dim=-1)
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("cannot quantize a weight with inf/NaN values to FP4")
    scale = torch.where(amax > 0, pow2_ceil(amax / FP4_E2M1_MAX), torch.ones_like(amax))
    codes = _e2m1_codes((x / scale[..., None]).reshape(out, inp))
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8).contiguous(), to_ue8m0(scale)


def unpack_fp4_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Packed int8/uint8 `[out, in/2]` -> fp32 grid values `[out, in]` (no scale applied)."""
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    u8 = packed.contiguous().view(torch.uint8)
    low, high = (u8 & 0xF).long().reshape(-1), (u8 >> 4).long().reshape(-1)
    pairs = torch.stack([lut.index_select(0, low), lut.index_select(0, high)], dim=-1)  # index_select: fast on CPU
    return pairs.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def dequantize_fp4_e2m1(
    packed: torch.Tensor,
    scale: torch.Tensor,
    *,
    group: int = 32,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Unpack FP4 E2M1 and multiply by the per-1x`group` scale in fp32, then cast to out_dtype."""
    if packed.dtype not in (torch.int8, torch.uint8) or packed.ndim != 2:
        raise ValueError(f"packed FP4 must be a 2-D int8/uint8 tensor; got {packed.dtype} {tuple(packed.shape)}")
    vals = unpack_fp4_e2m1(packed)
    out, inp = vals.shape
    if tuple(scale.shape) != (out, inp // group) or inp % group:
        raise ValueError(f"FP4 scale shape {tuple(scale.shape)} does not match packed weight "
                         f"{tuple(packed.shape)} (logical {out}x{inp}, 1x{group} blocks); "
                         f"expected {(out, inp // group)}")
    s = scale_to_float32(scale).repeat_interleave(group, dim=1)
    return (vals * s).to(out_dtype)


# ---------------------------------------------------------------------------------------------- fnuz
def _double_scale(scale: torch.Tensor, factor_exp: int) -> torch.Tensor:
    """Multiply a stored scale by 2**factor_exp, keeping its storage dtype (exact for powers of two)."""
    if scale.dtype == torch.uint8:
        e = scale.to(torch.int16) + factor_exp
        if bool(((e < 0) | (e > 254)).any()):
            raise ValueError("scale exponent leaves the UE8M0 range after the fnuz rescale")
        return e.to(torch.uint8)
    s = scale_to_float32(scale) * (2.0 ** factor_exp)
    return to_ue8m0(s) if scale.dtype == UE8M0 else s.to(scale.dtype)


def fp8_to_fnuz(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn weight + scale -> float8_e4m3fnuz weight + doubled scale (same bits, same values).

    The e4m3fn bit pattern 0x80 (-0) is NaN in fnuz and becomes +0. NaNs in the input are rejected.
    """
    if q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_to_fnuz wants float8_e4m3fn; got {q.dtype}")
    bits = q.view(torch.uint8)
    if bool(((bits & 0x7F) == 0x7F).any()):
        raise ValueError("FP8 weight holds NaN (0x7F/0xFF); re-export the checkpoint before converting to fnuz")
    bits = torch.where(bits == 0x80, torch.zeros_like(bits), bits)
    return bits.view(torch.float8_e4m3fnuz), _double_scale(scale, 1)


def fnuz_to_fp8(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fnuz weight + scale -> float8_e4m3fn weight + halved scale (inverse of fp8_to_fnuz).

    fnuz ±240 (0x7F/0xFF) would be ±480 at the halved scale, past e4m3fn's 448: re-quantize such
    weights from full precision instead. fnuz NaN (0x80) is rejected.
    """
    if q.dtype != torch.float8_e4m3fnuz:
        raise ValueError(f"fnuz_to_fp8 wants float8_e4m3fnuz; got {q.dtype}")
    bits = q.view(torch.uint8)
    if bool((bits == 0x80).any()):
        raise ValueError("fnuz weight holds NaN (0x80); it has no e4m3fn value")
    if bool(((bits & 0x7F) == 0x7F).any()):
        raise ValueError("fnuz weight holds ±240 (0x7F/0xFF), which e4m3fn cannot hold at the same block scale; "
                         "re-quantize from the full-precision weight with quantize_fp8_blockwise")
    return bits.view(torch.float8_e4m3fn), _double_scale(scale, -1)


# ---------------------------------------------------------------------------------------------- checksum
def tensor_checksum(t: torch.Tensor) -> str:
    """sha256 hex digest of dtype, shape and the raw bytes (contiguous, CPU) of a tensor."""
    h = hashlib.sha256()
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    flat = t.detach().contiguous().cpu().reshape(-1)
    if flat.numel():
        h.update(flat.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
