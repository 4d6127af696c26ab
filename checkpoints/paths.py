"""What a path a user hands holds, from its marker files, JSON and safetensors headers only (no tensor read, no
torch import), so every command and flow parameter answers a wrong or damaged path in one line, with the fix,
before anything heavy starts.

    not_hf_reason("runs/x/torch_dist")   # 'runs/x/torch_dist is a Megatron torch_dist checkpoint, ...'
    not_torch_dist_reason("runs/x")      # 'runs/x is a `v4rl train` run directory, not a checkpoint; ...'
    kind_of(Path("runs/x"))              # 'run' | 'hf' | 'torch_dist' | 'empty' | None
    tokenizer_dir_of(Path("ckpt/td"))    # where a torch_dist checkpoint's tokenizer is (for export)

Readers check the same things again where they read the tensors; these checks only move the answer to the front.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TORCH_DIST_MARKERS = ("latest_checkpointed_iteration.txt", "metadata.json", "common.pt", ".metadata")
"""Files only a Megatron torch_dist checkpoint (its root or an iteration directory) holds."""
ITERATION_FILE, ITERATION_FILES = "latest_checkpointed_iteration.txt", ("metadata.json", ".metadata", "common.pt")
INDEX_FILE, SINGLE_FILE = "model.safetensors.index.json", "model.safetensors"
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json")
"""Either one lets transformers' AutoTokenizer load (the rollout engine's test for "has a tokenizer")."""
MODEL_TYPE = "deepseek_v4"
HF_FIX = "give the directory of a HF DeepSeek-V4 checkpoint"
TD_FIX = "give a torch_dist checkpoint (root or iteration directory)"


def not_hf_reason(ckpt_dir: str | Path) -> str | None:
    """Why `ckpt_dir` is not a usable HF DeepSeek-V4 checkpoint directory, as one line with the fix; None when it is.

    Tells apart a path that does not exist, a file, an unreadable directory, an empty one, a `v4rl train` run
    directory, a Megatron torch_dist checkpoint (export it), a directory that lacks config.json, a config.json
    that is not JSON or describes another model, missing weights, a shard the index names that is absent, and a
    shard cut short (its header promises more bytes than the file has).
    """
    path = Path(ckpt_dir)
    try:
        if not path.exists():
            return f"{path}: no such directory; {HF_FIX}"
        if not path.is_dir():
            return f"{path} is a file, not a directory; {HF_FIX}"
        names = {p.name for p in path.iterdir()}
    except PermissionError:
        return unreadable(path)
    if is_run_dir(path):
        return run_dir_reason(path, "a HF checkpoint")
    if "config.json" not in names:
        if any(marker in names for marker in TORCH_DIST_MARKERS):
            return (f"{path} is a Megatron torch_dist checkpoint, not a HF one; export it first: "
                    f"v4rl export {path} HF_DIR --format hf-fp8 (or hf-bf16)")
        inside = _hf_inside(path)
        if inside:
            return f"{path} is not a HF checkpoint, but {inside} inside it is: give that directory"
        if not names:
            return f"{path} is empty; {HF_FIX} (bootstrap the tiny model with `v4rl bootstrap --out DIR`)"
        return (f"{path / 'config.json'} is missing; a HF checkpoint directory needs its config.json (bootstrap the "
                "tiny model with `v4rl bootstrap --out DIR`)")
    config = _json_problem(path / "config.json", "the checkpoint's config")
    if isinstance(config, str):
        return config
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type is not None and model_type != MODEL_TYPE:
        return (f"{path} holds a {model_type!r} model (config.json model_type), not DeepSeek-V4 "
                f"({MODEL_TYPE!r}); {HF_FIX}")
    return _weights_problem(path, names)


def not_torch_dist_reason(ckpt_dir: str | Path) -> str | None:
    """Why `ckpt_dir` is not a torch_dist checkpoint (root or iteration directory), one line with the fix; None
    when its marker files are all there (what is inside them is checked where it is read)."""
    path = Path(ckpt_dir)
    try:
        if not path.exists():
            return f"{path}: no such directory; {TD_FIX}"
        if not path.is_dir():
            return f"{path} is a file; give a torch_dist checkpoint directory"
        names = {p.name for p in path.iterdir()}
    except PermissionError:
        return unreadable(path)
    if is_run_dir(path):
        return run_dir_reason(path, "a torch_dist checkpoint")
    if not any(marker in names for marker in TORCH_DIST_MARKERS):
        if "config.json" in names:
            return (f"{path} is a HF checkpoint, not a torch_dist one; convert it first: "
                    f"v4rl convert {path} TORCH_DIST_DIR")
        what = "is empty" if not names else "is not a torch_dist checkpoint"
        return (f"{path} {what}: it has neither metadata.json nor {ITERATION_FILE}; {TD_FIX} (`v4rl convert HF_DIR "
                f"{path}` writes one)")
    iteration = _iteration_dir(path)
    if isinstance(iteration, str):
        return iteration
    try:
        present = {p.name for p in iteration.iterdir()}
    except PermissionError:
        return unreadable(iteration)
    missing = [name for name in ITERATION_FILES if name not in present]
    if not missing and not any(name.endswith(".distcp") for name in present):
        missing = ["the *.distcp weight files"]
    if missing:
        return (f"{iteration / missing[0]} is missing: the checkpoint is partly written (a save or conversion that "
                f"stopped, or a copy cut short). {_td_fix(path, iteration)}")
    return None


def kind_of(path: Path) -> str | None:
    """What an existing directory holds: 'run', 'hf', 'torch_dist' or 'empty'; None for anything else (a missing
    path, a file, an unreadable directory, a directory of other things)."""
    try:
        if not path.is_dir():
            return None
        names = {p.name for p in path.iterdir()}
    except OSError:
        return None
    if not names:
        return "empty"
    if is_run_dir(path):
        return "run"
    if any(marker in names for marker in TORCH_DIST_MARKERS):
        return "torch_dist"
    if "config.json" in names and (INDEX_FILE in names or SINGLE_FILE in names):
        return "hf"
    return None


def is_run_dir(path: Path) -> bool:
    """A `v4rl train` (or rl-pipeline) run directory: its config.json is a TrainRunConfig (base and loop), or it
    holds the run's metrics or training checkpoints."""
    try:
        if (path / "metrics.jsonl").is_file() or (path / "checkpoints" / ITERATION_FILE).is_file():
            return True
        config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else None
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "base" in config and "loop" in config


def run_dir_reason(path: Path, wanted: str) -> str:
    """One line for a run directory handed where `wanted` (a HF or a torch_dist checkpoint) belongs: where in the run
    the checkpoints of that kind are."""
    weights, checkpoints = path / "weights" / "current", path / "checkpoints"
    has_weights = (weights / "config.json").is_file()
    has_checkpoints = (checkpoints / ITERATION_FILE).is_file()
    if "torch_dist" in wanted:
        where = f"give its training checkpoints {checkpoints}" if has_checkpoints else f"give {wanted}"
    elif has_weights:
        where = f"give its latest weights {weights}"
    elif has_checkpoints:
        where = f"export its training checkpoints first: v4rl export {checkpoints} HF_DIR --format hf-fp8"
    else:
        where = f"give {wanted}"
    return f"{path} is a `v4rl train` run directory, not {wanted}; {where}"


def unreadable(path: Path) -> str:
    return (f"{path}: permission denied; make it readable (chmod -R u+rX {path}) or run as a user who can read it")


def not_output_dir_reason(path: Path) -> str | None:
    """Why `path` cannot be a directory a command creates (or adds to), one line with the fix: an existing file,
    or the nearest existing folder is one no new file can be created in, or sits on a full disk."""
    if path.exists() and not path.is_dir():
        return f"{path} is a file; give a directory (it is created if missing)"
    return nearest_folder_reason(path, (path, *path.parents))


MIN_FREE_BYTES = 1 << 20
"""Below this much free space a disk counts as full: no output of any command fits."""


def nearest_folder_reason(path: Path, candidates) -> str | None:
    """The first existing one of `candidates` (path's folder, then its parents) must be a folder that takes a new
    file (tried for real, not os.access: root passes os.access on a read-only mount or an immutable folder) on a
    disk with at least MIN_FREE_BYTES left."""
    import shutil
    import tempfile

    for parent in candidates:
        if not parent.exists():
            continue
        if not parent.is_dir():
            return f"{path}: {parent} is a file, not a folder"
        try:
            with tempfile.TemporaryFile(dir=parent, prefix=".v4rl-write-check-"):
                pass
            free = shutil.disk_usage(parent).free
        except OSError as exc:
            why = exc.strerror or type(exc).__name__
            return f"{path}: cannot write in {parent} ({why}); give a folder you can write to"
        if free < MIN_FREE_BYTES:
            return (f"{path}: the disk holding {parent} is full ({free // 1024} KiB free); free space there or give a "
                    "folder on another disk")
        return None
    return None


def tokenizer_dir_of(ckpt: Path) -> Path | None:
    """Where the tokenizer of a torch_dist checkpoint is: beside it (`v4rl convert` copies it into the root), in
    the HF checkpoint it was converted from (its conversion record), or the base of the `v4rl train` run whose
    checkpoints/ it is; None when none of them has one."""
    root = ckpt if (ckpt / ITERATION_FILE).is_file() or not (ckpt.parent / ITERATION_FILE).is_file() else ckpt.parent
    candidates = [ckpt, root]
    record = _json_problem(root / "v4rl_conversion.json", "")
    if isinstance(record, dict) and isinstance(record.get("source"), str):
        candidates.append(Path(record["source"]))
    run = _json_problem(root.parent / "config.json", "") if root.name == "checkpoints" else None
    if isinstance(run, dict) and isinstance(run.get("base"), str):
        candidates.append(Path(run["base"]))
    for candidate in candidates:
        try:
            if any((candidate / name).is_file() for name in TOKENIZER_MARKERS):
                return candidate
        except OSError:
            continue
    return None


class SafetensorsHeaderError(ValueError):
    """A safetensors file whose header cannot be read: the message is one line naming the file and the fix."""


def safetensors_header(path: Path) -> tuple[dict[str, Any], int, int]:
    """(header, header length, file size) of a safetensors file, reading only its header; SafetensorsHeaderError
    when the file is too short for the header it announces or the header is not a JSON object (PermissionError
    and other OSErrors pass through)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or 8 + n > size:
            raise SafetensorsHeaderError(f"{path} is truncated or not a safetensors file (header of {n} bytes, file "
                                         f"of {size}); re-download or re-export it")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, ValueError) as exc:
            raise SafetensorsHeaderError(f"{path}: cannot read the safetensors header ({exc}); re-download or "
                                         "re-export it") from None
    if not isinstance(header, dict):
        raise SafetensorsHeaderError(f"{path}: the safetensors header is not a JSON object; re-download or "
                                     "re-export it")
    return header, n, size


def safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file cannot be whole (one line), from its header alone: too short for its header, a header
    that is not JSON, or tensors that end beyond the file's last byte (a copy or download cut short)."""
    try:
        header, n, size = safetensors_header(path)
    except PermissionError:
        return unreadable(path)
    except SafetensorsHeaderError as exc:
        return str(exc)
    except OSError as exc:
        return f"{path}: cannot read the safetensors header ({exc}); re-download or re-export it"
    try:
        ends = sorted((int(v["data_offsets"][1]), k) for k, v in header.items() if k != "__metadata__")
    except (AttributeError, KeyError, TypeError, ValueError, IndexError):
        return f"{path}: the safetensors header is malformed; the file is corrupt: re-download or re-export it"
    cut = next(((end, name) for end, name in ends if 8 + n + end > size), None)
    if cut is not None:
        return (f"{path} is truncated: tensor {cut[1]!r} ends at byte {8 + n + cut[0]} but the file has {size}; "
                "re-download or re-export it")
    return None


def _weights_problem(path: Path, names: set[str]) -> str | None:
    """The weights a config.json needs: an index whose every shard is there and whole, or model.safetensors."""
    if INDEX_FILE in names:
        index = _json_problem(path / INDEX_FILE, "a safetensors index")
        if isinstance(index, str):
            return index
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            return f"{path / INDEX_FILE} has no weight_map; re-download or re-export the checkpoint"
        by_shard: dict[str, list[str]] = {}
        for tensor, shard in weight_map.items():
            by_shard.setdefault(str(shard), []).append(str(tensor))
    elif SINGLE_FILE in names:
        by_shard = {SINGLE_FILE: []}
    else:
        return (f"{path} has a config.json but neither {INDEX_FILE} nor {SINGLE_FILE}: the checkpoint is incomplete "
                "(a download or export that stopped); re-download or re-export it")
    for shard, tensors in sorted(by_shard.items()):
        if shard not in names:
            return (f"{path / INDEX_FILE} maps tensor {tensors[0]!r} (and {len(tensors) - 1} more) to shard {shard}, "
                    f"which is missing from {path}: the checkpoint is partly written or downloaded; re-download that "
                    "shard or re-export the checkpoint")
        problem = safetensors_problem(path / shard)
        if problem:
            return problem
    return None


def _json_problem(path: Path, what: str) -> Any:
    """The parsed JSON file, or one line saying why it cannot be read (a string)."""
    try:
        return json.loads(path.read_text())
    except PermissionError:
        return unreadable(path)
    except FileNotFoundError:
        return f"{path}: no such file"
    except (OSError, ValueError) as exc:
        return f"{path} is not valid JSON ({exc}), so not {what}: the file is damaged; re-download or re-export it"


def _hf_inside(path: Path) -> Path | None:
    """A HF DeepSeek-V4 checkpoint one or two levels inside `path` (a demo's base/, a run's weights/current/)."""
    try:
        for child in sorted(p for p in path.iterdir() if p.is_dir()):
            for candidate in (child, *sorted(p for p in child.iterdir() if p.is_dir())):
                if (candidate / "config.json").is_file() and not is_run_dir(candidate):
                    return candidate
    except OSError:
        return None
    return None


def _iteration_dir(path: Path) -> Path | str:
    """The iteration directory a torch_dist root names (or `path` itself), or one line on why there is none."""
    marker = path / ITERATION_FILE
    if not marker.is_file():
        return path
    try:
        text = marker.read_text().strip()
    except PermissionError:
        return unreadable(marker)
    sub = path / ("release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else text)
    if not text or not sub.is_dir():
        return (f"{marker} names iteration {text!r}, but {sub} is missing: the checkpoint is partly written or "
                f"copied. {_td_fix(path, sub)}")
    return sub


def _td_fix(root: Path, iteration: Path) -> str:
    if iteration.name.startswith("iter_"):
        step = int(iteration.name[len("iter_"):]) if iteration.name[len("iter_"):].isdigit() else 0
        return resume_hint(iteration.parent, step)
    return "Re-run the conversion that wrote it (`v4rl convert HF_DIR DST --force`)"


def resume_hint(root: Path, step: int) -> str:
    """How a training run gets going again when iteration `step` under `root` cannot be read (for messages)."""
    earlier = sorted(int(p.name[len("iter_"):]) for p in root.glob("iter_*")
                     if p.name[len("iter_"):].isdigit() and int(p.name[len("iter_"):]) < step
                     and (p / "metadata.json").is_file())
    restart = f"or delete {root} to restart the run from step 0"
    if not earlier:
        return f"No earlier checkpoint is kept: restore {root / f'iter_{step:07d}'} from a copy, {restart}"
    return (f"To resume from the earlier checkpoint of step {earlier[-1]}, write {earlier[-1]} into "
            f"{root / ITERATION_FILE} (kept: steps {', '.join(map(str, earlier))}), {restart}")
