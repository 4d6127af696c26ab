"""The weight check after every broadcast of stage full: the engine's weights equal the actor's export.

The bootstrap (bootstrap/sitecustomize.py `_record_broadcasts`) records, for each of Miles' weight updates, every
tensor Miles' actor broadcast (its export: Megatron's weights converted to the HF names and FP8 form SGLang
loads) and the engine's own checksums of its runtime tensors asked right after the update. Here that export is
laid over the tiny HF checkpoint (every tensor Miles sent replaces the file's of the same name) and loaded cold
into a fresh engine, the path a restarted server takes; its runtime checksums must equal the live engine's,
exactly (the fidelity gate's comparison, engines/rollout/fidelity.py). Else the first differing tensor is named.

    checks = check_broadcasts(work / "broadcasts" / "run-1", hf_dir)   # [{"version", "ok", "first_differing"}]
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from checkpoints.hf import INDEX_FILE, SINGLE_FILE


def check_broadcasts(folder: Path, hf: Path) -> list[dict]:
    """One check per recorded broadcast in `folder`, in version order."""
    records = sorted(folder.glob("broadcast-v*.json"), key=lambda p: int(p.stem.split("-v")[1]))
    return [check_broadcast(path, hf) for path in records]


def check_broadcast(record_path: Path, hf: Path) -> dict:
    record = json.loads(record_path.read_text())
    sent = recorded_export(record_path)
    with tempfile.TemporaryDirectory(prefix="v4rl-export-") as tmp:
        expected = export_checksums(export_dir(hf, sent, Path(tmp) / "export"))
    first = first_differing(expected, record["engine_checksums"])
    return {"version": record["version"], "tensors_sent": len(sent), "ok": first is None, "first_differing": first}


def recorded_export(path: Path) -> dict:
    """Every tensor of one recorded broadcast: its record (.json: the parts it lists, one per pipeline stage that
    sent) or one .safetensors file."""
    from safetensors.torch import load_file

    if path.suffix != ".json":
        return load_file(str(path))
    parts = json.loads(path.read_text())["tensors"]
    return {name: t for part in ([parts] if isinstance(parts, str) else parts)
            for name, t in load_file(str(path.with_name(part))).items()}


def export_dir(hf: Path, sent: dict, out: Path) -> Path:
    """The tiny checkpoint with every tensor of `sent` in place of the file's for the same weight (one safetensors
    file; config, tokenizer and the other side files copied). Miles sends SGLang's HF names
    (`model.layers.N.self_attn...weight_scale_inv`), the file has the release's (`layers.N.attn....scale`): both
    are matched by v4rl's native name, and a weight sent replaces the stored weight and its scale."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from checkpoints.hf import _native_name

    out.mkdir(parents=True)
    sent_slots = {_native_name(name, "broadcast") for name in sent}
    sent_weights = {native for native, is_scale in sent_slots if not is_scale}
    tensors = {}
    for shard in sorted(hf.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                native, is_scale = _native_name(name, shard.name)
                if native is None or (native not in sent_weights and (native, is_scale) not in sent_slots):
                    tensors[name] = f.get_tensor(name)
    tensors.update(sent)
    for side in hf.iterdir():
        if side.is_file() and side.suffix != ".safetensors" and side.name != INDEX_FILE:
            shutil.copy2(side, out / side.name)
    save_file(tensors, str(out / SINGLE_FILE), metadata={"format": "pt"})
    return out


def export_checksums(model_dir: Path) -> dict[str, str]:
    """The runtime checksums of a fresh engine loaded cold from `model_dir` (as `v4rl serve-rollout` loads it)."""
    from engines.rollout.engine import RolloutEngine

    engine = RolloutEngine(model_dir)
    try:
        return engine.checksums()
    finally:
        engine.shutdown()


def first_differing(expected: dict[str, str], live: dict[str, str]) -> str | None:
    """The first tensor name (sorted) whose checksum differs, or that only one side has; None when all equal."""
    for name in sorted(expected.keys() | live.keys()):
        if expected.get(name) != live.get(name):
            side = "" if name in expected and name in live else (
                " (only in the export)" if name in expected else " (only in the engine)")
            return name + side
    return None


def first_differing_tensor(a: Path, b: Path) -> str | None:
    """The first tensor name (sorted) whose values differ between two recorded exports (or that one lacks);
    each a record (.json) or a .safetensors file (recorded_export)."""
    import torch

    x, y = recorded_export(a), recorded_export(b)
    for name in sorted(x.keys() | y.keys()):
        if name not in x or name not in y or x[name].dtype != y[name].dtype or not torch.equal(
                x[name].view(torch.uint8) if x[name].dtype.itemsize == 1 else x[name],
                y[name].view(torch.uint8) if y[name].dtype.itemsize == 1 else y[name]):
            return name
    return None
