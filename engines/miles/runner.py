"""Running a Miles job: prepare it (plan, site, resume, build), submit it with `ray job submit`, stream its log,
enforce timeouts, stop the Ray job it submitted, check the resume took.

A job ends early, its `ray job submit` client killed and its Ray job stopped (`ray job stop <id>`), when:
  - it prints nothing for `idle_timeout_s` (a stalled collective) or runs past `timeout_s` (MilesTimeout);
  - its checkpoint load prints `<key> from model not in state dict, will skip` (Megatron's torch_dist loader
    only prints that and leaves the parameter at its init): MilesLoadSkipped names the key; a retry cannot
    fix it, so it is not retried (`retryable = False`);
  - its first rollout is below the resume point (--load was ignored: it would retrain from scratch);
  - a stop is requested (engines/runs/stopping.py: the flow run was cancelled): MilesStopped.
Each exception says why, with the log's last lines; `.retryable` tells the Prefect task whether a retry helps."""

from __future__ import annotations

import json
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

from engines.profiles.site import Site
from engines.miles.checkpoints import prepare_resume
from engines.miles.command import MilesCommand, MilesJob, build_command
from engines.miles.metrics import RAY_JOB_SUBMITTED, MetricRecord, parse_metric_line
from engines.miles.submit import submit_argv, submit_env
from engines.runs.stopping import StopRequest

if TYPE_CHECKING:
    from engines.miles.checkpoints import Resume


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

    retryable = True
    """A retry (resubmission from the last complete checkpoint) can help: a lost node, a killed job, a hang."""

    def __init__(self, message: str, outcome: MilesOutcome) -> None:
        super().__init__(message + "\n--- last log lines ---\n" + "\n".join(outcome.tail[-20:]))
        self.outcome = outcome


class MilesJobFailed(MilesRunError):
    """The job itself ended with a non-zero exit (Miles raised, a rank died, its driver was killed)."""


class MilesTimeout(MilesRunError):
    """Miles printed nothing for idle_timeout_s (a stalled collective?) or ran past timeout_s; it was killed."""


class MilesLoadSkipped(MilesRunError):
    """Megatron's checkpoint load skipped a parameter (`... from model not in state dict, will skip`); killed."""

    retryable = False


class MilesStopped(MilesRunError):
    """The job was stopped on request (the flow run was cancelled); its Ray job was stopped."""

    retryable = False


LOAD_SKIPPED = re.compile(r"(?P<key>\S+) from model not in state dict, will skip")
"""Megatron's dist_checkpointing (strategies/torch.py `_validate_global_shapes`) prints this for a model tensor
the checkpoint lacks, then goes on: the parameter keeps its random init and the run trains garbage."""


def stop_ray_job(job_id: str, env: Mapping[str, str] | None = None, *, ray_cli: str = "ray") -> bool:
    """Best effort `ray job stop <id>` (killing the submitting client does not stop a submitted Ray job)."""
    try:
        done = subprocess.run([ray_cli, "job", "stop", job_id], env={**os.environ, **(env or {})},
                              capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def ray_job_logs(job_id: str, env: Mapping[str, str] | None = None, *, ray_cli: str = "ray") -> str | None:
    """The job's whole driver log as the Ray head keeps it (`ray job logs <id>`), or None when it cannot be read."""
    try:
        done = subprocess.run([ray_cli, "job", "logs", job_id], env={**os.environ, **(env or {})},
                              capture_output=True, text=True, errors="replace", timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


ACTORS_GONE_TIMEOUT_S = 120.0
"""How long a failed job's Ray actors are waited for before its run goes on (a retry resubmits)."""


def wait_job_actors(job_id: str, env: Mapping[str, str] | None = None, *, ray_cli: str = "ray",
                    timeout_s: float = ACTORS_GONE_TIMEOUT_S) -> str:
    """Wait until the Ray actors of the failed job `job_id` (a submission id) are gone; a line saying what was
    found. Ray marks a job failed once its driver died and ends its actors after that: the training actor of a
    killed driver went on for seconds, saved the next rollout, and the retry (prepared meanwhile at the rollout
    before) loaded that checkpoint (found by the cluster-rehearsal), a load that could as well have met a save
    half written. Asked through the cluster's state API (`ray list`, RAY_ADDRESS)."""
    def ray_list(*args: str) -> list | None:
        try:
            done = subprocess.run([ray_cli, "list", *args, "--format", "json"], env={**os.environ, **(env or {})},
                                  capture_output=True, text=True, timeout=60)
            if done.returncode != 0:
                return None
            # an empty answer is this sentence, not "[]", whatever --format asks (Ray 2.60)
            return [] if done.stdout.strip() == "No resource in the cluster" else json.loads(done.stdout)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            return None

    def asked(*args: str) -> list | None:  # a state API answer, asked up to 3 times (it failed once, just after)
        for _ in range(3):
            if (answer := ray_list(*args)) is not None:
                return answer
        return None

    jobs = asked("jobs", "--filter", f"submission_id={job_id}")
    driver = (jobs or [{}])[0].get("job_id") if isinstance(jobs, list) else None
    if not driver:
        return f"could not ask Ray which actors of job {job_id} still run (`ray list jobs`): not waited for"
    deadline = time.monotonic() + timeout_s
    while True:
        alive = asked("actors", "--filter", f"job_id={driver}", "--filter", "state=ALIVE", "--limit", "10000")
        if alive is None:
            return f"could not ask Ray which actors of job {job_id} still run (`ray list actors`): not waited for"
        if not alive:
            return f"the actors of job {job_id} have ended"
        if time.monotonic() > deadline:
            names = sorted({a.get("class_name", "?") for a in alive})
            return f"{len(alive)} actors of job {job_id} ({', '.join(names)}) still run after {timeout_s:.0f} s"
        time.sleep(1.0)


def _catch_up(outcome: "MilesOutcome", log, job_logs: Callable[..., str | None], env: Mapping[str, str] | None,
              on_line: Callable[[str], None] | None, on_record: Callable[[MetricRecord], None] | None) -> None:
    """Records the streamed log missed: `ray job submit` streams the driver's log with a lag and stops streaming
    when the job ends, so a job whose driver died (a crash, a lost node) can end with its last rollouts' lines
    unread (found by the cluster-rehearsal: rollout 2 trained and saved, its lines never streamed, the retry found
    nothing left to train and the run lost step 3). The head's whole driver log gives them: its records after
    the streamed ones are recorded, and its lines after them appended to the log."""
    text = job_logs(outcome.ray_job_id, env)
    if text is None:
        say = f"could not read the whole log of Ray job {outcome.ray_job_id} (`ray job logs`): records it printed " \
              "after the stream ended are not in the run directory"
        log.write(say + "\n")
        if on_line:
            on_line(say)
        return
    lines = text.splitlines()
    parsed = [(i, r) for i, line in enumerate(lines) if (r := parse_metric_line(line)) is not None]
    streamed = [(r.kind, r.index) for r in outcome.records]
    if [(r.kind, r.index) for _, r in parsed[:len(streamed)]] != streamed or len(parsed) == len(streamed):
        return  # nothing missed (or a log that is not the streamed one's continuation: nothing is guessed)
    first_missed = parsed[len(streamed)][0]
    log.write(f"--- the rest of Ray job {outcome.ray_job_id}'s driver log (`ray job logs`), unread by the stream ---\n")
    for line in lines[first_missed:]:
        log.write(line + "\n")
        if on_line:
            on_line(line)
    for _, record in parsed[len(streamed):]:
        outcome.records.append(record)
        if on_record:
            on_record(record)


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
              kill_grace_s: float = 10.0, stop: StopRequest | None = None,
              on_job: Callable[[str | None], None] | None = None,
              job_logs: Callable[..., str | None] = ray_job_logs,
              job_actors: Callable[..., str] = wait_job_actors) -> MilesOutcome:
    """Run a Miles command, stream its output, enforce timeouts; return the outcome or raise MilesRunError.

    Each stdout/stderr line is appended to `log_path`, passed to `on_line`, and parsed for metrics
    (`on_record`). No output for `idle_timeout_s`, or a total past `timeout_s`, kills the process group and
    stops the Ray job it submitted (MilesTimeout). A first rollout id below `expect_start_rollout` means the
    resume was ignored: the run is killed (MilesRunError) rather than silently retraining from scratch. A
    load that skips a parameter is killed at its first `will skip` line (MilesLoadSkipped), and a stop request
    (`stop`, set from another thread) kills the run within a poll (MilesStopped). `on_job` hears the Ray job id
    once `ray job submit` prints it and None when the job is over (the run directory's record of a live job).
    A job that ended on its own (done or failed) has the records its streamed log missed read from the head's whole
    driver log (`job_logs`: `ray job logs`) before this returns or raises; a failed one, its actors waited for
    (`job_actors`) so that nothing of it writes to --save while a retry prepares.
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
                job = RAY_JOB_SUBMITTED.search(line)
                if job:
                    outcome.ray_job_id = job.group("id")
                    if on_job:
                        on_job(outcome.ray_job_id)
                skipped = LOAD_SKIPPED.search(line)
                if skipped and failure is None:
                    failure = (MilesLoadSkipped, f"Miles' checkpoint load skipped {skipped.group('key')!r} (\"from "
                               "model not in state dict, will skip\"): that parameter would train from its random "
                               "init; the checkpoint in --load/--ref-load lacks it. Check the conversion against this "
                               "Miles generation (the preflight's key comparison) and convert again; killed, not "
                               "retried")
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
            if failure is None and stop is not None and stop.is_set():
                failure = (MilesStopped, f"Miles job stopped: {stop.reason or 'a stop was requested'}")
            if failure is None and now - last > idle_timeout_s:
                failure = (MilesTimeout, f"Miles printed nothing for {idle_timeout_s:.0f}s (a stalled collective? "
                                         "see the flight-recorder dumps at TORCH_NCCL_DEBUG_INFO_TEMP_FILE); killed")
            if failure:
                _terminate(proc, kill_grace_s)
                if outcome.ray_job_id:
                    stop_job(outcome.ray_job_id, env)
                break
        outcome.returncode = proc.wait()
        if failure is None and outcome.ray_job_id:
            _catch_up(outcome, log, job_logs, env, on_line, on_record)
            if outcome.returncode != 0:
                said = job_actors(outcome.ray_job_id, env)
                log.write(said + "\n")
                if on_line:
                    on_line(said)
    outcome.seconds = time.monotonic() - start
    if on_job:
        on_job(None)
    if failure:
        raise failure[0](failure[1], outcome)
    if outcome.returncode != 0:
        raise MilesJobFailed(f"Miles exited with code {outcome.returncode}", outcome)
    return outcome


@dataclass(frozen=True)
class PreparedJob:
    """What run_job submits: the built command, the `ray job submit` argv and the resume it continues."""

    command: MilesCommand
    submit_argv: list[str]
    submit_env: dict[str, str]
    resume: "Resume"


def prepare_job(preset_name: str, job: MilesJob, *, site: Site, overrides: Mapping[str, Any] | None = None,
                hf_config: Mapping[str, Any] | None = None) -> PreparedJob:
    """Plan the layout, require the site, pick the resume point and build the job; nothing is submitted.

    Raises InfeasibleLayout (a layout Miles cannot run), SiteError (RAY_ADDRESS, MASTER_ADDR or an interface
    unset, naming the deployment parameter), ModelConfigError (config.json) before anything leaves this host.
    """
    from engines.layout import InfeasibleLayout, plan_layout
    from engines.profiles import get_profile
    from engines.presets.runs import resolve

    preset, inp = resolve(preset_name, overrides)
    plan = plan_layout(inp)
    if not plan.feasible:
        raise InfeasibleLayout(plan)
    profile = get_profile(preset.profile)
    site.require(profile)
    Path(job.save_dir).mkdir(parents=True, exist_ok=True)
    resume = prepare_resume(job.save_dir)
    command = build_command(preset, job, site=site, cluster=inp.cluster, profile=profile, resume=resume,
                            hf_config=dict(hf_config) if hf_config is not None else None)
    return PreparedJob(command, submit_argv(command, site), submit_env(site), resume)


def run_job(preset_name: str, job: MilesJob, *, site: Site, overrides: Mapping[str, Any] | None = None,
            prepared: PreparedJob | None = None, **run_kwargs: Any) -> MilesOutcome:
    """The cluster training task body: prepare (plan, site, resume, build), submit to the existing Ray cluster,
    stream the log, check the resume took. `prepared` reuses a job the preflight already built and checked."""
    prepared = prepared or prepare_job(preset_name, job, site=site, overrides=overrides)
    return run_miles(prepared.submit_argv, log_path=job.log_path, env=prepared.submit_env,
                     expect_start_rollout=prepared.resume.start_rollout_id or None, **run_kwargs)
