"""Run guards: a step that hangs fails with the stuck processes' thread stacks, and a train/rollout logprob
mismatch that stays over budget raises an alert, stops the run, or rolls back to the last checkpoint.

    with StepWatch(run_dir, pids) as watch:      # a remote call timed out -> StepHung with a stacks file
        ...
    budget = MismatchBudget(threshold=0.09, steps=3, action="alert")
    event = budget.observe(step, diff)           # None, or {"step", "action", "message"}
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

MismatchAction = Literal["alert", "stop", "rollback"]


class StepHung(RuntimeError):
    """A step made no progress within its timeout; the message names the file with every thread's stack."""


class MismatchBudgetExceeded(ValueError):
    """train/rollout logprob mismatch over budget with action 'stop' (a ValueError: retrying cannot fix it)."""


def thread_stacks(pid: int) -> str:
    """All thread stacks of a process: this one through sys._current_frames, others through py-spy."""
    if pid == os.getpid():
        names = {t.ident: t.name for t in threading.enumerate()}
        return "\n".join(f"--- thread {names.get(tid, tid)} ---\n" + "".join(traceback.format_stack(frame))
                         for tid, frame in sys._current_frames().items())
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    try:
        proc = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(could not capture the stacks of pid {pid}: {exc})"
    return proc.stdout or f"(py-spy gave no stacks for pid {pid}: {proc.stderr.strip()})"


def record_hang(run_dir: Path, step: int, pids: dict[str, int], cause: BaseException) -> Path:
    """Write every watched process's stacks to run_dir/hangs/step_XXXXXX.txt; returns the path."""
    path = Path(run_dir) / "hangs" / f"step_{step:06d}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    parts = [f"step {step} hung: {cause}", f"at {time.strftime('%Y-%m-%d %H:%M:%S')}"]
    for role, pid in sorted(pids.items()):
        parts.append(f"\n===== {role} (pid {pid}) =====\n{thread_stacks(pid)}")
    path.write_text("\n".join(parts) + "\n")
    return path


@dataclass
class MismatchBudget:
    threshold: float = 0.09
    """Mean |train - rollout| logprob per step above which a step counts against the budget."""
    steps: int = 3
    """Consecutive over-threshold steps that exhaust the budget."""
    action: MismatchAction = "alert"
    """alert: record and go on; stop: fail the run; rollback: reload the last checkpoint once, then stop."""
    over: int = 0
    rolled_back: bool = False
    events: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.action not in ("alert", "stop", "rollback"):
            raise ValueError(f"mismatch action {self.action!r} is not one of alert, stop, rollback")
        if self.steps < 1 or not self.threshold > 0:
            raise ValueError(f"mismatch budget needs steps >= 1 and threshold > 0 (got {self.steps}, {self.threshold})")

    def observe(self, step: int, diff: float | None) -> dict | None:
        """Count the step; when the budget is exhausted return the event to act on (also kept in .events)."""
        self.over = self.over + 1 if diff is not None and diff > self.threshold else 0
        if self.over < self.steps:
            return None
        action = self.action
        if action == "rollback" and self.rolled_back:
            action = "stop"  # the same data and seeds would replay the same steps: a second rollback cannot help
        message = (f"train/rollout |Δlogprob| above {self.threshold} for {self.over} consecutive steps "
                   f"(step {step}: {diff:.4f}); action: {action}")
        event = {"step": step, "action": action, "value": diff, "message": message}
        self.events.append(event)
        self.over = 0
        if action == "rollback":
            self.rolled_back = True
        return event


def append_event(run_dir: Path, event: dict) -> None:
    with open(Path(run_dir) / "events.jsonl", "a") as f:
        f.write(json.dumps(event) + "\n")
