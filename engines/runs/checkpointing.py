"""Training checkpoints as Megatron-style torch_dist iterations, resumable after a crash at any point.

    ROOT/latest_checkpointed_iteration.txt     "20"   (written last: the commit point)
    ROOT/iter_0000020/                         torch_dist weights (metadata.json, common.pt, .metadata, .distcp),
                                               iteration 20, loadable by megatron-core
    ROOT/iter_0000020/trainer_state.pt         fp32 master weights, optimizer state, step, RNG state, data
                                               cursor / extra (plain tensors and containers: weights_only=True)

The torch_dist part holds the model in BF16 as Megatron does; the fp32 master copy lives beside the
optimizer state (as in Megatron's distributed optimizer), so a resumed run continues bit for bit.

An iteration is built in a hidden temporary directory (ROOT/.iter_0000020.partial-XXXXXXXX), every file
fsynced, and renamed when complete; the iteration file is rewritten only after that, so a kill or a power
loss at any moment leaves either the previous checkpoint or the new one. A save that fails (a full disk, a
permission error) raises CheckpointWriteError naming the step, the iteration directory and the cause, and
removes its partial directory; partial directories left by a killed process are removed by the next save.
Weights are read back through megatron-core's `dist_checkpointing.load`.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from checkpoints.manifest import fsync_dir
from checkpoints.megatron_io import megatron_load
from checkpoints.names import megatron_to_native, placement
from checkpoints.paths import resume_hint
from checkpoints.torch_dist import (
    ITERATION_FILE,
    Box,
    ChunkFileWriter,
    TorchDistError,
    atomic_write_bytes,
    megatron_specs,
    read_dcp_metadata,
    stored_megatron_names,
    write_checkpointing_config,
    write_common,
    write_dcp_metadata,
)
from engines.model.config import ModelConfig
from engines.model.params import native_param_specs

TRAINER_STATE = "trainer_state.pt"
KEEP_LAST = 3
PARTIAL_INFIX = ".partial-"


class CheckpointWriteError(RuntimeError):
    """A training checkpoint could not be written; nothing of it was committed."""


def iteration_dir(root: Path, step: int) -> Path:
    return Path(root) / f"iter_{step:07d}"


def latest_step(root: str | Path) -> int | None:
    """The committed step in ROOT/latest_checkpointed_iteration.txt, or None when there is no checkpoint."""
    marker = Path(root) / ITERATION_FILE
    if not marker.exists():
        return None
    text = marker.read_text().strip()
    if not text.isdigit():
        raise TorchDistError(f"{marker} holds {text!r}, not a training iteration; point the run at its own "
                             "checkpoint directory")
    step = int(text)
    if not (iteration_dir(root, step) / "metadata.json").exists():
        raise TorchDistError(f"{marker} names iteration {step} but {iteration_dir(root, step)} is incomplete (no "
                             f"metadata.json). {resume_hint(Path(root), step)}")
    return step


def save_training_checkpoint(root: str | Path, step: int, cfg: ModelConfig, native: dict[str, torch.Tensor], *,
                             trainer_state: dict, rng: torch.Tensor, extra: dict) -> Path:
    """Write iteration `step` (see the module doc); raises CheckpointWriteError when any write fails."""
    root = Path(root)
    final = iteration_dir(root, step)
    tmp = root / f".{final.name}{PARTIAL_INFIX}{uuid.uuid4().hex[:8]}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        _remove_partials(root)
        tmp.mkdir()
        specs = megatron_specs(cfg)
        dtypes = {name: specs[placement(name, spec.shape, "megatron", cfg.n_routed_experts).name].dtype
                  for name, spec in native_param_specs(cfg).items()}
        with ChunkFileWriter(tmp / "__0_0.distcp") as writer:
            for name, spec in native_param_specs(cfg).items():
                p = placement(name, spec.shape, "megatron", cfg.n_routed_experts)
                tensor = native[name].detach().to(dtypes[name])
                writer.append(p.name, p.offsets, tensor.reshape(p.sizes))
        write_dcp_metadata(tmp, writer.records, specs)
        write_common(tmp, cfg, hf_config=cfg.to_hf_dict(), iteration=step)
        master = {k: v.detach().clone() for k, v in native.items()}
        _save_synced({"trainer": trainer_state, "master": master, "rng": rng, "extra": extra, "step": step},
                     tmp / TRAINER_STATE)
        write_checkpointing_config(tmp)
        fsync_dir(tmp)
        if final.exists():  # a re-save of the same step (a retried segment): replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, Exception):
            raise CheckpointWriteError(
                f"writing the training checkpoint of step {step} to {final} failed: {_cause(exc)}. The partial "
                f"write was removed; {_committed(root)}{_hint(exc)}") from exc
        raise
    try:
        atomic_write_bytes(root / ITERATION_FILE, str(step).encode())
        fsync_dir(root)
    except Exception as exc:
        raise CheckpointWriteError(
            f"iteration {step} is complete in {final} but committing it in {root / ITERATION_FILE} failed: "
            f"{_cause(exc)}; {_committed(root)} (and writes step {step} again){_hint(exc)}") from exc
    for old in sorted(root.glob("iter_*"))[:-KEEP_LAST]:
        shutil.rmtree(old)
    return final


def _cause(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _hint(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return "; free space on (or fix permissions of) the checkpoint filesystem, then rerun"
    return ""


def _committed(root: Path) -> str:
    """Where a rerun resumes, in words, for error messages (never raises)."""
    marker = root / ITERATION_FILE
    try:
        text = marker.read_text().strip()
    except OSError:
        return f"{marker} does not exist (no earlier checkpoint), so a rerun starts from step 0"
    return f"{marker} still names step {text}, so a rerun resumes from there"


def _remove_partials(root: Path) -> None:
    """Partial iteration directories left by a process killed mid-save (never committed, never read)."""
    for stale in root.glob(f".iter_*{PARTIAL_INFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)


class _StateFile:
    """What torch.save writes trainer_state.pt through: keeps the OSError behind a failed write (torch.save
    reports it as "unexpected pos ...") with the file's path on it (a write on a full disk raises
    `[Errno 28] No space left on device` naming no file)."""

    def __init__(self, f: Any, path: Path) -> None:
        self.f, self.path, self.error = f, path, None

    def write(self, data: Any) -> int:
        return self._named(self.f.write, data)

    def flush(self) -> None:
        self._named(self.f.flush)

    def _named(self, call, *args):
        try:
            return call(*args)
        except OSError as exc:
            self.error = exc if exc.filename else OSError(exc.errno, exc.strerror, str(self.path))
            raise self.error from None


def _save_synced(obj: dict, path: Path) -> None:
    with open(path, "wb") as f:
        sink = _StateFile(f, path)
        try:
            torch.save(obj, sink)
        except RuntimeError:
            if sink.error is not None:  # the OS error is the cause; torch's "unexpected pos" only follows from it
                raise sink.error from None
            raise
        if sink.error is not None:  # torch swallowed it
            raise sink.error
        sink.flush()
        os.fsync(f.fileno())


def load_training_checkpoint(root: str | Path, step: int, cfg: ModelConfig) -> dict:
    """{"weights": the torch_dist model read by megatron-core (native names), "master": fp32 master weights,
    "trainer", "rng", "extra"} of iteration `step`."""
    d = iteration_dir(Path(root), step)
    try:  # a corrupt file names itself (and the tensor) and says how to resume from an earlier iteration
        names = stored_megatron_names(read_dcp_metadata(d).state_dict_metadata, where=str(d))  # either generation
        specs = megatron_specs(cfg, names)
        boxes = [Box(key, (0,) * len(spec.shape), spec.shape) for key, spec in specs.items()]
        state = read_trainer_state(d / TRAINER_STATE, step, cfg)
        tensors = megatron_load(d, boxes, specs)
    except TorchDistError as exc:
        raise TorchDistError(f"{exc}. {resume_hint(Path(root), step)}") from exc
    megatron_state = {b.key: t for b, t in zip(boxes, tensors)}
    # tid2eid is int32 on disk (as Miles holds it); native tables are int64, what the models index with
    weights = {k: (v.float() if v.is_floating_point() else v.to(torch.int64))
               for k, v in megatron_to_native(megatron_state, cfg, names).items()}
    return {"weights": weights, **state}


TRAINER_STATE_KEYS = ("trainer", "master", "rng", "extra", "step")


def read_trainer_state(path: Path, step: int, cfg: ModelConfig) -> dict:
    """trainer_state.pt of iteration `step`, checked: readable, all keys, the right step, every master tensor."""
    try:
        state = torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise TorchDistError(f"{path} is missing: iteration {step} is incomplete") from None
    except Exception as exc:  # noqa: BLE001 - truncation and garbage raise RuntimeError, UnpicklingError, KeyError...
        message = " ".join(str(exc).split())[:200]
        raise TorchDistError(f"{path}: cannot read the trainer state ({type(exc).__name__}: {message}); the file "
                             "is truncated or corrupt") from exc
    missing = [k for k in TRAINER_STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise TorchDistError(f"{path} lacks {missing}: not a v4rl trainer state (or a corrupt one)")
    if state["step"] != step:
        raise TorchDistError(f"{path} belongs to step {state['step']}, not {step}")
    absent = [name for name in native_param_specs(cfg) if name not in state["master"]]
    if absent:
        raise TorchDistError(f"{path}: master weight {absent[0]!r} is missing ({len(absent)} tensors in all); "
                             "the file is corrupt or was written for another model config")
    return state
