"""megatron-core reads our torch_dist directories: tensor metadata, boxes of tensors, and errors that name a file.

megatron-core's `dist_checkpointing` needs a process group even on one rank (a loopback gloo group is made
here), and a failed load raises DCP's CheckpointException, a BaseException that names neither file nor tensor;
`check_readable` catches the usual corruptions first and `_load_failure` locates the rest with our own reader.

    with single_rank_process_group():
        meta = megatron_tensor_metadata(ckpt)                          # megatron-core load_tensors_metadata
        tensors = megatron_load(ckpt, [Box(key, offsets, sizes)], specs)   # dist_checkpointing.load

Tests: `.venv/bin/python -m pytest tests/test_torch_dist.py tests/test_bad_inputs.py -q`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from checkpoints.torch_dist import (
    COMMON_FILE,
    CONFIG_FILE,
    CORRUPT_FIX,
    DCP_METADATA_FILE,
    IGNORED_KEY_PREFIXES,
    Box,
    TensorSpec,
    TorchDistError,
    TorchDistReader,
    check_storage_bounds,
    read_dcp_metadata,
    resolve_iteration_dir,
)

@contextlib.contextmanager
def single_rank_process_group() -> Iterator[None]:
    """A one-rank gloo process group on loopback (megatron-core's load needs one); reuses an existing group."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    saved = {k: os.environ.get(k) for k in ("GLOO_SOCKET_IFNAME",)}
    if sys.platform.startswith("linux") and not saved["GLOO_SOCKET_IFNAME"]:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # nothing leaves the machine
    with tempfile.TemporaryDirectory(prefix="v4rl-pg-") as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def import_megatron() -> Any:
    """Import megatron-core's dist_checkpointing quietly (CPU: no TE/Apex warnings); returns the module."""
    import logging

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed" on CPU
        from megatron.core import dist_checkpointing
    logging.getLogger("megatron.core").setLevel(logging.ERROR)
    return dist_checkpointing


def check_readable(ckpt_dir: str | Path, keys: Iterable[str] = ()) -> None:
    """Cheap checks of an iteration dir before megatron-core reads it, each failure a TorchDistError naming the
    file (and tensor): metadata.json parses and says torch_dist, common.pt exists, `.metadata` unpickles, every
    key in `keys` is stored, and every chunk's file exists and is long enough. Contents are not read."""
    d = Path(ckpt_dir)
    _check_config_file(d / CONFIG_FILE)
    if not (d / COMMON_FILE).is_file():
        raise TorchDistError(f"{d / COMMON_FILE} is missing; a torch_dist checkpoint needs its common state: "
                             f"{CORRUPT_FIX}")
    stored = read_dcp_metadata(d).state_dict_metadata
    missing = sorted(k for k in set(keys) if k not in stored)
    if missing:
        raise TorchDistError(f"{d / DCP_METADATA_FILE} has no tensor {missing[0]!r} ({len(missing)} requested "
                             "tensors missing in all): the checkpoint is incomplete or was written for another "
                             f"model config; {CORRUPT_FIX}")
    check_storage_bounds(d)


def _check_config_file(path: Path) -> None:
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise TorchDistError(f"{path} is missing; not a torch_dist checkpoint (or an unfinished one): "
                             f"{CORRUPT_FIX}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TorchDistError(f"{path}: not valid JSON ({exc}); the file is corrupt: {CORRUPT_FIX}") from None
    backend = config.get("sharded_backend") if isinstance(config, dict) else None
    if backend != "torch_dist":
        raise TorchDistError(f"{path}: sharded_backend is {backend!r}, expected 'torch_dist'; point at a torch_dist "
                             "checkpoint (convert with `v4rl convert`)")


def _load_failure(d: Path, boxes: Sequence[Box], exc: BaseException) -> TorchDistError:
    """Turn a megatron-core / DCP load failure into a TorchDistError naming the file and tensor when our own
    reader can locate the bad chunk, else naming the directory and the first underlying error."""
    try:
        reader = TorchDistReader(d)
        for box in boxes:
            reader.read(box)
    except TorchDistError as located:
        return located
    except Exception:  # noqa: BLE001 - the locating pass is best effort; the original error is reported below
        pass
    return TorchDistError(f"{d}: megatron-core could not load the checkpoint ({_first_failure(exc)}); the files "
                          f"are likely corrupt: {CORRUPT_FIX}")


def _first_failure(exc: BaseException) -> str:
    """'Type: message' of the first per-rank failure inside DCP's CheckpointException (or of exc itself)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        exc = inner[0] if isinstance(inner, tuple) and inner else inner
    message = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {message[:300]}"


def _dcp_failures() -> tuple[type[BaseException], ...]:
    """What a failed megatron-core load raises. DCP's CheckpointException derives from BaseException, so a plain
    `except Exception` (Prefect's retry logic, our callers) would not see it."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def megatron_tensor_metadata(ckpt: str | Path) -> dict[str, TensorSpec]:
    """megatron-core `dist_checkpointing.load_tensors_metadata`: key -> global shape and dtype (model keys only)."""
    dist_checkpointing = import_megatron()
    d = resolve_iteration_dir(ckpt)
    check_readable(d)
    with single_rank_process_group():
        try:
            meta = dist_checkpointing.load_tensors_metadata(str(d))
        except _dcp_failures() as exc:
            raise TorchDistError(f"{d}: megatron-core could not read the tensor metadata ({_first_failure(exc)}); "
                                 f"{CORRUPT_FIX}") from exc
    return {k: TensorSpec(tuple(v.global_shape), v.dtype) for k, v in meta.items()
            if not k.startswith(IGNORED_KEY_PREFIXES)}


def megatron_load(ckpt: str | Path, boxes: Sequence[Box], specs: Mapping[str, TensorSpec]) -> list[torch.Tensor]:
    """megatron-core `dist_checkpointing.load` of the given boxes, as ShardedTensors like Megatron's own.

    A whole tensor is a plain ShardedTensor; an equal axis-0 slice is fragment `(0, k, n)` of a regular
    grid (what expert-parallel layers request); any other box an irregular ShardedTensor (global offset
    + local shape). DCP reshards from whatever chunks are stored.
    """
    dist_checkpointing = import_megatron()
    from megatron.core.dist_checkpointing import ShardedTensor

    d = resolve_iteration_dir(ckpt)
    check_readable(d, {box.key for box in boxes})
    sharded = {}
    for i, box in enumerate(boxes):
        spec = specs[box.key]
        data = torch.empty(box.sizes, dtype=spec.dtype)
        rows = box.sizes[0]
        if box.sizes == spec.shape:
            sharded[f"t{i}"] = ShardedTensor.from_rank_offsets(box.key, data)
        elif box.sizes[1:] == spec.shape[1:] and spec.shape[0] % rows == 0 and box.offsets[0] % rows == 0:
            sharded[f"t{i}"] = ShardedTensor.from_rank_offsets(box.key, data,
                                                               (0, box.offsets[0] // rows, spec.shape[0] // rows))
        else:
            sharded[f"t{i}"] = ShardedTensor(box.key, data, spec.dtype, tuple(box.sizes), tuple(spec.shape),
                                             tuple(box.offsets), None)
    with single_rank_process_group(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # megatron-core calls DCP's deprecated load_state_dict
        try:
            loaded = dist_checkpointing.load(sharded, str(d), validate_access_integrity=False)
        except _dcp_failures() as exc:
            raise _load_failure(d, boxes, exc) from exc
    return [loaded[f"t{i}"] for i in range(len(boxes))]
