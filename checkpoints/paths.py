"""What kind of checkpoint a path holds, from its marker files only (no tensors read, no torch import), so a
command or flow parameter can answer a wrong path in one line before anything heavy starts.

    not_hf_reason("runs/x/torch_dist")   # 'runs/x/torch_dist is a Megatron torch_dist checkpoint, ...'
"""

from __future__ import annotations

from pathlib import Path

TORCH_DIST_MARKERS = ("latest_checkpointed_iteration.txt", "metadata.json", "common.pt", ".metadata")
"""Files only a Megatron torch_dist checkpoint (its root or an iteration directory) holds."""


def not_hf_reason(ckpt_dir: str | Path) -> str | None:
    """Why `ckpt_dir` is not a HF checkpoint directory, as one line with the fix (None when it has a config.json).

    Tells apart a path that does not exist, a file, a Megatron torch_dist checkpoint (export it) and a directory
    that lacks config.json, so every command and flow parameter taking a HF checkpoint answers the same way.
    """
    path = Path(ckpt_dir)
    if (path / "config.json").is_file():
        return None
    if not path.exists():
        return f"{path}: no such directory; give the directory of a HF DeepSeek-V4 checkpoint"
    if not path.is_dir():
        return f"{path} is a file, not a directory; give the directory of a HF DeepSeek-V4 checkpoint"
    if any((path / marker).exists() for marker in TORCH_DIST_MARKERS):
        return (f"{path} is a Megatron torch_dist checkpoint, not a HF one; export it first: "
                f"v4rl export {path} HF_DIR --format hf-fp8 (or hf-bf16)")
    return (f"{path / 'config.json'} is missing; a HF checkpoint directory needs its config.json (bootstrap the "
            "tiny model with `v4rl bootstrap --out DIR`)")


def not_torch_dist_reason(ckpt_dir: str | Path) -> str | None:
    """Why `ckpt_dir` is not a torch_dist checkpoint (root or iteration directory), one line with the fix; None
    when it has a torch_dist marker file (what is inside is checked where it is read)."""
    path = Path(ckpt_dir)
    if not path.exists():
        return f"{path}: no such directory; give a torch_dist checkpoint (root or iteration directory)"
    if not path.is_dir():
        return f"{path} is a file; give a torch_dist checkpoint directory"
    if any((path / marker).exists() for marker in TORCH_DIST_MARKERS):
        return None
    if (path / "config.json").is_file():
        return f"{path} is a HF checkpoint, not a torch_dist one; convert it first: v4rl convert {path} TORCH_DIST_DIR"
    return None  # an unfinished save or an empty directory: the reader says which file is missing
