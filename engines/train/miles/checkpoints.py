"""Miles' checkpoints: `iter_XXXXXXX/` directories, the tracker file, and where the next run resumes."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

TRACKER = "latest_checkpointed_iteration.txt"
_ITER_DIR = re.compile(r"^iter_(\d{7})$")


@dataclass(frozen=True)
class MilesCheckpoint:
    """One `iter_XXXXXXX/` directory Miles (Megatron save_checkpoint) wrote."""

    iteration: int
    path: Path
    complete: bool
    """metadata.json present: torch_dist rank 0 writes it last, only when the save finished."""
    has_data_state: bool
    """`rollout/global_dataset_state_dict_<iteration>.pt` exists (Miles' data cursor for that rollout)."""


def list_checkpoints(save_dir: str | Path) -> list[MilesCheckpoint]:
    """Every iter_XXXXXXX directory under save_dir, oldest first (complete or not)."""
    root = Path(save_dir)
    found = []
    for child in root.iterdir() if root.is_dir() else ():
        m = _ITER_DIR.match(child.name)
        if m and child.is_dir():
            it = int(m.group(1))
            found.append(MilesCheckpoint(it, child, (child / "metadata.json").is_file(),
                                         (root / "rollout" / f"global_dataset_state_dict_{it}.pt").is_file()))
    return sorted(found, key=lambda c: c.iteration)


def read_tracker(save_dir: str | Path) -> int | str | None:
    """Contents of latest_checkpointed_iteration.txt: an iteration, "release" (a converted checkpoint), or None."""
    path = Path(save_dir) / TRACKER
    if not path.is_file():
        return None
    text = path.read_text().strip()
    return int(text) if text.isdigit() else text


def write_tracker(save_dir: str | Path, iteration: int) -> None:
    """Point the tracker at `iteration` atomically (what Megatron writes after a finished save)."""
    path = Path(save_dir) / TRACKER
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{iteration}\n")
    os.replace(tmp, path)


@dataclass(frozen=True)
class Resume:
    """Where the next Miles run starts: `iteration` None = fresh from --ref-load."""

    iteration: int | None
    start_rollout_id: int
    """Miles starts at loaded iteration + 1; the run fails if its first rollout has a smaller id."""
    repair_tracker: bool = False
    """The tracker is missing or names an unfinished/absent save; `prepare_resume` rewrites it first."""
    extra_args: tuple[str, ...] = ()
    """Flags appended to --extra-args for this resume (e.g. --no-load-optim after an optimizer change)."""
    notes: tuple[str, ...] = ()
    """What was wrong with the tracker or the data cursor, for the task log."""


def find_resume(save_dir: str | Path) -> Resume:
    """Pick the newest complete checkpoint; say what is wrong with the tracker or the data cursor."""
    done = [c for c in list_checkpoints(save_dir) if c.complete]
    tracker = read_tracker(save_dir)
    if not done:
        notes = (f"tracker says {tracker!r} but no complete iter_* exists; starting from --ref-load",) \
            if isinstance(tracker, int) else ()
        return Resume(None, 0, repair_tracker=isinstance(tracker, int), notes=notes)
    newest = done[-1]
    notes = []
    repair = tracker != newest.iteration
    if repair:
        notes.append(f"tracker says {tracker!r}; newest complete checkpoint is iter_{newest.iteration:07d}")
    if not newest.has_data_state:
        notes.append(f"no rollout/global_dataset_state_dict_{newest.iteration}.pt: the data cursor restarts")
    return Resume(newest.iteration, newest.iteration + 1, repair_tracker=repair, notes=tuple(notes))


def prepare_resume(save_dir: str | Path) -> Resume:
    """find_resume, then repair the tracker so Megatron's --load picks the chosen iteration (or none)."""
    resume = find_resume(save_dir)
    if resume.repair_tracker:
        if resume.iteration is None:
            (Path(save_dir) / TRACKER).unlink(missing_ok=True)
        else:
            write_tracker(save_dir, resume.iteration)
    return resume
