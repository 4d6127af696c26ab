"""Streaming, parallel, atomic conversion between DeepSeek-V4 HF checkpoints and Megatron torch_dist.

    convert_hf_to_torch_dist(src, dst, workers=N)        HF FP8 + FP4 (or BF16) -> torch_dist BF16
    convert_hf_to_torch_dist(src, dst, megatron_names="megatron")   ... under Megatron's names (Miles e9e19b223+)
    export_torch_dist_to_hf(src, dst, fmt="hf-fp8")      torch_dist -> HF native layout, BF16 or re-quantized
    verify_torch_dist(dst, against=src)                  megatron-core loads it; names/shapes/dtypes/finite/values

HF -> torch_dist: the source is validated from its safetensors headers before anything is written
(checkpoints/hf_stream.py). Tensors are cut into jobs of about 1 GiB of output, never spanning a
shard; each job runs in a worker process that reads one tensor at a time from its byte range,
dequantizes it, checks it is finite and appends it to its own `__0_<job>.distcp` as one chunk of its
Megatron tensor (a routed expert is a box of the stacked `[E, 2I, H]` tensor). A worker holds one
tensor (input + output, in reused buffers) at a time, whatever the checkpoint size. The main process
then writes `.metadata`, `common.pt` and `metadata.json`, checks the result with megatron-core and
only then renames the hidden temporary directory into place (checkpoints/manifest.py). Re-running on
a complete output is a no-op; a killed run leaves only a hidden `.DST.partial-*` directory.

Keys follow the Megatron names of the Miles generation that will load the output (checkpoints/names.py:
`plugin`, the default, or `megatron`, where each mHC scale becomes three alpha tensors written as three
chunks of the one native tensor); export and verification detect which from the stored keys.

torch_dist -> HF reads each native tensor's box back (any chunking, so Megatron-written checkpoints
work too) and streams safetensors shards. `hf-fp8` re-quantizes with the rollout engine's rules
(`checkpoints/hf.py` `encode_tensor`); `like=` the original HF directory reuses its block scales where
they are exact (byte-identical round trip for UE8M0 checkpoints) and copies its tokenizer files.

Workers are processes (fork where available, one per core by default), one torch thread each; the pool,
its progress bar and killing the workers on the first failure live in checkpoints/workers.py.

Tests: `.venv/bin/python -m pytest tests/test_convert.py -q`; benchmark: `v4rl bench convert --json out.json`.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from checkpoints import hf
from checkpoints.hf import INDEX_FILE, encode_tensor
from checkpoints.hf_stream import (
    ConversionError,
    ExportFormat,
    HFFiles,
    SafetensorsStreamWriter,
    Scratch,
    SourcePlan,
    SourceTensor,
    check_finite,
    decode,
    hf_entries,
    plan_source,
    reference_decode,
    requantize_like,
    row_slice,
)
from checkpoints.manifest import AtomicOutput, is_complete, manifest_key, source_manifest
from checkpoints.names import MegatronNames, megatron_column, placements
from checkpoints.megatron_io import import_megatron, megatron_load, megatron_tensor_metadata, single_rank_process_group
from checkpoints.paths import tokenizer_dir_of
from checkpoints.torch_dist import (
    IGNORED_KEY_PREFIXES,
    RELEASE_DIR,
    Box,
    ChunkFileWriter,
    ChunkRecord,
    TensorSpec,
    TorchDistError,
    TorchDistReader,
    check_storage_bounds,
    hf_config_of,
    mark_release,
    read_dcp_metadata,
    stored_megatron_names,
    megatron_specs,
    resolve_iteration_dir,
    sync_files,
    write_checkpointing_config,
    write_common,
    write_dcp_metadata,
)
from checkpoints.workers import ProgressBar, default_workers, report_progress, run_jobs
from engines.model.config import ModelConfig
from engines.model.params import native_param_specs

__all__ = ["ConversionError", "ConversionResult", "VerifyReport", "convert_hf_to_torch_dist", "default_workers",
           "export_torch_dist_to_hf", "verify_torch_dist"]
Verify = Literal["none", "structure", "full"]
JOB_BYTES = 1 << 30
"""Output bytes per conversion job (one .distcp file); smaller when needed to keep every worker busy."""
PIECE_BYTES = 256 << 20
"""Unquantized tensors bigger than this are written as several row chunks (bounds a worker's memory)."""


# ============================================================================================== HF -> torch_dist
@dataclass(frozen=True)
class _Piece:
    """Rows `first_row:` of native tensor `full` (shape of the whole tensor), decoded from `source`."""

    full: SourceTensor
    source: SourceTensor
    first_row: int = 0


@dataclass(frozen=True)
class _ConvertJob:
    src: str
    out: str
    pieces: tuple[_Piece, ...]
    n_experts: int
    column: str
    """checkpoints/names.py column of the Megatron names written (megatron_column(names))."""


def _convert_job(job: _ConvertJob) -> list[ChunkRecord]:
    """Worker: decode the job's pieces one at a time and append each as a chunk to the job's .distcp file."""
    files, scratch = HFFiles(Path(job.src)), Scratch()
    try:
        writer = ChunkFileWriter(Path(job.out), fsync=False)  # the parent fsyncs all files once, at the end
    except OSError as exc:
        raise _write_error(job.out, "a chunk file", exc) from exc
    try:
        for piece in job.pieces:
            t = piece.source
            where = f"{Path(job.src) / t.weight.file}: tensor {t.native!r}"
            try:
                out = decode(t, files, scratch)
            except (RuntimeError, ValueError, TypeError) as exc:
                raise ConversionError(f"{where}: cannot decode ({exc})") from exc
            check_finite(out, where)
            for p in placements(t.native, piece.full.shape, job.column, job.n_experts):
                offsets = (p.offsets[0] + piece.first_row, *p.offsets[1:])
                # a row piece of a whole tensor is written as it is; else the box (or block) the names give
                chunk = p.take(out) if t.shape == piece.full.shape else out.reshape(t.shape)
                try:
                    writer.append(p.name, offsets, chunk)
                except (OSError, RuntimeError) as exc:  # torch.save reports a failed write as RuntimeError
                    raise _write_error(job.out, f"{p.name!r} (from {t.native!r})", exc) from exc
            report_progress(t.out_nbytes)
        try:
            writer.close()
        except OSError as exc:
            raise _write_error(job.out, "the end of the chunk file", exc) from exc
        return writer.records
    finally:
        writer.abort()
        files.close()


def _write_error(path: str, what: str, exc: BaseException) -> ConversionError:
    reason = getattr(exc, "strerror", None) or str(exc).strip().splitlines()[0]
    return ConversionError(f"writing {what} to {path} failed: {reason}; check free space, quotas (ulimit -f) and "
                           "permissions of the output disk, then run again")


def _pieces(t: SourceTensor, n_experts: int) -> list[_Piece]:
    """A big unquantized tensor (embed, head: 1 GiB in BF16) becomes row pieces of <= PIECE_BYTES, each its
    own DCP chunk: a worker never holds more than that, and the two biggest tensors no longer pin two jobs."""
    boxes = placements(t.native, t.shape, "megatron", n_experts)  # fusion and splitting: the same in both names
    whole = len(boxes) == 1 and boxes[0].whole
    if t.quant is not None or not whole or t.out_nbytes <= PIECE_BYTES or len(t.shape) < 2:
        return [_Piece(t, t)]
    rows = max(1, t.shape[0] * PIECE_BYTES // t.out_nbytes)
    return [_Piece(t, row_slice(t, lo, min(lo + rows, t.shape[0])), lo) for lo in range(0, t.shape[0], rows)]


def _plan_jobs(plan: SourcePlan, out_dir: Path, workers: int, column: str) -> list[_ConvertJob]:
    """Cut the source into jobs of about `target` output bytes, in shard order, never spanning a shard."""
    total = sum(t.out_nbytes for t in plan.tensors.values())
    target = max(64 << 20, min(JOB_BYTES, total // max(1, 4 * workers)))
    by_shard: dict[str, list[_Piece]] = {}
    for t in plan.tensors.values():
        by_shard.setdefault(t.weight.file, []).extend(_pieces(t, plan.cfg.n_routed_experts))
    groups: list[list[_Piece]] = []
    for shard in sorted(by_shard):
        current: list[_Piece] = []
        size = 0
        for piece in sorted(by_shard[shard], key=lambda p: p.source.weight.start):  # read front to back
            n = piece.source.out_nbytes
            if current and size + n > target:
                groups.append(current)
                current, size = [], 0
            current.append(piece)
            size += n
        groups.append(current)
    groups.sort(key=lambda g: -sum(p.source.out_nbytes for p in g))  # biggest first: better balance
    return [_ConvertJob(str(plan.dir), str(out_dir / f"__0_{i}.distcp"), tuple(g), plan.cfg.n_routed_experts,
                        column) for i, g in enumerate(groups)]


@dataclass(frozen=True)
class ConversionResult:
    """What a conversion did: `skipped` when the destination was already complete for this source."""

    dst: Path
    skipped: bool
    tensors: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    workers: int = 0
    files: int = 0
    tokenizer: Path | None = None
    """Export: the directory whose tokenizer files the output carries (None: none was found)."""

    @property
    def bytes_per_second(self) -> float:
        return self.bytes_out / self.seconds if self.seconds else 0.0


def convert_hf_to_torch_dist(src: str | Path, dst: str | Path, *, workers: int | None = None, force: bool = False,
                             verify: Verify = "structure", progress: bool = False,
                             fsync: bool = True, megatron_names: MegatronNames = "plugin") -> ConversionResult:
    """HF DeepSeek-V4 checkpoint (FP8/FP4 or BF16) -> Megatron torch_dist BF16 directory `dst` (see module doc).

    megatron_names: the key names of the Miles generation that loads it (checkpoints/names.py MegatronNames;
    engines/miles/generation.py reads them from a Miles checkout), recorded in common.pt.

    verify: "structure" (megatron-core reads the metadata: names, shapes, dtypes; one tensor loaded and
    compared), "full" (`verify_torch_dist(..., against=src)` before the rename), or "none".
    """
    t0 = time.perf_counter()
    if verify not in ("none", "structure", "full"):
        raise ValueError(f"verify must be none, structure or full; got {verify!r}")
    src, dst = Path(src), Path(dst)
    column = megatron_column(megatron_names)
    plan = plan_source(src)
    options: dict[str, Any] = {"to": "torch_dist", "format_version": 1}
    if megatron_names != "plugin":  # kept out for plugin names: outputs converted before stay complete
        options["megatron_names"] = megatron_names
    key = manifest_key(source_manifest(src, plan.disk_names), options)
    if is_complete(dst, key):
        return ConversionResult(dst, skipped=True)
    workers = workers or default_workers()
    with AtomicOutput(dst, force=force, key=key) as out:
        rel = out.tmp / RELEASE_DIR
        rel.mkdir()
        jobs = _plan_jobs(plan, rel, workers, column)
        total = sum(t.out_nbytes for t in plan.tensors.values())
        results = run_jobs(_convert_job, jobs, workers=workers, total=total, label="convert", progress=progress,
                            meanwhile=import_megatron if verify != "none" else None)  # ~3 s, overlapped
        if fsync:  # workers only started the writeback; make every chunk file durable before any metadata
            sync_files(Path(j.out) for j in jobs)
        specs = megatron_specs(plan.cfg, megatron_names)
        write_dcp_metadata(rel, [r for rs in results for r in rs], specs)
        write_common(rel, plan.cfg, hf_config=hf.with_release_model_keys(plan.raw_config, plan.cfg),
                     extra={"source": str(src.resolve()), "key": key}, names=megatron_names)
        write_checkpointing_config(rel)
        mark_release(out.tmp)
        _copy_tokenizer(src, out.tmp)  # beside the weights, so an export of this (or of a run from it) has one
        if verify != "none":
            _verify_structure(out.tmp, plan, specs)
        if verify == "full":
            verify_torch_dist(out.tmp, against=src, progress=progress)
        seconds = time.perf_counter() - t0
        bytes_out = sum(p.stat().st_size for p in rel.iterdir())
        out.commit({"key": key, "kind": "hf->torch_dist", "source": str(src.resolve()), "tensors": len(plan.tensors),
                    "megatron_names": megatron_names,
                    "skipped_source_tensors": plan.skipped, "workers": workers, "seconds": round(seconds, 3)})
    return ConversionResult(dst, False, len(plan.tensors), sum(t.in_nbytes for t in plan.tensors.values()), bytes_out,
                            seconds, workers, len(jobs))


def _verify_structure(ckpt: Path, plan: SourcePlan, specs: dict[str, TensorSpec]) -> None:
    """megatron-core sees exactly the model's tensors, every chunk is in bounds, one tensor loads right."""
    check_storage_bounds(resolve_iteration_dir(ckpt))
    _compare_specs(megatron_tensor_metadata(ckpt), specs, where=str(ckpt))
    probe = plan.tensors["norm.weight"]
    files = HFFiles(plan.dir)
    try:
        want = reference_decode(probe, files)
    finally:
        files.close()
    key = placements(probe.native, probe.shape, "megatron", plan.cfg.n_routed_experts)[0].name  # same in both
    with single_rank_process_group():
        got = megatron_load(ckpt, [Box(key, (0,), specs[key].shape)], specs)[0]
    if not torch.equal(got, want):
        raise ConversionError(f"{ckpt}: megatron-core loads {key!r} with values different from the source; "
                              "this is a bug in the converter, please report it")


def _compare_specs(got: dict[str, TensorSpec], want: dict[str, TensorSpec], *, where: str) -> None:
    missing = [k for k in want if k not in got]
    unknown = [k for k in got if k not in want]
    if missing:
        raise TorchDistError(f"{where}: missing tensor {missing[0]!r} ({len(missing)} missing in all); the "
                             "checkpoint is incomplete or for another config")
    if unknown:
        raise TorchDistError(f"{where}: unknown tensor {unknown[0]!r} ({len(unknown)} unknown in all); not a "
                             "DeepSeek-V4 tensor of this config (layers / experts / layer types differ?)")
    for k, spec in want.items():
        if got[k] != spec:
            raise TorchDistError(f"{where}: tensor {k!r} is {got[k].dtype} {got[k].shape}; the config expects "
                                 f"{spec.dtype} {spec.shape}")


# ============================================================================================== verification
@dataclass(frozen=True)
class VerifyReport:
    """Outcome of `verify_torch_dist`; it raises on the first problem, so a report means everything passed."""

    ckpt: Path
    tensors: int
    bytes: int
    compared: int
    """Native tensors compared value by value against the HF source (0 without `against`)."""
    seconds: float


def _torch_dist_config(ckpt: Path, plan: SourcePlan | None, hf_dir, *, flag: str) -> tuple[dict, ModelConfig]:
    """The model config a torch_dist iteration carries in common.pt, else the one of the HF checkpoint given
    with `flag`; refuses a HF checkpoint of another model."""
    raw = hf_config_of(ckpt) or (plan.raw_config if plan else None)
    if raw is None:
        raise TorchDistError(f"{ckpt}: common.pt does not carry the model config (not written by v4rl); pass the "
                             f"HF checkpoint it came from with {flag}")
    cfg = ModelConfig.from_hf_dict(raw)
    if plan is not None and plan.cfg != cfg:
        raise TorchDistError(f"{ckpt} holds a different model than {flag} {hf_dir} (their config.json differ)")
    return raw, cfg


def verify_torch_dist(ckpt: str | Path, *, against: str | Path | None = None, batch_bytes: int = 1 << 30,
                      progress: bool = False) -> VerifyReport:
    """Load a torch_dist checkpoint with megatron-core and check it tensor by tensor.

    Names, shapes and dtypes against the model config (stored in common.pt, else `against`'s
    config.json); every tensor finite; with `against`, every value equal to checkpoints/quant.py's
    dequantization of the HF source. Tensors load in batches of about `batch_bytes` (big stacked
    expert tensors as expert-axis fragments), so memory stays bounded.
    """
    t0 = time.perf_counter()
    d = resolve_iteration_dir(ckpt)
    plan = plan_source(against) if against is not None else None
    raw, cfg = _torch_dist_config(d, plan, against, flag="--against")
    names = stored_megatron_names(read_dcp_metadata(d).state_dict_metadata, where=str(d))
    specs = megatron_specs(cfg, names)
    natives: dict[str, list[tuple[str, Any]]] = {}
    for name, spec in native_param_specs(cfg).items():
        for p in placements(name, spec.shape, megatron_column(names), cfg.n_routed_experts):
            natives.setdefault(p.name, []).append((name, p))
    boxes = [b for key, spec in specs.items() for b in _split_box(key, spec, batch_bytes)]
    total = sum(math.prod(b.sizes) * specs[b.key].dtype.itemsize for b in boxes)
    values = _SourceValues(plan) if plan else None
    try:
        with single_rank_process_group(), ProgressBar("verify", total, progress) as bar:
            check_storage_bounds(d)  # a truncated or missing .distcp: name the file, before megatron trips on it
            _compare_specs(megatron_tensor_metadata(d), specs, where=str(d))
            for batch in _batches(boxes, specs, batch_bytes):
                for box, t in zip(batch, _load_batch(d, batch, specs)):
                    check_finite(t, f"{d}: tensor {box.key!r} box {box.offsets}+{box.sizes}")
                    if values is not None:
                        values.check(box, t, natives[box.key])
                    bar.advance(t.numel() * t.element_size())
    finally:
        if values is not None:
            values.close()
    compared = len(values.compared) if values else 0
    return VerifyReport(d, len(specs), total, compared, time.perf_counter() - t0)


def _load_batch(d: Path, batch: list[Box], specs: dict[str, TensorSpec]) -> list[torch.Tensor]:
    try:
        return megatron_load(d, batch, specs)
    except Exception as exc:  # noqa: BLE001 - megatron-core / DCP wrap failures in several types
        raise TorchDistError(f"{d}: megatron-core cannot load {batch[0].key!r} (and {len(batch) - 1} more in the "
                             f"batch): {exc}") from exc


def _split_box(key: str, spec: TensorSpec, batch_bytes: int) -> list[Box]:
    nbytes = math.prod(spec.shape) * spec.dtype.itemsize
    rows = spec.shape[0]
    parts = next((k for k in range(1, rows + 1) if rows % k == 0 and nbytes // k <= batch_bytes), rows)
    step = rows // parts
    return [Box(key, (i * step,) + (0,) * (len(spec.shape) - 1), (step, *spec.shape[1:])) for i in range(parts)]


def _batches(boxes: list[Box], specs: dict[str, TensorSpec], batch_bytes: int) -> Iterable[list[Box]]:
    batch: list[Box] = []
    size = 0
    for b in boxes:
        n = math.prod(b.sizes) * specs[b.key].dtype.itemsize
        if batch and size + n > batch_bytes:
            yield batch
            batch, size = [], 0
        batch.append(b)
        size += n
    if batch:
        yield batch


class _SourceValues:
    """Reference dequantization of source tensors for value checks; keeps the last one (boxes of a split
    tensor come in a row) and records which native tensors were compared in full."""

    def __init__(self, plan: SourcePlan) -> None:
        self.plan, self.files = plan, HFFiles(plan.dir)
        self._last: tuple[str, torch.Tensor] | None = None
        self._seen: dict[str, int] = {}
        self.compared: set[str] = set()

    def check(self, box: Box, t: torch.Tensor, natives: list[tuple[str, Any]]) -> None:
        """Compare the part of box `t` covered by each native tensor with its dequantized source."""
        for native, p in natives:
            lo = [max(po, bo) for po, bo in zip(p.offsets, box.offsets)]
            hi = [min(po + ps, bo + bs) for po, ps, bo, bs in zip(p.offsets, p.sizes, box.offsets, box.sizes)]
            if any(h <= l for l, h in zip(lo, hi)):
                continue
            got = t[tuple(slice(l - b, h - b) for l, h, b in zip(lo, hi, box.offsets))]
            want = p.take(self._decoded(native))[tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, p.offsets))]
            if not torch.equal(got, want):
                src = self.plan.tensors[native]
                diff = (got.float() - want.float()).abs().max().item()
                raise ConversionError(f"{box.key!r} at {tuple(lo)} differs from the dequantized source tensor "
                                      f"{native!r} ({self.plan.dir / src.weight.file}): max |diff| {diff:g}; "
                                      "re-run the conversion with --force")
            self._seen[native] = self._seen.get(native, 0) + math.prod(h - l for l, h in zip(lo, hi))
            if self._seen[native] == math.prod(self.plan.tensors[native].shape):
                self.compared.add(native)

    def _decoded(self, native: str) -> torch.Tensor:
        if self._last is None or self._last[0] != native:
            self._last = (native, reference_decode(self.plan.tensors[native], self.files))
        return self._last[1]

    def close(self) -> None:
        self.files.close()


# ============================================================================================== torch_dist -> HF
@dataclass(frozen=True)
class _ExportJob:
    ckpt: str
    out: str
    natives: tuple[tuple[str, str, tuple[int, ...]], ...]
    entries: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]
    fmt: ExportFormat
    expert_dtype: str
    scale_fmt: str
    n_experts: int
    column: str
    like_dir: str | None
    like: tuple[tuple[str, SourceTensor], ...]
    fsync: bool


def _export_job(job: _ExportJob) -> int:
    reader = TorchDistReader(job.ckpt)
    like = dict(job.like)
    files = HFFiles(Path(job.like_dir)) if job.like_dir else None
    try:
        writer = SafetensorsStreamWriter(Path(job.out), job.entries, fsync=job.fsync)
    except OSError as exc:
        raise _write_error(job.out, "the safetensors header", exc) from exc
    try:
        for native, kind, shape in job.natives:
            boxes = placements(native, shape, job.column, job.n_experts)
            parts = [reader.read(Box(p.name, p.offsets, p.sizes)) for p in boxes]
            # one box, or the blocks of a tensor the names split (the mHC alphas), joined in row order
            t = parts[0].reshape(shape) if len(parts) == 1 else torch.cat(
                [x.reshape(-1, *shape[1:]) for x in parts]).reshape(shape)
            where = boxes[0].name if len(boxes) == 1 else " + ".join(p.name for p in boxes)
            check_finite(t, f"{reader.dir}: {where!r} at {boxes[0].offsets} (native {native!r})")
            fmt = "bf16" if job.fmt == "hf-bf16" else "fp8"
            encoded = encode_tensor(native, t, kind, weight_format=fmt, expert_dtype=job.expert_dtype,  # type: ignore[arg-type]
                                    scale_fmt=job.scale_fmt)  # type: ignore[arg-type]
            ref = like.get(native)
            if len(encoded) == 2 and files is not None and ref is not None and ref.scale is not None:
                encoded = requantize_like(native, t, encoded, files.read(ref.scale))
            for name, x in encoded:
                try:
                    writer.write(name, x)
                except OSError as exc:
                    raise _write_error(job.out, repr(name), exc) from exc
                report_progress(x.numel() * x.element_size())
        try:
            writer.close()
        except OSError as exc:
            raise _write_error(job.out, "the last tensors", exc) from exc
    finally:
        if files:
            files.close()
        writer.abort()
    return Path(job.out).stat().st_size


def export_torch_dist_to_hf(src: str | Path, dst: str | Path, *, fmt: ExportFormat = "hf-bf16",
                            like: str | Path | None = None, expert_dtype: str | None = None,
                            scale_fmt: str | None = None, workers: int | None = None,
                            max_shard_bytes: int = hf.DEFAULT_MAX_SHARD_BYTES, force: bool = False,
                            progress: bool = False, fsync: bool = True) -> ConversionResult:
    """torch_dist -> HF DeepSeek-V4 directory in the native layout (see module doc).

    fmt "hf-bf16": BF16 weights (fp32 kinds stay fp32), no quantization_config. "hf-fp8": FP8 linears
    and FP4 (or FP8) routed experts with UE8M0 (or fp32) scales; defaults come from the HF config the
    conversion stored (expert_dtype, scale_fmt). `like`: the original HF directory (scales to reuse,
    tokenizer and generation_config files; also the model config when common.pt lacks it).
    """
    t0 = time.perf_counter()
    if fmt not in ("hf-bf16", "hf-fp8"):
        raise ValueError(f"--format must be hf-bf16 or hf-fp8; got {fmt!r}")
    src, dst = Path(src), Path(dst)
    ckpt = resolve_iteration_dir(src)
    like_plan = plan_source(like) if like is not None else None
    raw, cfg = _torch_dist_config(ckpt, like_plan, like, flag="--like")
    tokenizer = (tokenizer_dir_of(Path(like)) if like is not None else None) or tokenizer_dir_of(src)
    qc = raw.get("quantization_config") or {}
    expert_dtype = expert_dtype or raw.get("expert_dtype") or qc.get("expert_dtype") or "fp4"
    scale_fmt = scale_fmt or ("fp32" if qc and qc.get("scale_fmt") != "ue8m0" else "ue8m0")
    if expert_dtype not in ("fp4", "fp8") or scale_fmt not in ("ue8m0", "fp32"):
        raise ValueError(f"expert_dtype must be fp4|fp8 and scale_fmt ue8m0|fp32; got {expert_dtype}, {scale_fmt}")
    reader = TorchDistReader(ckpt)
    names = stored_megatron_names(reader, where=str(ckpt))  # either Miles generation's names
    _compare_specs({k: reader.spec(k) for k in reader.tensors if not k.startswith(IGNORED_KEY_PREFIXES)},
                   megatron_specs(cfg, names), where=str(ckpt))
    options = {"to": fmt, "expert_dtype": expert_dtype, "scale_fmt": scale_fmt, "max_shard_bytes": max_shard_bytes,
               "like": source_manifest(like, like_plan.disk_names) if like_plan else None}
    key = manifest_key(source_manifest(src, sorted(reader.tensors)), options)
    if is_complete(dst, key):
        return ConversionResult(dst, skipped=True)

    shards: list[list[tuple[str, str, tuple[int, ...]]]] = [[]]
    size = 0
    for native, spec in native_param_specs(cfg).items():
        n = sum(math.prod(s) * d.itemsize for _, d, s in hf_entries(native, spec.kind, spec.shape, fmt,
                                                                        expert_dtype, scale_fmt))
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((native, spec.kind, spec.shape))
        size += n
    workers = workers or default_workers()
    with AtomicOutput(dst, force=force, key=key) as out:
        jobs, weight_map, total = [], {}, 0
        for k, natives in enumerate(shards, start=1):
            name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            entries = tuple(e for nat, kind, shape in natives
                            for e in hf_entries(nat, kind, shape, fmt, expert_dtype, scale_fmt))
            weight_map.update({e[0]: name for e in entries})
            total += sum(math.prod(s) * d.itemsize for _, d, s in entries)
            refs = tuple((nat, like_plan.tensors[nat]) for nat, _, _ in natives) if like_plan else ()
            jobs.append(_ExportJob(str(ckpt), str(out.tmp / name), tuple(natives), entries, fmt, expert_dtype,
                                   scale_fmt, cfg.n_routed_experts, megatron_column(names),
                                   str(like) if like else None, refs, fsync))
        sizes = run_jobs(_export_job, jobs, workers=workers, total=total, label=f"export {fmt}", progress=progress)
        _write_hf_side_files(out.tmp, raw, cfg, fmt, expert_dtype, scale_fmt, weight_map, total, like)
        if tokenizer is not None:
            _copy_tokenizer(tokenizer, out.tmp)
        seconds = time.perf_counter() - t0
        out.commit({"key": key, "kind": f"torch_dist->{fmt}", "source": str(src.resolve()),
                    "like": str(Path(like).resolve()) if like else None, "seconds": round(seconds, 3)})
    return ConversionResult(dst, False, len(native_param_specs(cfg)), 0, sum(sizes), seconds, workers, len(jobs),
                            tokenizer)


def _write_hf_side_files(out: Path, raw: dict[str, Any], cfg: ModelConfig, fmt: ExportFormat, expert_dtype: str,
                         scale_fmt: str, weight_map: dict[str, str], total: int, like: str | Path | None) -> None:
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    config = hf.hf_config_dict(cfg, weight_format="bf16" if fmt == "hf-bf16" else "fp8",  # type: ignore[arg-type]
                               expert_dtype=expert_dtype, scale_fmt=scale_fmt, base=raw)  # type: ignore[arg-type]
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    like_dir = Path(like) if like is not None else None
    gen = like_dir / "generation_config.json" if like_dir else None
    if gen is not None and gen.is_file():
        shutil.copy2(gen, out / gen.name)
    else:
        body = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}
        (out / "generation_config.json").write_text(json.dumps(body, indent=2) + "\n")


def _copy_tokenizer(src: Path, out: Path) -> None:
    """The tokenizer files of `src` (the rollout engine needs them for text prompts and stop strings)."""
    for name in hf.TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
