"""Streaming access to DeepSeek-V4 HF safetensors checkpoints: one tensor at a time, whatever the size.

- `plan_source(dir)`: validate a checkpoint from its config and safetensors *headers* only (names,
  dtypes, shapes, byte ranges; scales paired and shape-checked; truncated shards, index entries
  pointing nowhere, unknown names refused) -> `SourcePlan` of `SourceTensor`s in native order.
- `decode(tensor, files, scratch)`: read one tensor from its byte range and dequantize it to what a
  BF16 torch_dist stores (`TORCH_DIST_DTYPES`), through `fast_dequantize_fp8/fp4`: bit-identical to
  checkpoints/quant.py (tested), ~4x (FP8) and ~20x (FP4) faster on CPU. With power-of-two (UE8M0)
  scales FP8/FP4 value x 2**k is exact in BF16, so values come from a 256-entry table and are scaled
  in BF16; fp32 scales, ragged blocks or extreme exponents take the fp32 route and cast last, as the
  reference does. `reference_decode` uses checkpoints/quant.py itself (for verification).
- `hf_entries` + `SafetensorsStreamWriter`: write a shard whose tensor list is known up front,
  header first, then tensor by tensor (export never holds a shard in memory).
- `requantize_like`: re-encode with another checkpoint's block scales wherever they are exact, so an
  unchanged UE8M0 checkpoint re-exports byte for byte.

    plan = plan_source("ckpt/hf-fp8")
    files, scratch = HFFiles(plan.dir), Scratch()
    w = decode(plan.tensors["layers.0.attn.wq_a.weight"], files, scratch)     # bf16 [1024, 4096]

Tests: `.venv/bin/python -m pytest tests/test_convert.py -q -k "dequant or plan or requant"`.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import numpy as np
import torch

from checkpoints import hf
from checkpoints.hf import FP4_GROUP, FP8_BLOCK, INDEX_FILE, CheckpointError, QuantizedTensor
from checkpoints.paths import SafetensorsHeaderError, safetensors_header
from checkpoints.torch_dist import TORCH_DIST_DTYPES
from engines.model.config import ModelConfig
from engines.model.params import native_param_specs
from checkpoints.quant import FP4_E2M1_VALUES, UE8M0, dequantize_fp4_e2m1, dequantize_fp8_blockwise, scale_to_float32, to_ue8m0

ExportFormat = Literal["hf-bf16", "hf-fp8"]


class ConversionError(ValueError):
    """Conversion failed on a named tensor or file (bad values, a write error, a dead worker)."""


_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": UE8M0,
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
_FP4_STORED = (torch.int8, torch.uint8)


@dataclass(frozen=True)
class Stored:
    """One tensor as a safetensors file stores it: dtype, shape (FP4: packed `[.., n/2]` int8) and byte range."""

    file: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int


def read_safetensors_header(path: Path, file: str | None = None) -> dict[str, Stored]:
    """Parse a safetensors header without reading tensor data; refuses truncated or corrupt files.

    `file` is the name recorded in each `Stored` (the shard name relative to its checkpoint dir).
    """
    try:
        header, n, size = safetensors_header(path)
    except SafetensorsHeaderError as exc:
        raise CheckpointError(str(exc)) from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the safetensors header ({exc}); re-download or re-export it") \
            from exc
    out: dict[str, Stored] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            shape = [int(s) for s in info["shape"]]
            code = info["dtype"]
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: header entry of tensor {name!r} is malformed ({exc!r}); the file is "
                                  "corrupt: re-download or re-export it") from exc
        if code == "F4":  # packed E2M1: logical shape in the header, two values per byte
            dtype, shape[-1] = torch.int8, shape[-1] // 2
        elif code in _ST_DTYPES:
            dtype = _ST_DTYPES[code]
        else:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {code}, which no DeepSeek-V4 checkpoint uses")
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(f"{path}: tensor {name!r} spans {end - begin} bytes but {code} {info['shape']} "
                                  f"needs {math.prod(shape) * dtype.itemsize}; the file is corrupt")
        if 8 + n + end > size:
            raise CheckpointError(f"{path} is truncated: tensor {name!r} ends at byte {8 + n + end} but the file has "
                                  f"{size}; re-download or re-export it")
        out[name] = Stored(file or path.name, name, dtype, tuple(shape), 8 + n + begin, end - begin)
    return out


@dataclass(frozen=True)
class SourceTensor:
    """A native tensor of the source: where its weight (and scale) are stored and how it decodes."""

    native: str
    kind: str
    """Storage kind from engines/model/params.py (fp8, fp4, bf16, fp32, int64)."""
    shape: tuple[int, ...]
    """Logical (dequantized) shape."""
    weight: Stored
    scale: Stored | None
    quant: Literal["fp8", "fp4"] | None
    block: tuple[int, int]

    @property
    def out_dtype(self) -> torch.dtype:
        return TORCH_DIST_DTYPES[self.kind]

    @property
    def out_nbytes(self) -> int:
        return math.prod(self.shape) * self.out_dtype.itemsize

    @property
    def in_nbytes(self) -> int:
        return self.weight.nbytes + (self.scale.nbytes if self.scale else 0)


def row_slice(t: SourceTensor, lo: int, hi: int) -> SourceTensor:
    """Rows lo:hi of an unquantized source tensor, as a SourceTensor of its own (a byte range of the original)."""
    if t.quant is not None or not 0 <= lo < hi <= t.shape[0]:
        raise ValueError(f"cannot take rows {lo}:{hi} of {t.native!r} ({t.quant or t.weight.dtype}, {t.shape})")
    row = t.weight.nbytes // t.shape[0]
    shape = (hi - lo, *t.shape[1:])
    weight = Stored(t.weight.file, t.weight.name, t.weight.dtype, shape, t.weight.start + lo * row, (hi - lo) * row)
    return SourceTensor(t.native, t.kind, shape, weight, None, None, t.block)


@dataclass(frozen=True)
class SourcePlan:
    """A validated HF source: config, and every native tensor in spec order."""

    dir: Path
    cfg: ModelConfig
    raw_config: dict[str, Any]
    tensors: dict[str, SourceTensor]
    disk_names: list[str]
    skipped: list[str] = field(default_factory=list)
    """On-disk names deliberately not converted (the MTP head)."""


def plan_source(src: str | Path) -> SourcePlan:
    """Read config, index and shard headers of a HF checkpoint and validate every tensor against the config.

    Raises CheckpointError naming the file and the tensor for: a missing or truncated shard, an index
    entry the shard lacks, an unknown or duplicated name, a quantized weight without scale, a scale of
    the wrong dtype or shape, a missing tensor, a shape that does not match config.json.
    """
    src = Path(src)
    cfg, raw = hf.read_config(src)
    qc = raw.get("quantization_config") or {}
    fp8_block = tuple(int(b) for b in (qc.get("weight_block_size") or FP8_BLOCK))
    listing, by_file = hf._shard_listing(src)
    weights: dict[str, Stored] = {}
    scales: dict[str, Stored] = {}
    disk_names: list[str] = []
    skipped: list[str] = []
    for shard, names in by_file.items():
        header = read_safetensors_header(src / shard, shard)
        for name in sorted(header) if names is None else names:
            st = header.get(name)
            if st is None:
                raise CheckpointError(f"{src / shard}: tensor {name!r} is listed in {INDEX_FILE} but not stored in "
                                      "this shard; re-download the shard or fix the index")
            disk_names.append(name)
            native, is_scale = hf._native_name(name, str(src / shard))
            if native is None:
                skipped.append(name)
                continue
            table = scales if is_scale else weights
            if native in table:
                raise CheckpointError(f"{src / shard}: tensor {name!r} duplicates {native!r} already in "
                                      f"{table[native].file}; remove the stale shard or fix the index")
            table[native] = st
    for native, st in scales.items():
        if native not in weights:
            raise CheckpointError(f"{src / st.file}: scale for {native!r} has no weight tensor anywhere in {src}; "
                                  "the checkpoint is incomplete: re-download or re-export it")
    specs = native_param_specs(cfg)
    shapes = {}
    tensors: dict[str, SourceTensor] = {}
    for native, st in weights.items():
        spec = specs.get(native)
        if spec is None:
            shapes[native] = SimpleNamespace(shape=st.shape)
            continue
        tensors[native] = _classify(src, native, spec.kind, st, scales.get(native), fp8_block)
        shapes[native] = SimpleNamespace(shape=tensors[native].shape)
    hf._check_state(shapes, specs, where=str(listing), files={n: str(src / s.file) for n, s in weights.items()})
    return SourcePlan(src, cfg, raw, {n: tensors[n] for n in specs}, disk_names, skipped)


def _classify(src: Path, native: str, kind: str, st: Stored, scale: Stored | None,
              fp8_block: tuple[int, ...]) -> SourceTensor:
    where = src / st.file
    if kind == "int64":
        if scale is not None or st.dtype.is_floating_point or st.dtype == torch.bool:
            raise CheckpointError(f"{where}: tensor {native!r} must be an integer table; got {st.dtype}")
        return SourceTensor(native, kind, st.shape, st, None, None, (1, 1))
    quantized = st.dtype == torch.float8_e4m3fn or st.dtype in _FP4_STORED
    if not quantized:
        if scale is not None:
            raise CheckpointError(f"{src / scale.file}: {native!r} has a scale but its weight in {where} is "
                                  f"{st.dtype}, not FP8/FP4; drop the stray scale or re-export the checkpoint")
        if not st.dtype.is_floating_point or st.dtype.itemsize == 1:
            raise CheckpointError(f"{where}: tensor {native!r} has dtype {st.dtype}; expected bf16/fp16/fp32, or "
                                  "float8_e4m3fn / packed FP4 with a scale")
        return SourceTensor(native, kind, st.shape, st, None, None, (1, 1))
    if scale is None:
        raise CheckpointError(f"{where}: quantized weight {native!r} ({st.dtype}) has no scale "
                              f"({hf.scale_name(native)} / {native}_scale_inv) in any shard; the checkpoint is "
                              "incomplete: re-download or re-export it (never use FP8 bytes unscaled)")
    if scale.dtype not in (UE8M0, torch.uint8, torch.float32):
        raise CheckpointError(f"{src / scale.file}: scale of {native!r} has dtype {scale.dtype}; expected "
                              "float8_e8m0fnu, uint8 exponent bytes or float32")
    if len(st.shape) != 2:
        raise CheckpointError(f"{where}: quantized weight {native!r} has shape {st.shape}; only 2-D weights are")
    m, n = st.shape
    if st.dtype == torch.float8_e4m3fn:
        quant, block, logical = "fp8", (fp8_block[0], fp8_block[1]), (m, n)
        want = (-(-m // block[0]), -(-n // block[1]))
    else:
        quant, block, logical = "fp4", (1, FP4_GROUP), (m, 2 * n)
        want = (m, 2 * n // FP4_GROUP)
    if scale.shape != want:
        raise CheckpointError(f"{src / scale.file}: scale of {native!r} has shape {scale.shape}; a {quant} weight "
                              f"of stored shape {st.shape} needs {want} ({block[0]}x{block[1]} blocks)")
    return SourceTensor(native, kind, logical, st, scale, quant, block)


class Scratch:
    """Byte buffers a worker reuses from tensor to tensor (fresh big allocations cost page faults, i.e. sys time).

    Grows to the largest tensor seen; hand out views only while the previous tensor is no longer needed.
    """

    def __init__(self) -> None:
        self._bufs: dict[str, np.ndarray] = {}

    def get(self, slot: str, nbytes: int) -> np.ndarray:
        buf = self._bufs.get(slot)
        if buf is None or buf.size < nbytes:
            buf = self._bufs[slot] = np.empty(nbytes, dtype=np.uint8)
        return buf[:nbytes]


class HFFiles:
    """Open shard files of one directory; read a stored tensor from its byte range."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._handles: dict[str, Any] = {}

    def read(self, st: Stored, buf: np.ndarray | None = None) -> torch.Tensor:
        """The tensor's bytes in `buf` (a uint8 array of exactly st.nbytes, reused by the caller) or fresh memory."""
        f = self._handles.get(st.file)
        if f is None:
            f = self._handles[st.file] = open(self.root / st.file, "rb")  # noqa: SIM115 - closed in close()
        buf = np.empty(st.nbytes, dtype=np.uint8) if buf is None else buf
        f.seek(st.start)
        got = f.readinto(memoryview(buf))
        if got != st.nbytes:
            raise CheckpointError(f"{self.root / st.file} is truncated: tensor {st.name!r} needs bytes "
                                  f"{st.start}..{st.start + st.nbytes}; re-download or re-export it")
        return torch.from_numpy(buf).view(st.dtype).reshape(st.shape)

    def close(self) -> None:
        for f in self._handles.values():
            f.close()
        self._handles.clear()


# ============================================================================================== dequantization
_LUTS: dict[str, np.ndarray] = {}


def _lut(name: str) -> np.ndarray:
    """256-entry tables: FP8 byte -> BF16 bits, FP8 byte -> fp32, FP4 byte -> two BF16 (low nibble first)."""
    if name not in _LUTS:
        codes = torch.arange(256, dtype=torch.uint8)
        if name == "fp8-bf16":
            _LUTS[name] = codes.view(torch.float8_e4m3fn).to(torch.bfloat16).view(torch.int16).numpy()
        elif name == "fp8-f32":
            _LUTS[name] = codes.view(torch.float8_e4m3fn).to(torch.float32).numpy()
        else:
            vals = torch.tensor(FP4_E2M1_VALUES, dtype=torch.bfloat16)
            idx = codes.long()
            pairs = torch.stack([vals[idx & 15], vals[idx >> 4]], dim=-1).contiguous()
            _LUTS[name] = pairs.view(torch.int32).reshape(256).numpy()
    return _LUTS[name]


def _pow2_range(scale: torch.Tensor) -> tuple[int, int] | None:
    """(min, max) exponent k when every scale is an exact power of two 2**k, else None (fp32 scales, NaN)."""
    if scale.dtype in (UE8M0, torch.uint8):  # the exponent byte itself; 0xFF is NaN
        b = scale.contiguous().view(torch.uint8).numpy()
        lo, hi = int(b.min()), int(b.max())
        return None if hi == 0xFF else (lo - 127, hi - 127)
    mantissa, exponent = torch.frexp(scale.to(torch.float32))
    if not bool((mantissa == 0.5).all()):
        return None
    return int(exponent.min()) - 1, int(exponent.max()) - 1


def fast_dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, *, block: tuple[int, int] = (128, 128),
                        out_dtype: torch.dtype = torch.bfloat16, out: np.ndarray | None = None) -> torch.Tensor:
    """== checkpoints.quant.dequantize_fp8_blockwise(q, scale, block, out_dtype), bit for bit, ~4x faster on CPU.

    `out`: optional uint8 buffer of exactly the result's byte size to write into (fast path only).
    """
    m, n = q.shape
    bm, bn = block
    s32 = scale_to_float32(scale)
    if m % bm or n % bn or sys.byteorder != "little":
        return dequantize_fp8_blockwise(q, scale, block=block, out_dtype=out_dtype)
    gm, gn = m // bm, n // bn
    k = _pow2_range(scale)
    codes = q.contiguous().view(torch.uint8).numpy()
    # FP8 spans 2**-9 .. 448 < 2**9: times 2**k it stays a normal BF16 number for k in [-117, 119].
    if out_dtype == torch.bfloat16 and k is not None and k[0] >= -117 and k[1] <= 119:
        res = _take(_lut("fp8-bf16"), codes, out).view(torch.bfloat16)
        res.view(gm, bm, gn, bn).mul_(s32.to(torch.bfloat16)[:, None, :, None])
        return res
    vals = torch.from_numpy(np.take(_lut("fp8-f32"), codes))
    vals.view(gm, bm, gn, bn).mul_(s32[:, None, :, None])
    return vals.to(out_dtype)


def fast_dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, *, group: int = FP4_GROUP,
                        out_dtype: torch.dtype = torch.bfloat16, out: np.ndarray | None = None) -> torch.Tensor:
    """== checkpoints.quant.dequantize_fp4_e2m1(packed, scale, group, out_dtype), bit for bit, ~20x faster.

    `out`: optional uint8 buffer of exactly the result's byte size to write into (fast path only).
    """
    m, half = packed.shape
    n = 2 * half
    k = _pow2_range(scale)
    # E2M1 spans 0.5 .. 6 < 2**3: times 2**k it stays a normal BF16 number for k in [-125, 124].
    if (out_dtype != torch.bfloat16 or k is None or n % group or sys.byteorder != "little"
            or tuple(scale.shape) != (m, n // group) or k[0] < -125 or k[1] > 124):
        return dequantize_fp4_e2m1(packed.view(torch.int8), scale, group=group, out_dtype=out_dtype)
    res = _take(_lut("fp4-bf16"), packed.contiguous().view(torch.uint8).numpy(), out).view(torch.bfloat16).view(m, n)
    res.view(m, n // group, group).mul_(scale_to_float32(scale).to(torch.bfloat16)[..., None])
    return res


def _take(lut: np.ndarray, codes: np.ndarray, out: np.ndarray | None) -> torch.Tensor:
    """lut[codes] as a tensor, into `out` (uint8 bytes) when given; mode="clip" so numpy does not buffer."""
    if out is None:
        return torch.from_numpy(np.take(lut, codes))
    dest = out.view(lut.dtype).reshape(codes.shape)
    np.take(lut, codes, out=dest, mode="clip")
    return torch.from_numpy(dest)


def decode(t: SourceTensor, files: HFFiles, scratch: Scratch) -> torch.Tensor:
    """Read one source tensor and return it as torch_dist stores it (dequantized, dtype per kind).

    The result may live in `scratch`: use it before decoding the next tensor.
    """
    data = files.read(t.weight, scratch.get("in", t.weight.nbytes))
    if t.quant is None:
        return data.to(t.out_dtype)
    scale = files.read(t.scale, scratch.get("scale", t.scale.nbytes))  # type: ignore[union-attr]
    out = scratch.get("out", t.out_nbytes)
    if t.quant == "fp8":
        return fast_dequantize_fp8(data, scale, block=t.block, out_dtype=t.out_dtype, out=out)
    return fast_dequantize_fp4(data, scale, group=t.block[1], out_dtype=t.out_dtype, out=out)


def reference_decode(t: SourceTensor, files: HFFiles) -> torch.Tensor:
    """Same as the conversion's decode, through checkpoints/quant.py's reference dequantizers (for verification)."""
    data = files.read(t.weight)
    if t.quant is None:
        return data.to(t.out_dtype)
    data = data.view(torch.int8) if t.quant == "fp4" else data
    return QuantizedTensor(data, files.read(t.scale), t.quant, t.block).dequantize(t.out_dtype)  # type: ignore[arg-type]


def check_finite(t: torch.Tensor, what: str) -> None:
    if not t.is_floating_point() or bool(t.sum().isfinite()):  # a finite sum proves every element finite
        return
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        raise ConversionError(f"{what}: {bad} NaN/Inf values after dequantization; the source is corrupt "
                              "(NaN FP8 codes 0x7F/0xFF, a NaN scale, or non-finite weights): re-download or "
                              "re-export it")


# ============================================================================================== writing
def hf_entries(native: str, kind: str, shape: tuple[int, ...], fmt: ExportFormat, expert_dtype: str,
                scale_fmt: str) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """Names, dtypes and shapes `encode_tensor` will produce for one native tensor (known before encoding)."""
    if kind == "int64":
        return [(native, torch.int64, shape)]
    if fmt == "hf-bf16" or kind in ("bf16", "fp32"):
        return [(native, torch.float32 if kind == "fp32" else torch.bfloat16, shape)]
    m, n = shape
    if kind == "fp4" and expert_dtype == "fp4":
        if n % FP4_GROUP:
            raise ConversionError(f"tensor {native!r} has input dim {n}, not a multiple of {FP4_GROUP}: it cannot be "
                                  "FP4; export with --expert-dtype fp8")
        return [(native, torch.int8, (m, n // 2)), (hf.scale_name(native), UE8M0, (m, n // FP4_GROUP))]
    grid = (-(-m // FP8_BLOCK[0]), -(-n // FP8_BLOCK[1]))
    return [(native, torch.float8_e4m3fn, (m, n)),
            (hf.scale_name(native), UE8M0 if scale_fmt == "ue8m0" else torch.float32, grid)]


class SafetensorsStreamWriter:
    """Writes a safetensors file whose entries are known up front: header first, then tensors one by one."""

    def __init__(self, path: Path, entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], *,
                 fsync: bool = True) -> None:
        header: dict[str, Any] = {}
        offset = 0
        for name, dtype, shape in entries:
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header["__metadata__"] = {"format": "pt"}
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.path, self._fsync = Path(path), fsync
        self._expect = list(entries)
        self._next = 0
        self._f = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self._f.write(len(blob).to_bytes(8, "little") + blob)

    def write(self, name: str, t: torch.Tensor) -> None:
        want = self._expect[self._next]
        if (name, t.dtype, tuple(t.shape)) != want:
            raise ConversionError(f"{self.path}: expected {want} next, got {(name, t.dtype, tuple(t.shape))} (bug)")
        self._f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        self._next += 1

    def abort(self) -> None:
        """Close without the completeness check (the caller discards the file)."""
        if not self._f.closed:
            try:
                self._f.close()
            except OSError:  # the buffered rest cannot be written (a full disk): the write's own error is reported
                pass

    def close(self) -> None:
        if self._next != len(self._expect):
            raise ConversionError(f"{self.path}: {len(self._expect) - self._next} tensors never written (bug)")
        self._f.flush()
        if self._fsync:
            os.fsync(self._f.fileno())
            if hasattr(os, "posix_fadvise"):  # durable now: free its page cache for the next writes
                os.posix_fadvise(self._f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        self._f.close()


def requantize_like(native: str, w: torch.Tensor, encoded: list[tuple[str, torch.Tensor]],
                    ref_scale: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Re-encode blocks with the reference checkpoint's scale wherever that scale represents `w` exactly.

    `encoded` is `encode_tensor`'s canonical (weight, scale); blocks where the reference scale cannot
    hold the values exactly keep the canonical encoding. With power-of-two reference scales and
    unchanged weights every block qualifies, so the bytes equal the reference checkpoint's.
    """
    (wname, q), (sname, s) = encoded
    ref32 = scale_to_float32(ref_scale)
    if tuple(ref32.shape) != tuple(s.shape) or _pow2_range(ref_scale) is None:
        return encoded
    w32 = w.to(torch.float32)
    if q.dtype == torch.float8_e4m3fn:
        m, n = w32.shape
        expand = ref32.repeat_interleave(FP8_BLOCK[0], 0).repeat_interleave(FP8_BLOCK[1], 1)[:m, :n]
        v = w32 / expand
        q_ref = v.to(torch.float8_e4m3fn)
        exact = q_ref.to(torch.float32) == v
        bad = torch.nn.functional.pad((~exact).float(), (0, (-n) % FP8_BLOCK[1], 0, (-m) % FP8_BLOCK[0]))
        ok = bad.reshape(s.shape[0], FP8_BLOCK[0], s.shape[1], FP8_BLOCK[1]).amax(dim=(1, 3)) == 0
        ok_elem = ok.repeat_interleave(FP8_BLOCK[0], 0).repeat_interleave(FP8_BLOCK[1], 1)[:m, :n]
        q_out = torch.where(ok_elem, q_ref.view(torch.uint8), q.view(torch.uint8)).view(torch.float8_e4m3fn)
    else:
        m, half = q.shape
        v = w32 / ref32.repeat_interleave(FP4_GROUP, 1)
        codes, exact = _fp4_codes_exact(v)
        ok = exact.view(m, -1, FP4_GROUP).all(-1)
        canon = q.view(torch.uint8)
        canon_codes = torch.stack([canon & 0xF, canon >> 4], dim=-1).reshape(m, 2 * half)
        codes = torch.where(ok.repeat_interleave(FP4_GROUP, 1), codes, canon_codes)
        q_out = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
    s32 = torch.where(ok, ref32, scale_to_float32(s))
    s_out = to_ue8m0(s32) if s.dtype == UE8M0 else s32.to(s.dtype)
    return [(wname, q_out.contiguous()), (sname, s_out.contiguous())]


_FP4_MAGS = torch.tensor((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0))


def _fp4_codes_exact(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E2M1 code of each value (sign bit kept, -0 included) and whether the value is exactly on the grid."""
    mag = v.abs()
    idx = torch.searchsorted(_FP4_MAGS, mag.contiguous()).clamp(max=7)
    exact = _FP4_MAGS[idx] == mag
    codes = (idx | (torch.signbit(v).to(torch.int64) << 3)).to(torch.uint8)
    return codes, exact

