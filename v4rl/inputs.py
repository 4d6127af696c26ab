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
    """A prompt file: a readable file with a suffix rl/datasets.py reads."""
    if path is None or str(path) == "":
        return None
    if path.is_dir():
        return f"{option} {path} is a directory; give the data file inside it"
    if path.suffix.lower() not in DATA_SUFFIXES:
        return (f"{option} {path}: unsupported file type {path.suffix!r}; give a .jsonl, .json or .parquet file "
                "of {prompt, label} rows")
    if not path.exists():
        return f"{option} {path}: no such file; check the path"
    return _unreadable_file(option, path)


def input_file(option: str, path: Path | None, what: str) -> str | None:
    """Any file the command reads (`what` says what it should hold)."""
    if path is None:
        return None
    if not path.exists():
        return f"{option} {path}: no such file; give {what}"
    if not path.is_file():
        return f"{option} {path} is a directory; give {what}"
    return _unreadable_file(option, path)


def _unreadable_file(option: str, path: Path) -> str | None:
    """Opened for real: root reads what os.access says it may not, and a user may not read what it says it may."""
    try:
        with open(path, "rb"):
            return None
    except PermissionError:
        from checkpoints.paths import unreadable

        return f"{option} {unreadable(path)}"
    except OSError as exc:
        return f"{option} {path}: cannot read it ({exc.strerror}); check the file"


def output_file(option: str, path: Path | None, *, parents_made: bool = False) -> str | None:
    """A file the command writes at the end: its folder must exist (so a long run does not fail at its end), or,
    with `parents_made`, be creatable (the command makes missing folders); either way on a disk that takes it."""
    if path is None:
        return None
    if path.is_dir():
        return f"{option} {path} is a directory; give a file name (e.g. {path / 'out.json'})"
    if not parents_made:
        if not path.parent.exists():
            return f"{option} {path}: the folder {path.parent} does not exist; create it (mkdir -p {path.parent})"
        if not path.parent.is_dir():
            return f"{option} {path}: {path.parent} is a file, not a folder"
    from checkpoints.paths import nearest_folder_reason

    reason = nearest_folder_reason(path, path.parents)
    return f"{option} {reason}" if reason else None


def output_dir(option: str, path: Path | None, *, replaces: str | None = None,
               refuses: tuple[str, ...] = ()) -> str | None:
    """A directory the command creates or resumes (checkpoints.paths.not_output_dir_reason: not a file, on a disk
    that takes new files and has room). Kinds are checkpoints.paths.kind_of's: `replaces`, the kind the command
    replaces whole when present (any other non-empty directory is refused, so a typo never deletes a run or a
    checkpoint); `refuses`, kinds the command's own files must not be mixed into."""
    if path is None:
        return None
    from checkpoints.paths import kind_of, not_output_dir_reason

    if (replaces is not None or refuses) and path.is_dir():
        kind = kind_of(path)
        if replaces is not None and kind not in (replaces, "empty"):
            return (f"{option} {path} already holds {KINDS.get(kind or '', 'other files')}, which this command "
                    f"would replace whole; give a new directory (or remove {path} first)")
        if kind in refuses:
            return f"{option} {path} is {KINDS[kind]}; give a new directory (or one this command wrote before)"
    reason = not_output_dir_reason(path)
    return f"{option} {reason}" if reason else None


KINDS = {"run": "a `v4rl train` run directory", "hf": "a HF checkpoint",
         "torch_dist": "a Megatron torch_dist checkpoint"}


def run_dir(option: str, path: Path | None) -> str | None:
    """A run directory `v4rl train` creates or resumes: not a checkpoint (a run's files would land among its
    weights), and where it holds training checkpoints, the latest one complete on disk."""
    problem = output_dir(option, path, refuses=("hf", "torch_dist"))
    if problem or path is None:
        return problem
    from checkpoints.paths import ITERATION_FILE, not_hf_reason, not_torch_dist_reason

    if (path / "checkpoints" / ITERATION_FILE).is_file():
        reason = not_torch_dist_reason(path / "checkpoints")
        if reason:
            return f"{option} {path} cannot resume: {reason}"
    served = path / "weights" / "current"
    reason = not_hf_reason(served) if (served / "config.json").is_file() else None
    if reason:  # the rollout's weights: rewritten from the base and the trainer's checkpoint when absent
        return f"{option} {path} cannot resume: {reason.split('; ')[0]}; delete {served} and run again (the run " \
               "writes it anew from its training checkpoint)"
    return None


def first_problem(*problems: str | None) -> str | None:
    """The first non-None problem."""
    return next((p for p in problems if p), None)
