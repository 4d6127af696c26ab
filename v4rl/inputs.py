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
        return _nearest_folder_problem(option, path, path.parents)
    if not path.parent.exists():
        return f"{option} {path}: the folder {path.parent} does not exist; create it (mkdir -p {path.parent})"
    if not path.parent.is_dir():
        return f"{option} {path}: {path.parent} is a file, not a folder"
    reason = _not_writable(path.parent)
    return f"{option} {path}: cannot write in {path.parent} ({reason}); give a folder you can write to" \
        if reason else None


def output_dir(option: str, path: Path | None) -> str | None:
    """A directory the command creates or resumes: must not be an existing file, and it (or the folder it is
    created in) must take a new file: a read-only folder or filesystem is found now, not at the first write."""
    if path is None:
        return None
    if path.exists() and not path.is_dir():
        return f"{option} {path} is a file; give a directory (it is created if missing)"
    return _nearest_folder_problem(option, path, (path, *path.parents))


def _nearest_folder_problem(option: str, path: Path, candidates) -> str | None:
    """The first existing one of `candidates` (path's folder, then its parents) must be a folder that takes files."""
    for parent in candidates:
        if parent.exists():
            if not parent.is_dir():
                return f"{option} {path}: {parent} is a file, not a folder"
            reason = _not_writable(parent)
            return f"{option} {path}: cannot write in {parent} ({reason}); give a folder you can write to" \
                if reason else None
    return None


def _not_writable(folder: Path) -> str | None:
    """Why a new file cannot be created in `folder` (None: it can). Tried for real, not os.access: root passes
    os.access on a read-only mount or an immutable folder."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=folder, prefix=".v4rl-write-check-"):
            return None
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def first_problem(*problems: str | None) -> str | None:
    """The first non-None problem."""
    return next((p for p in problems if p), None)
