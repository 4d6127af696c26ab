"""Miles' checkpoints and its resume rules, read on the file level (no torch): where the next Miles run starts.

What Miles (main 31f1ca961) and Megatron-LM (miles-main 2e64d788b) write under `--save` when rollout R is saved
(train.py `save`, `should_run_periodic_action`: every `--save-interval` rollouts and at the last one):

    <save>/iter_{R:07d}/            Megatron `save_checkpoint(iteration=R)`, torch_dist: rank 0 writes common.pt,
        common.pt                   every rank its __<rank>_0.distcp, then .metadata, and metadata.json LAST
        __0_0.distcp ... .metadata  (dist_checkpointing.save's finalize), so metadata.json means complete
        metadata.json
    <save>/latest_checkpointed_iteration.txt   "R", written after every rank finished (the barrier)
    <save>/rollout/global_dataset_state_dict_{R}.pt   the data cursor (sample_offset, epoch_id, ...), written by
                                    the rollout manager after the model save returned

Resume (Miles' own rules, miles/utils/arguments.py:3047-3058 and megatron_utils/actor.py:212):
  - `--load` without latest_checkpointed_iteration.txt: Miles silently loads `--ref-load` with finetune, no
    optimizer/RNG, and starts at rollout 0, so a tracker lost after a crash retrains every rollout;
  - with a tracker naming R: Megatron loads iter_R, Miles starts at R + 1 and the data source reloads
    global_dataset_state_dict_R (missing: it logs "does not exist" and restarts the dataset from its start);
  - a tracker saying "release" makes Megatron load `<load>/release` as iteration 0 and Miles start at rollout 1.

`prepare_resume` turns a save directory a killed run left behind into one where those rules give the right
answer: the newest complete iteration whose data cursor exists (rollouts after it are trained again, from its
weights, so none is trained twice on one lineage), the tracker rewritten to it, or removed when nothing is
complete (then Miles starts from --ref-load at rollout 0, which is right). A partial iter_ directory is left
in place: Megatron overwrites it ("Overwriting old incomplete / corrupted checkpoint") when it saves that
rollout again.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

TRACKER = "latest_checkpointed_iteration.txt"
COMPLETE_MARK = "metadata.json"
"""dist_checkpointing writes it in the save's finalize step, after every shard and `.metadata`."""
_ITER_DIR = re.compile(r"^iter_(\d{7})$")


class MilesCheckpointError(ValueError):
    """A save directory Miles would resume from wrongly, and that v4rl cannot repair safely; says what to do."""


def data_cursor_path(save_dir: str | Path, iteration: int) -> Path:
    """Miles' data cursor for rollout `iteration` (RolloutDataSource.save)."""
    return Path(save_dir) / "rollout" / f"global_dataset_state_dict_{iteration}.pt"


@dataclass(frozen=True)
class MilesCheckpoint:
    """One `iter_XXXXXXX/` directory Miles (Megatron save_checkpoint) wrote."""

    iteration: int
    """The rollout id it holds the weights after (Miles saves with iteration = rollout_id)."""
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
            found.append(MilesCheckpoint(it, child, (child / COMPLETE_MARK).is_file(),
                                         data_cursor_path(root, it).is_file()))
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
    tmp.write_text(f"{iteration}")
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

    @property
    def trained_rollouts(self) -> int:
        """Rollouts the loaded weights have been trained on (= the v4rl step they stand for)."""
        return self.start_rollout_id


def find_resume(save_dir: str | Path) -> Resume:
    """Pick the newest complete checkpoint (with its data cursor if any has one); say what is wrong."""
    tracker = read_tracker(save_dir)
    if isinstance(tracker, str):
        raise MilesCheckpointError(
            f"{Path(save_dir) / TRACKER} says {tracker!r}: Megatron would load {Path(save_dir) / tracker} as iteration "
            "0 and Miles would start at rollout 1, skipping rollout 0. A converted checkpoint belongs in --ref-load "
            "(the convert task's output), not in the training save directory: point save_dir at an empty directory")
    checkpoints = list_checkpoints(save_dir)
    done = [c for c in checkpoints if c.complete]
    killed = [f"iter_{c.iteration:07d} is incomplete (no {COMPLETE_MARK}: the save was killed); Megatron overwrites "
              "it when that rollout is saved again" for c in checkpoints
              if not c.complete and (not done or c.iteration > done[-1].iteration)]
    if not done:
        notes = [f"tracker says {tracker} but no complete iter_* exists; starting from --ref-load"] \
            if isinstance(tracker, int) else []
        return Resume(None, 0, repair_tracker=tracker is not None, notes=tuple(notes + killed))
    with_cursor = [c for c in done if c.has_data_state]
    chosen = with_cursor[-1] if with_cursor else done[-1]
    repair = tracker != chosen.iteration
    notes = [f"tracker says {tracker!r}; resuming from iter_{chosen.iteration:07d}"] if repair else []
    if chosen is not done[-1]:
        notes.append(f"iter_{done[-1].iteration:07d} has no data cursor (killed between the model save and "
                     f"{data_cursor_path(save_dir, done[-1].iteration).name}); resuming from iter_{chosen.iteration:07d} "
                     f"so that rollouts {chosen.iteration + 1}..{done[-1].iteration} are trained again on the right "
                     "prompts")
    elif not chosen.has_data_state:
        notes.append(f"no {data_cursor_path(save_dir, chosen.iteration).name}: the data cursor restarts")
    notes += killed
    return Resume(chosen.iteration, chosen.iteration + 1, repair_tracker=repair, notes=tuple(notes))


def prepare_resume(save_dir: str | Path) -> Resume:
    """find_resume, then repair the tracker so Megatron's --load picks the chosen iteration (or none)."""
    resume = find_resume(save_dir)
    if resume.repair_tracker:
        if resume.iteration is None:
            (Path(save_dir) / TRACKER).unlink(missing_ok=True)
        else:
            write_tracker(save_dir, resume.iteration)
    return resume
