"""Running a Miles job: stream its log, enforce timeouts, stop the Ray job it submitted, check the resume."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engines.train.miles.checkpoints import prepare_resume
from engines.train.miles.command import MilesJob, launcher_argv
from engines.train.miles.metrics import MetricRecord, parse_metric_line

if TYPE_CHECKING:
    from engines.launch import Site

_RAY_JOB = re.compile(r"Job '(?P<id>[A-Za-z0-9_\-]+)' submitted successfully")


@dataclass
class MilesOutcome:
    """How a Miles run ended."""

    returncode: int | None
    log_path: Path
    records: list[MetricRecord]
    ray_job_id: str | None
    seconds: float
    tail: list[str]

    def last(self, kind: str = "step") -> MetricRecord | None:
        return next((r for r in reversed(self.records) if r.kind == kind), None)


class MilesRunError(RuntimeError):
    """Miles failed (non-zero exit, silent restart); `.outcome` has the log tail and the metrics so far."""

    def __init__(self, message: str, outcome: MilesOutcome) -> None:
        super().__init__(message + "\n--- last log lines ---\n" + "\n".join(outcome.tail[-20:]))
        self.outcome = outcome


class MilesTimeout(MilesRunError):
    """Miles printed nothing for idle_timeout_s (a stalled collective?) or ran past timeout_s; it was killed."""


def stop_ray_job(job_id: str, env: Mapping[str, str] | None = None) -> bool:
    """Best effort `ray job stop <id>` (killing the submitting client does not stop a submitted Ray job)."""
    try:
        done = subprocess.run(["ray", "job", "stop", job_id], env={**os.environ, **(env or {})},
                              capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _terminate(proc: subprocess.Popen, grace_s: float) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_miles(argv: Sequence[str], *, log_path: str | Path, env: Mapping[str, str] | None = None,
              cwd: str | Path | None = None, idle_timeout_s: float = 1800.0, timeout_s: float | None = None,
              on_line: Callable[[str], None] | None = None, on_record: Callable[[MetricRecord], None] | None = None,
              expect_start_rollout: int | None = None, stop_job: Callable[..., bool] = stop_ray_job,
              kill_grace_s: float = 10.0) -> MilesOutcome:
    """Run a Miles command, stream its output, enforce timeouts; return the outcome or raise MilesRunError.

    Each stdout/stderr line is appended to `log_path`, passed to `on_line`, and parsed for metrics
    (`on_record`). No output for `idle_timeout_s`, or a total past `timeout_s`, kills the process group and
    stops the Ray job it submitted (MilesTimeout). A first rollout id below `expect_start_rollout` means the
    resume was ignored: the run is killed (MilesRunError) rather than silently retraining from scratch.
    """
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **(env or {})}
    lines: queue.Queue[str | None] = queue.Queue()
    proc = subprocess.Popen(list(argv), cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1, errors="replace", start_new_session=True)

    def pump() -> None:
        assert proc.stdout is not None
        for text in proc.stdout:
            lines.put(text)
        lines.put(None)

    threading.Thread(target=pump, daemon=True, name="miles-log").start()
    outcome = MilesOutcome(None, log_path, [], None, 0.0, [])
    start = last = time.monotonic()
    failure: tuple[type[MilesRunError], str] | None = None
    first_rollout: int | None = None
    with log_path.open("a", encoding="utf-8") as log:
        while True:
            try:
                text = lines.get(timeout=0.2)
            except queue.Empty:
                text = ""
            now = time.monotonic()
            if text is None:
                break
            if text:
                last, line = now, text.rstrip("\n")
                log.write(line + "\n")
                log.flush()
                outcome.tail = (outcome.tail + [line])[-200:]
                if on_line:
                    on_line(line)
                job = _RAY_JOB.search(line)
                if job:
                    outcome.ray_job_id = job.group("id")
                record = parse_metric_line(line)
                if record:
                    outcome.records.append(record)
                    if on_record:
                        on_record(record)
                    if first_rollout is None and record.kind in ("perf", "rollout"):
                        first_rollout = record.index
                        if expect_start_rollout and first_rollout < expect_start_rollout:
                            failure = (MilesRunError, f"Miles started at rollout {first_rollout}, not at "
                                                      f"{expect_start_rollout}: --load's checkpoint was ignored")
            if failure is None and timeout_s is not None and now - start > timeout_s:
                failure = (MilesTimeout, f"Miles ran past timeout_s={timeout_s:.0f}s; killed")
            if failure is None and now - last > idle_timeout_s:
                failure = (MilesTimeout, f"Miles printed nothing for {idle_timeout_s:.0f}s (a stalled collective? "
                                         "see the flight-recorder dumps at TORCH_NCCL_DEBUG_INFO_TEMP_FILE); killed")
            if failure:
                _terminate(proc, kill_grace_s)
                if outcome.ray_job_id:
                    stop_job(outcome.ray_job_id, env)
                break
    outcome.returncode = proc.wait()
    outcome.seconds = time.monotonic() - start
    if failure:
        raise failure[0](failure[1], outcome)
    if outcome.returncode != 0:
        raise MilesRunError(f"Miles exited with code {outcome.returncode}", outcome)
    return outcome


def run_job(preset_name: str, job: MilesJob, *, site: "Site | None" = None, overrides: Mapping[str, Any] | None = None,
            **run_kwargs: Any) -> MilesOutcome:
    """The cluster training task body: preflight, resume, launch on the existing Ray cluster, stream, check."""
    from engines.launch import Site, preflight_plan, resolve
    from engines.profiles import get_profile

    preflight_plan(preset_name, overrides)  # raises InfeasibleLayout before anything is launched
    preset, _ = resolve(preset_name, overrides)
    profile = get_profile(preset.profile)
    Path(job.save_dir).mkdir(parents=True, exist_ok=True)
    resume = prepare_resume(job.save_dir)
    # unset site values render as ${VAR}: leave those to the inherited environment
    env = {k: v for k, v in (site or Site()).env(profile).items() if not v.startswith("${")}
    return run_miles(launcher_argv(preset, profile, job, resume), log_path=job.log_path, env=env, cwd=job.miles_dir,
                     expect_start_rollout=resume.start_rollout_id or None, **run_kwargs)
