"""One process per run directory: `hold_run_dir` takes an exclusive lock on <run_dir>/.v4rl-lock for as long as a
command works in it, so a second `v4rl train`, rl-pipeline flow run or `v4rl demo` on the same directory is refused
at once, with the process that holds it, instead of starting engines and failing a step later on a checkpoint the
first one is writing.

The lock is `flock` on the file, so the kernel drops it when its process ends, however it ends (SIGKILL, a power
cut of a node sharing the directory aside); the file holds the holder's PID and command for the refusal message. A
file still naming a process after the lock came free is what a killed holder leaves: it is taken over with a note.
Within one process the lock is re-entrant (the rl-pipeline flow holds its run directory and its training task,
in a thread of the same process, takes it again).

    with hold_run_dir(run_dir, log=print):   # RunDirBusy: "... is in use by PID 4242 (v4rl train --out ...)"
        ...
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from engines.artifact_store.paths import RUN_LOCK

LOCK_NAME = RUN_LOCK  # the artifact upload skips it by this name
"""A dot file: the artifact upload skips it (engines/artifact_store/paths.py walk_run_dir)."""


class RunDirBusy(RuntimeError):
    """Another live process works in this run directory. Not retryable: a retry would meet the same holder."""

    retryable = False


_HELD: dict[str, list] = {}  # resolved run dir -> [open lock file, hold count]
_HELD_LOCK = threading.Lock()


def _command() -> str:
    try:  # what the user typed, as ps shows it; sys.argv loses the interpreter and `-m`
        text = Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        text = " ".join([sys.executable, *sys.argv])
    text = " ".join(text.split())  # one line in the refusal, whatever `python -c` was given
    return text if len(text) <= 300 else text[:297] + "..."


def _holder(text: str) -> str:
    try:
        info = json.loads(text)
        return f"PID {info['pid']} ({info['command']}, since {info['since']})"
    except (ValueError, KeyError, TypeError):
        return "another process"


@contextlib.contextmanager
def hold_run_dir(run_dir: str | Path, *, log: Callable[[str], None] = print) -> Iterator[None]:
    """Hold the run directory's lock for the block (the directory is created if missing); RunDirBusy names the
    live holder. Released on exit (the file stays, emptied, so that a waiting process never locks a deleted file)."""
    path = Path(run_dir).resolve()
    key = str(path)
    with _HELD_LOCK:
        if key in _HELD:
            _HELD[key][1] += 1
            held = None
        else:
            held = _acquire(path, log)
            _HELD[key] = [held, 1]
    try:
        yield
    finally:
        with _HELD_LOCK:
            _HELD[key][1] -= 1
            if _HELD[key][1] == 0:
                lock_file = _HELD.pop(key)[0]
                lock_file.truncate(0)
                lock_file.close()  # closing the last descriptor releases the flock


def _acquire(path: Path, log: Callable[[str], None]):
    path.mkdir(parents=True, exist_ok=True)
    lock_file = open(path / LOCK_NAME, "a+")  # noqa: SIM115 - held until the block ends
    try:
        fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock_file.seek(0)
        holder = _holder(lock_file.read())
        lock_file.close()
        raise RunDirBusy(f"{path} is in use by {holder}; wait for it to end or stop it, or give another "
                         "directory") from None
    lock_file.seek(0)
    left = lock_file.read().strip()
    if left:
        log(f"{path}: took over the lock left by {_holder(left)}, which ended without releasing it")
    lock_file.truncate(0)
    lock_file.write(json.dumps({"pid": os.getpid(), "command": _command(),
                                "since": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
    lock_file.flush()
    return lock_file
