"""Megatron `torch_dist` checkpoint directories: write them chunk by chunk, read them back, load them with megatron-core.

Layout (what Megatron's `save_checkpoint` + Miles' converter produce, reference/miles-sglang-megatron.md §3.1):

    DST/latest_checkpointed_iteration.txt        "release"
    DST/release/metadata.json                    {"sharded_backend": "torch_dist", ...}; written last
    DST/release/common.pt                        torch.save({"args": Namespace(...), "iteration": 0,
                                                 "checkpoint_version": 3.0, "v4rl": {...}})
    DST/release/.metadata                        pickled torch.distributed.checkpoint Metadata
    DST/release/__0_<k>.distcp                   tensor chunks, each a `torch.save` record (DCP format)

Keys are Megatron names (`checkpoints/names.py`) of one Miles generation: Miles' plugin names (`plugin`, the
first DeepSeek-V4 generation) or Megatron's names (`megatron`, the second: mHC scales split into three alphas),
recorded in common.pt["v4rl"]["megatron_names"]; readers detect them from the keys. Routed experts are one tensor per
layer `[E, 2I, H]` / `[E, H, I]`. A writer stores every native tensor as its own DCP *chunk* of that
tensor (offsets `(e, 0, 0)` for w1, `(e, I, 0)` for w3), exactly as Megatron stores EP/TP shards, so
conversion streams and never holds a fused tensor; any DCP reader (megatron-core included) reshards
on load. Dtypes: BF16, except tensors the model keeps in fp32 (sinks, ape, hc_*, expert bias) and the
int32 tid2eid table (`TORCH_DIST_DTYPES`).

    writer = ChunkFileWriter(tmp / "release" / "__0_0.distcp")         # append chunks, then close()
    write_dcp_metadata(tmp / "release", records, megatron_specs(cfg))  # .metadata
    write_common(tmp / "release", cfg, hf_config=raw_config_json)      # common.pt
    write_checkpointing_config(tmp / "release"); mark_release(tmp)     # metadata.json, iteration file

Loading with megatron-core itself (and the checks that make its failures name a file and tensor) lives in
checkpoints/megatron_io.py.

NOTE: model weights only. A Megatron-LM model built with Transformer Engine also requests per-module
`._extra_state` objects, which a converted release cannot contain (no module produced them); load it
as Miles loads `--ref-load` (`--finetune`, no optimizer/RNG) with a non-strict `--dist-ckpt-strictness`
such as `log_all`. Not verified against Miles' DeepSeek-V4 plugin here (no TE / Megatron-LM on CPU).

Tests: `.venv/bin/python -m pytest tests/test_torch_dist.py -q`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pickle
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from checkpoints.names import detect_megatron_names, megatron_column, placements
from engines.model.config import CSA, HASH_MOE, HCA, ModelConfig
from engines.model.params import native_param_specs

ITERATION_FILE = "latest_checkpointed_iteration.txt"
RELEASE_DIR = "release"
CONFIG_FILE = "metadata.json"
COMMON_FILE = "common.pt"
DCP_METADATA_FILE = ".metadata"
CHECKPOINTING_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                        "common_backend": "torch", "common_backend_version": 1}
TORCH_DIST_DTYPES: dict[str, torch.dtype] = {"fp8": torch.bfloat16, "fp4": torch.bfloat16, "bf16": torch.bfloat16,
                                             "fp32": torch.float32, "int64": torch.int32}
"""Storage kind of a native tensor (engines/model/params.py) -> its dtype in a BF16 torch_dist checkpoint.
`tid2eid` (int64 in the HF checkpoint) is int32 here: both Miles generations' routers hold it as int32."""
IGNORED_KEY_PREFIXES = ("optimizer.", "rng_state", "rerun_state_machine", "content_metadata")
"""Non-model DCP keys a training checkpoint adds; readers of model weights skip them."""


class TorchDistError(ValueError):
    """A torch_dist directory is malformed or does not match the model; the message names file and key."""


@dataclass(frozen=True)
class TensorSpec:
    """One Megatron tensor of the model: global shape and torch_dist dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Box:
    """A rectangular piece of a torch_dist tensor: `key[offsets : offsets + sizes]`."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class ChunkRecord:
    """Where one stored chunk lives: which tensor box, which file, which byte range."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype
    relative_path: str
    offset: int
    length: int


def megatron_specs(cfg: ModelConfig, names: str = "plugin") -> dict[str, TensorSpec]:
    """Every Megatron tensor of a model with this config under `names` (checkpoints/names.py MegatronNames:
    `plugin` or `megatron`), in native order (fused ones at first use)."""
    out: dict[str, TensorSpec] = {}
    for name, spec in native_param_specs(cfg).items():
        for p in placements(name, spec.shape, megatron_column(names), cfg.n_routed_experts):
            out.setdefault(p.name, TensorSpec(p.global_shape, TORCH_DIST_DTYPES[spec.kind]))
    return out


def stored_megatron_names(reader_or_keys: Any, *, where: str) -> str:
    """The MegatronNames of a torch_dist checkpoint, from its keys (a TorchDistReader or an iterable of keys)."""
    keys = reader_or_keys.tensors if hasattr(reader_or_keys, "tensors") else reader_or_keys
    try:
        return detect_megatron_names(keys, where=where)
    except ValueError as exc:
        raise TorchDistError(str(exc)) from None


# ============================================================================================== writing
@contextlib.contextmanager
def _no_zip_crc() -> Iterator[None]:
    """torch.save without the zip CRC32 pass (a full extra read of every tensor); torch.load does not need it."""
    from torch.utils.serialization import config

    old = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        yield
    finally:
        config.save.compute_crc32 = old


class _Sink:
    """File wrapper that keeps the OSError behind a failed write (torch.save only says "unexpected pos")."""

    def __init__(self, f: Any) -> None:
        self.f, self.error = f, None

    def write(self, data: Any) -> int:
        try:
            return self.f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.f.flush()


class ChunkFileWriter:
    """Appends tensor chunks to one `.distcp` file in DCP's torch_save format.

    Each chunk is one `torch.save` record at a known byte range, what DCP's FileSystemWriter writes.
    `close()` fsyncs when `fsync=True`; with fsync=False it only starts the writeback (the caller makes
    the file durable later with `sync_files`, so a worker never waits on the disk).
    """

    def __init__(self, path: Path, *, fsync: bool = True) -> None:
        self.path = Path(path)
        self._fsync = fsync
        self._f = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self.records: list[ChunkRecord] = []

    def append(self, key: str, offsets: Sequence[int], tensor: torch.Tensor) -> ChunkRecord:
        t = tensor.detach()
        if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone(memory_format=torch.contiguous_format)  # torch.save writes the whole storage
        start = self._f.tell()
        sink = _Sink(self._f)
        try:
            with _no_zip_crc():
                torch.save(t, sink)
        except RuntimeError as exc:  # torch reports a failed write as "unexpected pos ..."; surface the OS error
            if sink.error is not None:
                raise sink.error from exc
            raise
        rec = ChunkRecord(key, tuple(int(o) for o in offsets), tuple(t.shape), t.dtype, self.path.name, start,
                          self._f.tell() - start)
        self.records.append(rec)
        return rec

    def close(self) -> None:
        """Flush, fsync (or start writeback, see class doc) and close; the records are final after this."""
        if self._f.closed:
            return
        self._f.flush()
        if self._fsync:
            os.fsync(self._f.fileno())
        _drop_cache(self._f.fileno())
        self._f.close()

    def abort(self) -> None:
        """Close without syncing (after an error; the caller discards the file)."""
        if not self._f.closed:
            self._f.close()

    def __enter__(self) -> ChunkFileWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:
            self.abort()


def _drop_cache(fd: int) -> None:
    """POSIX_FADV_DONTNEED: start writing dirty pages back now and free the clean ones (a 500 GB conversion
    should not push everything else out of the page cache)."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def sync_files(paths: Iterable[Path]) -> None:
    """fsync every file (then drop its cached pages); after the last one returns, all of them are durable."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            _drop_cache(fd)
        finally:
            os.close(fd)


def write_dcp_metadata(ckpt_dir: Path, records: Iterable[ChunkRecord], specs: Mapping[str, TensorSpec]) -> None:
    """Write `.metadata`: every key's global shape, dtype and chunks, and where each chunk is stored.

    Refuses a key with no chunks, chunks outside the tensor, or chunks that do not tile the tensor.
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    by_key: dict[str, list[ChunkRecord]] = {}
    for rec in records:
        by_key.setdefault(rec.key, []).append(rec)
    unknown = sorted(set(by_key) - set(specs))
    if unknown:
        raise TorchDistError(f"chunk for unknown key {unknown[0]!r} (not a tensor of this model)")
    state_md, storage = {}, {}
    for key, spec in specs.items():
        chunks = sorted(by_key.get(key, []), key=lambda r: r.offsets)
        _check_tiling(key, spec, chunks)
        state_md[key] = TensorStorageMetadata(
            properties=TensorProperties(dtype=spec.dtype), size=torch.Size(spec.shape),
            chunks=[ChunkStorageMetadata(offsets=torch.Size(r.offsets), sizes=torch.Size(r.sizes)) for r in chunks])
        for i, r in enumerate(chunks):
            storage[MetadataIndex(key, r.offsets, i)] = _StorageInfo(relative_path=r.relative_path, offset=r.offset,
                                                                     length=r.length)
    md = Metadata(state_dict_metadata=state_md, planner_data={k: (k,) for k in state_md}, storage_data=storage,
                  storage_meta=StorageMeta(checkpoint_id=None, save_id=uuid.uuid4().hex), version="1.0.0")
    atomic_write_bytes(Path(ckpt_dir) / DCP_METADATA_FILE, pickle.dumps(md))


def _check_tiling(key: str, spec: TensorSpec, chunks: list[ChunkRecord]) -> None:
    if not chunks:
        raise TorchDistError(f"key {key!r} has no chunks; every tensor of the model must be written")
    total = 0
    for r in chunks:
        if r.dtype != spec.dtype:
            raise TorchDistError(f"chunk {r.offsets} of {key!r} in {r.relative_path} is {r.dtype}; "
                                 f"the tensor is {spec.dtype}")
        if len(r.offsets) != len(spec.shape) or any(o < 0 or o + s > d for o, s, d in
                                                    zip(r.offsets, r.sizes, spec.shape)):
            raise TorchDistError(f"chunk {r.offsets}+{r.sizes} of {key!r} in {r.relative_path} lies outside "
                                 f"its global shape {spec.shape}")
        total += _numel(r.sizes)
    if total != _numel(spec.shape) or len({r.offsets for r in chunks}) != len(chunks):
        raise TorchDistError(f"chunks of {key!r} cover {total} of {_numel(spec.shape)} elements "
                             "(missing or overlapping chunks)")


def megatron_args(cfg: ModelConfig, **overrides: Any) -> argparse.Namespace:
    """The Megatron-LM `args` a launcher needs to build and check this model (common.pt["args"]).

    Field names follow Megatron-LM plus Miles' DeepSeek-V4 flags (reference §1.5: `--dsv4-*`,
    `--dsa-indexer-*`, `--q-lora-rank`, ...); `check_checkpoint_args` compares num_layers, hidden_size,
    num_attention_heads, max_position_embeddings, padded_vocab_size and the parallel sizes.
    """
    ratio = {CSA: cfg.compress_rates[CSA], HCA: cfg.compress_rates[HCA]}
    args = dict(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=1, kv_channels=cfg.head_dim, ffn_hidden_size=cfg.moe_intermediate_size,
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.head_dim, qk_head_dim=cfg.head_dim,
        qk_pos_emb_head_dim=cfg.rope_head_dim, v_head_dim=cfg.head_dim,
        vocab_size=cfg.vocab_size, padded_vocab_size=cfg.vocab_size, make_vocab_size_divisible_by=1,
        max_position_embeddings=cfg.max_position_embeddings, seq_length=4096,
        position_embedding_type="rope", add_position_embedding=False, rotary_base=int(cfg.rope_theta),
        rotary_interleaved=True, normalization="RMSNorm", norm_epsilon=cfg.rms_norm_eps, swiglu=True,
        add_bias_linear=False, untie_embeddings_and_output_weights=not cfg.tie_word_embeddings,
        num_experts=cfg.n_routed_experts, moe_router_topk=cfg.num_experts_per_tok,
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_shared_expert_intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts,
        moe_router_score_function=cfg.scoring_func, moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=cfg.routed_scaling_factor, moe_layer_freq=[1] * cfg.num_hidden_layers,
        moe_grouped_gemm=True, experimental_attention_variant="dsv4",
        dsv4_hc_mult=cfg.hc_mult, dsv4_hc_sinkhorn_iters=cfg.hc_sinkhorn_iters,
        dsv4_compress_ratios=[ratio.get(t, 0) for t in cfg.layer_types],
        dsv4_compress_rope_theta=cfg.compress_rope_theta, dsv4_o_groups=cfg.o_groups,
        dsv4_o_lora_rank=cfg.o_lora_rank, dsv4_n_hash_layers=cfg.mlp_layer_types.count(HASH_MOE),
        dsv4_window_size=cfg.sliding_window, dsa_indexer_n_heads=cfg.index_n_heads,
        dsa_indexer_head_dim=cfg.index_head_dim, dsa_indexer_topk=cfg.index_topk,
        swiglu_limit=cfg.swiglu_limit,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=1,
        context_parallel_size=1, ckpt_format="torch_dist", use_dist_ckpt=True, bf16=True,
        params_dtype=torch.bfloat16, tokenizer_type="HuggingFaceTokenizer", iteration=0,
    )
    args.update(overrides)
    return argparse.Namespace(**args)


def write_common(ckpt_dir: Path, cfg: ModelConfig, *, hf_config: Mapping[str, Any],
                 extra: Mapping[str, Any] | None = None, iteration: int = 0, names: str = "plugin") -> None:
    """Write `common.pt`: Megatron args + iteration, and under "v4rl" the HF config.json it came from and the
    Megatron names the keys use (`megatron_names`: plugin | megatron)."""
    megatron_column(names)  # refuses an unknown value
    common = {"args": megatron_args(cfg, iteration=iteration), "iteration": iteration, "checkpoint_version": 3.0,
              "num_floating_point_operations_so_far": 0,
              "v4rl": {"format_version": 1, "hf_config": dict(hf_config), "megatron_names": names,
                       **dict(extra or {})}}
    buf = io.BytesIO()
    torch.save(common, buf)
    atomic_write_bytes(Path(ckpt_dir) / COMMON_FILE, buf.getvalue())


def write_checkpointing_config(ckpt_dir: Path) -> None:
    """Write `metadata.json`, Megatron's "this save is complete" marker (write it after everything else)."""
    atomic_write_bytes(Path(ckpt_dir) / CONFIG_FILE, json.dumps(CHECKPOINTING_CONFIG).encode())


def mark_release(root: Path) -> None:
    """Write `latest_checkpointed_iteration.txt` = "release" at the checkpoint root."""
    atomic_write_bytes(Path(root) / ITERATION_FILE, b"release")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to PATH.tmp, fsync, rename over path: readers see the old bytes or the new ones."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ============================================================================================== reading
def resolve_iteration_dir(path: str | Path) -> Path:
    """A checkpoint root (with latest_checkpointed_iteration.txt) or an iteration dir -> the iteration dir."""
    path = Path(path)
    if (path / CONFIG_FILE).is_file():
        return path
    marker = path / ITERATION_FILE
    if not marker.is_file():
        if not path.exists():
            raise TorchDistError(f"{path} does not exist")
        raise TorchDistError(f"{path} is not a torch_dist checkpoint: it has neither {CONFIG_FILE} nor "
                             f"{ITERATION_FILE} (an unfinished save or conversion leaves neither)")
    text = marker.read_text().strip()
    sub = path / (RELEASE_DIR if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else text)
    if not (sub / CONFIG_FILE).is_file():
        raise TorchDistError(f"{marker} points to {sub.name}, but {sub / CONFIG_FILE} is missing: that save never "
                             "completed; re-run the conversion or point at an older iteration")
    return sub


class _StubUnpickler(pickle.Unpickler):
    """Unpickles `.metadata` without megatron installed: megatron classes become empty stubs."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            if module.startswith("megatron"):
                return type(name, (), {"__setstate__": lambda self, state: self.__dict__.update(
                    state if isinstance(state, dict) else {"state": state})})
            raise


def read_dcp_metadata(ckpt_dir: Path) -> Any:
    """The pickled torch.distributed.checkpoint Metadata of an iteration dir."""
    path = Path(ckpt_dir) / DCP_METADATA_FILE
    try:
        with open(path, "rb") as f:
            return _StubUnpickler(f).load()
    except FileNotFoundError:
        raise TorchDistError(f"{path} is missing; not a torch_dist checkpoint (or an unfinished one)") from None
    except Exception as exc:  # noqa: BLE001 - a truncated or garbled pickle raises many types
        raise TorchDistError(f"{path}: cannot read the DCP metadata ({type(exc).__name__}: {exc}); the file is "
                             f"corrupt: {CORRUPT_FIX}") from exc


def read_common(ckpt_dir: Path) -> dict[str, Any]:
    """`common.pt` of an iteration dir (weights_only load; Megatron's argparse Namespace allowed)."""
    path = Path(ckpt_dir) / COMMON_FILE
    if argparse.Namespace not in torch.serialization.get_safe_globals():
        # Not the safe_globals() context manager: its exit would also drop megatron-core's own registration.
        torch.serialization.add_safe_globals([argparse.Namespace])
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise TorchDistError(f"{path} is missing; a torch_dist checkpoint needs its common state") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
        raise TorchDistError(f"{path}: cannot read ({exc}); if Megatron wrote it with custom classes, pass the "
                             "model config explicitly") from exc


def hf_config_of(ckpt_dir: Path) -> dict[str, Any] | None:
    """The HF config.json a v4rl conversion stored in common.pt, or None (e.g. a Megatron training save)."""
    v4rl = read_common(ckpt_dir).get("v4rl")
    return dict(v4rl["hf_config"]) if isinstance(v4rl, dict) and "hf_config" in v4rl else None


class TorchDistReader:
    """Reads boxes of torch_dist tensors straight from the `.distcp` files, any chunking.

    A box that is exactly one stored chunk costs one read; otherwise the overlapping chunks are read
    (kept in a small LRU of `cache_bytes`) and copied in. Memory: the box plus the cache.
    """

    def __init__(self, ckpt_dir: str | Path, *, cache_bytes: int = 1 << 30) -> None:
        self.dir = resolve_iteration_dir(ckpt_dir)
        md = read_dcp_metadata(self.dir)
        self.tensors: dict[str, Any] = {k: v for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks")}
        self._storage: dict[tuple[str, tuple[int, ...]], Any] = {
            (idx.fqn, tuple(idx.offset)): info for idx, info in md.storage_data.items()}
        self._cache: OrderedDict[tuple[str, tuple[int, ...]], torch.Tensor] = OrderedDict()
        self._cache_bytes = cache_bytes

    def spec(self, key: str) -> TensorSpec:
        md = self._tensor(key)
        return TensorSpec(tuple(md.size), md.properties.dtype)

    def _tensor(self, key: str) -> Any:
        try:
            return self.tensors[key]
        except KeyError:
            raise TorchDistError(f"{self.dir / DCP_METADATA_FILE} has no tensor {key!r}") from None

    def read(self, box: Box) -> torch.Tensor:
        md = self._tensor(box.key)
        end = tuple(o + s for o, s in zip(box.offsets, box.sizes))
        if len(end) != len(md.size) or any(e > d for e, d in zip(end, md.size)):
            raise TorchDistError(f"box {box.offsets}+{box.sizes} lies outside {box.key!r} {tuple(md.size)}")
        out: torch.Tensor | None = None
        covered = 0
        for ch in md.chunks:
            c_off, c_size = tuple(ch.offsets), tuple(ch.sizes)
            lo = tuple(max(a, b) for a, b in zip(box.offsets, c_off))
            hi = tuple(min(a, b + s) for a, b, s in zip(end, c_off, c_size))
            if any(h <= l for l, h in zip(lo, hi)):
                continue
            data = self._chunk(box.key, c_off, c_size, md.properties.dtype)
            if c_off == box.offsets and c_size == box.sizes:
                return data
            if out is None:
                out = torch.empty(box.sizes, dtype=md.properties.dtype)
            src = data[tuple(slice(l - c, h - c) for l, h, c in zip(lo, hi, c_off))]
            out[tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, box.offsets))] = src
            covered += _numel(tuple(h - l for l, h in zip(lo, hi)))
        if out is None or covered != _numel(box.sizes):
            raise TorchDistError(f"{self.dir}: the stored chunks of {box.key!r} do not cover {box.offsets}+{box.sizes}")
        return out

    def _chunk(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        cached = self._cache.get((key, offsets))
        if cached is not None:
            self._cache.move_to_end((key, offsets))
            return cached
        info = self._storage.get((key, offsets))
        if info is None:
            raise TorchDistError(f"{self.dir / DCP_METADATA_FILE}: chunk {offsets} of {key!r} has no storage entry")
        path = self.dir / info.relative_path
        try:
            with open(path, "rb") as f:
                f.seek(info.offset)
                raw = f.read(info.length)
        except FileNotFoundError:
            raise TorchDistError(f"{path} is missing (holds chunk {offsets} of {key!r}); the checkpoint is "
                                 "incomplete: re-run the conversion") from None
        if len(raw) != info.length:
            raise TorchDistError(f"{path} is truncated: chunk {offsets} of {key!r} needs bytes "
                                 f"{info.offset}..{info.offset + info.length}; re-run the conversion")
        try:
            t = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - torch raises several types for a corrupt record
            raise TorchDistError(f"{path}: chunk {offsets} of {key!r} is corrupt ({exc}); re-run the conversion") \
                from exc
        if tuple(t.shape) != sizes or t.dtype != dtype:
            raise TorchDistError(f"{path}: chunk {offsets} of {key!r} holds {t.dtype} {tuple(t.shape)}, the "
                                 f"metadata says {dtype} {sizes}")
        if t.numel() * t.element_size() <= self._cache_bytes:
            self._cache[(key, offsets)] = t
            while sum(v.numel() * v.element_size() for v in self._cache.values()) > self._cache_bytes:
                self._cache.popitem(last=False)
        return t


def check_storage_bounds(ckpt_dir: Path) -> int:
    """Every chunk's byte range lies inside its file; returns the total bytes of the .distcp files."""
    md = read_dcp_metadata(ckpt_dir)
    sizes: dict[str, int] = {}
    for idx, info in md.storage_data.items():
        if info.relative_path not in sizes:
            path = Path(ckpt_dir) / info.relative_path
            if not path.is_file():
                raise TorchDistError(f"{path} is missing; it holds {idx.fqn!r}")
            sizes[info.relative_path] = path.stat().st_size
        if info.offset + info.length > sizes[info.relative_path]:
            raise TorchDistError(f"{Path(ckpt_dir) / info.relative_path} is truncated: {idx.fqn!r} chunk "
                                 f"{tuple(idx.offset)} ends at byte {info.offset + info.length}")
    return sum(sizes.values())


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


CORRUPT_FIX = "re-run the conversion or the save that wrote it (or restore the directory from a copy)"
