"""Training checkpoints as Megatron-style torch_dist iterations, resumable after a crash at any point.

    ROOT/latest_checkpointed_iteration.txt     "20"   (written last: the commit point)
    ROOT/iter_0000020/                         torch_dist weights (metadata.json, common.pt, .metadata, .distcp),
                                               iteration 20, loadable by megatron-core
    ROOT/iter_0000020/trainer_state.pt         fp32 master weights, optimizer state, step, RNG state, data
                                               cursor / extra (plain tensors and containers: weights_only=True)

The torch_dist part holds the model in BF16 as Megatron does; the fp32 master copy lives beside the
optimizer state (as in Megatron's distributed optimizer), so a resumed run continues bit for bit.

An iteration is built in a hidden temporary directory and renamed when complete; the iteration file is
rewritten only after that, so a kill at any moment leaves either the previous checkpoint or the new one.
Weights are read back through megatron-core's `dist_checkpointing.load`.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import torch

from checkpoints.names import megatron_to_native, placement
from checkpoints.torch_dist import (ITERATION_FILE, Box, ChunkFileWriter, TorchDistError, megatron_load,
                                    megatron_specs, write_checkpointing_config, write_common, write_dcp_metadata)
from engines.model.config import ModelConfig
from engines.model.params import native_param_specs

TRAINER_STATE = "trainer_state.pt"
KEEP_LAST = 3


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
        raise TorchDistError(f"{marker} names iteration {step} but {iteration_dir(root, step)} is incomplete; "
                             "restore it or delete the marker to restart from the previous iteration")
    return step


def save_training_checkpoint(root: str | Path, step: int, cfg: ModelConfig, native: dict[str, torch.Tensor], *,
                             trainer_state: dict, rng: torch.Tensor, extra: dict) -> Path:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = iteration_dir(root, step)
    tmp = root / f".{final.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
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
        torch.save({"trainer": trainer_state, "master": master, "rng": rng, "extra": extra, "step": step},
                   tmp / TRAINER_STATE)
        write_checkpointing_config(tmp)
        if final.exists():  # a re-save of the same step (a retried segment): replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    marker_tmp = root / f".{ITERATION_FILE}.tmp"
    marker_tmp.write_text(str(step))
    os.replace(marker_tmp, root / ITERATION_FILE)
    for old in sorted(root.glob("iter_*"))[:-KEEP_LAST]:
        shutil.rmtree(old)
    return final


def load_training_checkpoint(root: str | Path, step: int, cfg: ModelConfig) -> dict:
    """{"weights": the torch_dist model read by megatron-core (native names), "master": fp32 master weights,
    "trainer", "rng", "extra"} of iteration `step`."""
    d = iteration_dir(Path(root), step)
    specs = megatron_specs(cfg)
    boxes = [Box(key, (0,) * len(spec.shape), spec.shape) for key, spec in specs.items()]
    tensors = megatron_load(d, boxes, specs)
    megatron_state = {b.key: t for b, t in zip(boxes, tensors)}
    weights = {k: (v.float() if v.is_floating_point() else v) for k, v in megatron_to_native(megatron_state, cfg).items()}
    state = torch.load(d / TRAINER_STATE, weights_only=True)
    if state["step"] != step:
        raise TorchDistError(f"{d / TRAINER_STATE} belongs to step {state['step']}, not {step}")
    return {"weights": weights, **state}
