"""Stopping a run's training from another thread: the flow's cancel path reaches the training task through this.

The rl-pipeline runs its one training task in a worker thread of the flow process (flows/rl_pipeline.py) while
the flow's main thread starts evaluation subflows. When the flow run is cancelled, Prefect's runner SIGTERMs
the flow process and the main thread gets the signal; the training thread never does. So the main thread
calls `request_stop(run_dir, reason)`: the run's stop event is set and every stopper the training registered
runs at once (the Miles runner stops its Ray job with `ray job stop`; the embedded trainer kills its Ray actors,
which ends any remote call blocked on them), and the training raises TrainingStopped at its next check.

    stop = stop_request(run_dir)                      # the training side, before it starts anything
    stop.on_stop(lambda: ray.kill(actor))             # run once, on the requesting thread
    ... if stop.is_set(): raise TrainingStopped(stop.reason)
    request_stop(run_dir, "the flow run was cancelled")   # the flow's main thread

`v4rl train` runs its training on the main thread: there SIGTERM (what `timeout`, systemd, Slurm and Kubernetes
send) ends it as Ctrl-C does, through `sigterm_as_interrupt()`, which turns the signal into Terminated, a
KeyboardInterrupt.

No Prefect import: the library below the flows stays Prefect-free.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)


class TrainingStopped(RuntimeError):
    """The training was stopped on request (a cancelled flow run); a retry would not be wanted."""

    retryable = False


class StopRequest:
    """One run's stop flag and the stoppers its training registered."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._stoppers: list[Callable[[], None]] = []
        self.reason = ""

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)

    def on_stop(self, stopper: Callable[[], None]) -> Callable[[], None]:
        """Run `stopper` when a stop is requested (at once if it already was); returns an unregister function."""
        with self._lock:
            already = self._event.is_set()
            if not already:
                self._stoppers.append(stopper)
        if already:
            _run(stopper)

        def unregister() -> None:
            with self._lock:
                if stopper in self._stoppers:
                    self._stoppers.remove(stopper)

        return unregister

    def request(self, reason: str) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self.reason = reason
            self._event.set()
            stoppers, self._stoppers = self._stoppers, []
        for stopper in stoppers:
            _run(stopper)

    def check(self) -> None:
        """Raise TrainingStopped when a stop was requested."""
        if self._event.is_set():
            raise TrainingStopped(f"training stopped: {self.reason}")


def _run(stopper: Callable[[], None]) -> None:
    try:
        stopper()
    except Exception:  # one failing stopper must not keep the others from running; logged, not hidden
        log.exception("a stopper of the training failed")


_REQUESTS: dict[str, StopRequest] = {}
_REQUESTS_LOCK = threading.Lock()


def _key(run_dir: str | Path) -> str:
    return str(Path(run_dir).resolve())


def stop_request(run_dir: str | Path) -> StopRequest:
    """The stop request of the run in `run_dir` (one per process and run directory)."""
    with _REQUESTS_LOCK:
        return _REQUESTS.setdefault(_key(run_dir), StopRequest())


def request_stop(run_dir: str | Path, reason: str) -> None:
    """Ask the training of `run_dir` to stop (idempotent): its stoppers run now, on this thread."""
    stop_request(run_dir).request(reason)


def clear_stop(run_dir: str | Path) -> None:
    """Forget the run's stop request (a new flow run of the same run key in this process starts clean)."""
    with _REQUESTS_LOCK:
        _REQUESTS.pop(_key(run_dir), None)


class Terminated(KeyboardInterrupt):
    """The process got SIGTERM: raised where Ctrl-C's KeyboardInterrupt would be, so it ends the run the same way."""


@contextmanager
def sigterm_as_interrupt() -> Iterator[list[int]]:
    """Within the block SIGTERM raises Terminated in the main thread, once: `timeout` signals the command and then
    its process group, so a second SIGTERM would interrupt the cleanup the first one started. Ray's `ray.init`
    replaces the handler (its own ends in a stack dump and exit 134); engines/train/cluster.py puts it back. Off
    the main thread (a flow's training task) nothing changes: the flow's main thread gets the signal. Yields the
    list the signal is recorded in (empty until it came)."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum: int, frame) -> None:
        if not received:
            received.append(signum)
            raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)
