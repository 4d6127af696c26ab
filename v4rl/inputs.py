"""Up-front checks of the paths a `v4rl` command is given: each returns one line naming the option and the fix
(or None when the input is fine), before anything heavy is imported or started, so a typo costs a second and
leaves nothing behind. Library functions check the same things again where they read the files; these checks
only move the answer to the front.

    problem = hf_checkpoint("--base", Path("runs/nope"))   # '--base runs/nope: no such directory; ...'
"""

from __future__ import annotations

from pathlib import Path

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


def hf_checkpoint(option: str, path: Path | None) -> str | None:
    """A HF DeepSeek-V4 checkpoint directory (config.json inside); a torch_dist directory points at export."""
    if path is None:
        return None
    from checkpoints.paths import not_hf_reason

    reason = not_hf_reason(path)
    return f"{option} {reason}" if reason else None


def torch_dist_checkpoint(option: str, path: Path | None) -> str | None:
    """A Megatron torch_dist checkpoint (root with latest_checkpointed_iteration.txt, or an iteration dir)."""
    if path is None:
        return None
    from checkpoints.paths import not_torch_dist_reason

    reason = not_torch_dist_reason(path)
    return f"{option} {reason}" if reason else None


def data_file(option: str, path: Path | None) -> str | None:
    """A prompt file: exists, is a file, and has a suffix rl/datasets.py reads."""
    if path is None or str(path) == "":
        return None
    if path.suffix.lower() not in DATA_SUFFIXES:
        return (f"{option} {path}: unsupported file type {path.suffix!r}; give a .jsonl, .json or .parquet file "
                "of {prompt, label} rows")
    if not path.exists():
        return f"{option} {path}: no such file; check the path"
    if not path.is_file():
        return f"{option} {path} is a directory; give the data file inside it"
    return None


def input_file(option: str, path: Path | None, what: str) -> str | None:
    """Any file the command reads (`what` says what it should hold)."""
    if path is None:
        return None
    if not path.exists():
        return f"{option} {path}: no such file; give {what}"
    if not path.is_file():
        return f"{option} {path} is a directory; give {what}"
    return None


def output_file(option: str, path: Path | None, *, parents_made: bool = False) -> str | None:
    """A file the command writes at the end: its folder must exist (so a long run does not fail at its end), or,
    with `parents_made`, be creatable (the command makes missing folders)."""
    if path is None:
        return None
    if path.is_dir():
        return f"{option} {path} is a directory; give a file name (e.g. {path / 'out.json'})"
    if parents_made:
        file_parent = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
        return f"{option} {path}: {file_parent} is a file, not a folder" if file_parent else None
    if not path.parent.exists():
        return f"{option} {path}: the folder {path.parent} does not exist; create it (mkdir -p {path.parent})"
    if not path.parent.is_dir():
        return f"{option} {path}: {path.parent} is a file, not a folder"
    return None


def output_dir(option: str, path: Path | None) -> str | None:
    """A directory the command creates or resumes: must not be an existing file."""
    if path is None:
        return None
    if path.exists() and not path.is_dir():
        return f"{option} {path} is a file; give a directory (it is created if missing)"
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                return f"{option} {path}: {parent} is a file, not a folder"
            break
    return None


def first_problem(*problems: str | None) -> str | None:
    """The first non-None problem."""
    return next((p for p in problems if p), None)
