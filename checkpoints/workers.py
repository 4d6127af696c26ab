"""Process pool for checkpoint conversion jobs, with per-worker progress reporting and fail-fast.

    run_jobs(fn, jobs, workers=N, total=bytes, label=..., progress=True)   in-order results of fn(job)
    report_progress(nbytes)                                               called by fn, in the worker
    ProgressBar(label, total, enabled)                                    the byte progress bar it drives
    default_workers()                                                     one worker per usable core

`run_jobs` runs `fn` over the jobs in a ProcessPoolExecutor (fork where available, else spawn), each
worker with one torch thread. A worker calls `report_progress(nbytes)` as it finishes a piece of work;
the bytes travel over a multiprocessing queue to the parent, which drains it into a rich progress bar
on stderr (bytes, bytes/s, time left). The first failing job kills every worker and its error is
re-raised; a worker killed by the OS (out of memory) surfaces as a ConversionError. workers=1 (or one
job) runs everything in the calling process, with `report_progress` feeding the bar directly.

`meanwhile=` runs a callable in a daemon thread of the parent once the workers have forked (convert.py
imports megatron-core with it, for the verification that follows, while the workers convert).

checkpoints/convert.py uses it for HF -> torch_dist (`_convert_job`) and torch_dist -> HF
(`_export_job`), and `ProgressBar` alone for verification. `fn` is pickled to the workers, so it must
be a module-level function and each job picklable (convert.py's are frozen dataclasses).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import torch

from checkpoints.hf_stream import ConversionError

__all__ = ["ProgressBar", "default_workers", "report_progress", "run_jobs"]

_REPORT: Callable[[int], None] | None = None


def _init_worker(q: Any) -> None:
    global _REPORT
    torch.set_num_threads(1)  # one process per core; intra-op threads would only contend
    _REPORT = q.put


def report_progress(nbytes: int) -> None:
    if _REPORT is not None:
        _REPORT(nbytes)


class ProgressBar:
    """A rich progress bar with bytes and bytes/s on stderr, or nothing."""

    def __init__(self, label: str, total: int, enabled: bool) -> None:
        self._progress = None
        if enabled:
            from rich.console import Console
            from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                       TransferSpeedColumn)

            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                      TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True))
            self._task = self._progress.add_task(label, total=total)

    def advance(self, n: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, advance=n)

    def __enter__(self) -> ProgressBar:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()


def run_jobs(fn: Callable[[Any], Any], jobs: Sequence[Any], *, workers: int, total: int, label: str,
              progress: bool, meanwhile: Callable[[], Any] | None = None) -> list[Any]:
    """Run jobs in `workers` processes (fork where available), advancing a byte progress bar; in order results.

    workers=1 runs in this process. The first failing job stops every worker and re-raises its error.
    `meanwhile` runs in a thread of this (otherwise idle) process once the workers exist.
    """
    global _REPORT
    if meanwhile is not None:
        meanwhile = _in_thread(meanwhile)
    if workers <= 1 or len(jobs) <= 1:
        if meanwhile is not None:
            meanwhile()
        with ProgressBar(label, total, progress) as bar:
            _REPORT = bar.advance
            try:
                return [fn(j) for j in jobs]
            finally:
                _REPORT = None
    methods = mp.get_all_start_methods()
    ctx = mp.get_context("fork" if "fork" in methods else "spawn")
    q = ctx.Queue()
    ex = ProcessPoolExecutor(min(workers, len(jobs)), mp_context=ctx, initializer=_init_worker, initargs=(q,))
    futures = {ex.submit(fn, j): i for i, j in enumerate(jobs)}  # workers fork here, before any thread starts
    if meanwhile is not None:
        meanwhile()
    results: list[Any] = [None] * len(jobs)
    try:
        with ProgressBar(label, total, progress) as bar:
            pending = set(futures)
            while pending:
                done, pending = wait(pending, timeout=0.1, return_when=FIRST_COMPLETED)
                _drain(q, bar)
                for f in done:
                    results[futures[f]] = f.result()
            _drain(q, bar)
        return results
    except BrokenProcessPool as exc:
        raise ConversionError("a conversion worker process died (killed by the OS: out of memory?); run again with "
                              "fewer --workers") from exc
    except BaseException:
        _kill_workers(ex)
        raise
    finally:
        ex.shutdown(wait=True, cancel_futures=True)
        q.close()


def _in_thread(fn: Callable[[], Any]) -> Callable[[], None]:
    def start() -> None:
        threading.Thread(target=fn, name="v4rl-prefetch", daemon=True).start()
    return start


def _drain(q: Any, bar: ProgressBar) -> None:
    while True:
        try:
            bar.advance(q.get_nowait())
        except queue.Empty:
            return


def _kill_workers(ex: ProcessPoolExecutor) -> None:
    terminate = getattr(ex, "terminate_workers", None)  # Python >= 3.14
    if terminate is not None:
        terminate()
        return
    for p in list((getattr(ex, "_processes", None) or {}).values()):
        p.terminate()


def default_workers() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
