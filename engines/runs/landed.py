"""Evaluations as they land in a run directory while its training runs (no Prefect: the flow drives it).

The training engine writes <run_dir>/eval/step_XXXXXX.json itself (the embedded trainer, or Miles' records read
back by engines/miles/results.py), each atomically (temp + rename). The rl-pipeline flow publishes each
one through an evaluate subflow as soon as it lands, while the training task keeps running:

    for step in landed_evaluations(run_dir, done=lambda timeout: wait_for_training(timeout)):
        evaluate(run_dir, ..., step)      # artifact row, pass@k plot, regression check

`done(timeout)` waits up to `timeout` seconds for the training to end and says whether it has; after it has,
one last look publishes what landed meanwhile. An evaluation that a retry dropped and wrote again (the
training resumed from a checkpoint before it: its weights were retrained) lands again, with its new content.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path

_EVAL_FILE = re.compile(r"^step_(\d{6,})\.json$")


class LandedEvaluations:
    """Which eval/step_XXXXXX.json files are new or changed since the last look."""

    def __init__(self, run_dir: str | Path) -> None:
        self.eval_dir = Path(run_dir) / "eval"
        self.seen: dict[int, str] = {}

    def new(self) -> list[int]:
        """Steps whose evaluation landed (or was rewritten) since the last call, in step order."""
        out = []
        for path in sorted(self.eval_dir.iterdir()) if self.eval_dir.is_dir() else ():
            match = _EVAL_FILE.match(path.name)
            if not match:
                continue  # temp files of a write in progress, anything else
            try:
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
            except FileNotFoundError:  # dropped by a resume between listing and reading
                continue
            step = int(match.group(1))
            if self.seen.get(step) != digest:
                self.seen[step] = digest
                out.append(step)
        return sorted(out)


def landed_evaluations(run_dir: str | Path, done: Callable[[float], bool], poll_s: float = 1.0) -> Iterator[int]:
    """Yield each step whose evaluation lands in run_dir until `done` says the training ended, then the rest."""
    landed = LandedEvaluations(run_dir)
    while True:
        finished = done(poll_s)
        yield from landed.new()
        if finished:
            return
