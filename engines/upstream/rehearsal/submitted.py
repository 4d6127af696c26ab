"""Miles' train.py submitted as a Ray job, the way the cluster path submits it: `ray job submit` to the rehearsal
head's Jobs API through engines/miles/pipeline.py `ClusterRun.submit`, the code that submits on the cluster (every
rank's variables in the job's runtime env, the log streamed back through the Jobs API, Miles' metric lines
recorded into a run directory by MilesRecorder as metrics.jsonl and eval/step_XXXXXX.json, `ray job stop` on a
stop or a timeout). The rehearsal's own watches run beside it: the engine's first refused request stops the job
naming the refusal, and stage full's kill point SIGKILLs the job's driver, its process group with it (a crash:
no handler of Miles runs, and Ray marks the job failed, as when the driver's node dies).

    error, killed = submit_miles(miles, argv, env, ray=ray, log_path=work / "miles.log",
                                 run_dir=work / "run", save_dir=work / "save", timeout=900, kill_when=kill_point)
"""

from __future__ import annotations

import os
import signal
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

from engines.upstream.rehearsal.ray_session import RaySession

WATCH_S = 0.5
"""How often the kill point and the engine's log are looked at while the job runs."""
JOB_MARK = "V4RL_REHEARSAL_JOB"
"""A runtime-env variable naming one submitted job: how its driver process is found to be killed."""


def job_env(env: dict[str, str], mark: str) -> dict[str, str]:
    """A marked job's runtime env: `env` with JOB_MARK, without RAY_ADDRESS (Ray gives the driver its head's)."""
    return {**{k: v for k, v in env.items() if k != "RAY_ADDRESS"}, JOB_MARK: mark}


def submit_miles(miles: Path, argv: list[str], env: dict[str, str], *, ray: RaySession, log_path: Path,
                 run_dir: Path, save_dir: Path, timeout: float, engine_log: Path | None = None,
                 kill_when: Callable[[], bool] | None = None) -> tuple[str | None, bool]:
    """Submit `python <miles>/train.py argv` with `env` in its runtime env to the Jobs API of `ray` and
    follow it to its end; (Miles' error line or None, whether `kill_when` fired and the driver was killed)."""
    from engines.miles.checkpoints import prepare_resume
    from engines.miles.command import MilesCommand, MilesJob
    from engines.miles.pipeline import ClusterRun
    from engines.miles.runner import MilesJobFailed, MilesRunError, PreparedJob
    from engines.miles.submit import submit_argv, submit_env
    from engines.runs.stopping import StopRequest
    from engines.upstream import sources as src
    from engines.upstream.rehearsal.run import _RefusalWatch, _miles_frame

    site = ray.site()
    mark = uuid.uuid4().hex
    command = MilesCommand(argv=list(argv), env=job_env(env, mark), miles_dir=str(miles))
    job = MilesJob(run_id=log_path.stem, hf_checkpoint="", ref_load="", save_dir=str(save_dir), miles_dir=str(miles),
                   log_dir=str(log_path.parent))
    run = ClusterRun(preset="", job=job, site=site, run_dir=str(run_dir), eval_interval=1, idle_timeout_s=timeout)
    prepared = PreparedJob(command, submit_argv(command, site), submit_env(site), prepare_resume(save_dir))
    recorder = run.recorder(argv)
    recorder.begin(prepared.resume.start_rollout_id)
    stop, killed, done = StopRequest(), threading.Event(), threading.Event()
    refusals = _RefusalWatch(engine_log) if engine_log is not None else None

    def watch() -> None:
        while not done.wait(WATCH_S):
            refusal = refusals.first() if refusals else None
            if refusal:  # Miles retries a refused request for a minute: stop now and say why
                stop.request(f"v4rl's engine refused Miles' request: {refusal} (engine log: {engine_log})")
                return
            if kill_when is not None and kill_when() and kill_job_driver(mark):
                killed.set()
                return

    watcher = threading.Thread(target=watch, daemon=True, name="rehearsal-job-watch")
    watcher.start()
    try:
        run.submit(prepared, list(argv), recorder=recorder, stop=stop, timeout_s=timeout)
        return None, killed.is_set()
    except MilesRunError as exc:
        if killed.is_set():
            return None, True
        if stop.is_set():
            return stop.reason, False
        if not isinstance(exc, MilesJobFailed):  # the runner ended it (a timeout, a skipped load): its reason
            return str(exc).splitlines()[0], False
        text = log_path.read_text(errors="replace")
        return f"Miles' Ray job failed{_miles_frame(text, miles)}: {src.engine_error(text)}", False
    finally:
        done.set()
        watcher.join(5)


def kill_job_driver(mark: str) -> bool:
    """SIGKILL the process group of the job's driver, the train.py process whose environment carries `mark`; False
    while there is none (not started yet: the watch tries again)."""
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(part.endswith("train.py") for part in proc.info["cmdline"] or ()) and \
                    proc.environ().get(JOB_MARK) == mark:
                os.killpg(os.getpgid(proc.pid), signal.SIGKILL)
                return True
        except (psutil.Error, ProcessLookupError):
            continue
    return False
