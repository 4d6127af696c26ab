"""Prefect task: the run's ONE long-running training task (DESIGN.md data flow, `train`).

The run's backend trains it (engines/backends `Backend.train`), the engine evaluating itself every eval_interval
steps and checkpointing every save_interval, as Miles does: the embedded trainer (engines/train/run.py) on
tiny-cpu, one Miles job on the cluster (engines/miles/pipeline.py `train_run`). Its evaluations land in
<run_dir>/eval/ while it runs; the flow publishes each through an evaluate subflow as it lands
(flows/rl_pipeline.py submits this task to its thread pool and watches eval/).

Failures: a retry (bounded: `retries`) resumes from the last complete checkpoint (the trainer reloads weights,
optimizer, RNG and data cursor; Miles loads --load's tracker + 1) and drops the records past it first, so no step
is counted twice and no evaluation is lost or duplicated. Each failed attempt says why in the task log and in
<run_dir>/events.jsonl (the report lists events). Errors a retry cannot fix (ValueError, TypeError, an exception
with `retryable = False`: a checkpoint load that skips a parameter, a stop on cancel) are not retried.

Cancel: the flow asks the training to stop (engines/runs/stopping.py) and this task stops the Ray job or the
trainer's Ray actors. The cache key is the run's fingerprint (which includes steps), not the task run id: a new
flow run of a finished run skips training, and one after a crash resumes it.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import update_progress_artifact
from prefect.runtime import task_run

from engines.backends import Backend

RETRIES = 2
"""Resubmissions after a failed attempt (3 attempts in all); each resumes from the last complete checkpoint."""


def _run_key(context, parameters) -> str:
    return f"train-{parameters['fingerprint']}"


def _transient(task, task_run, state) -> bool:
    """Retry crashes, lost jobs and timeouts; never configuration errors or a requested stop."""
    try:
        state.result()
    except (ValueError, TypeError):
        return False
    except Exception as exc:  # noqa: BLE001 - classified here, re-raised by Prefect when not retried
        return bool(getattr(exc, "retryable", True))
    return False


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


@task(name="train", cache_key_fn=_run_key, persist_result=True, retries=RETRIES, retry_delay_seconds=[5, 30],
      retry_condition_fn=_transient)
def train(backend: Backend, fingerprint: str, progress_id: str | None = None) -> dict:
    """Train the whole run (resuming it), the engine evaluating and checkpointing itself; see the module doc.
    `backend`: the run's engines (flows/params.py PipelineParams.backend)."""
    from engines.runs.guards import append_event
    from engines.runs.stopping import stop_request

    log = get_run_logger()
    run_dir = backend.run_dir
    attempt = task_run.run_count
    if attempt > 1:
        log.info("training attempt %d of %d: resuming from the last complete checkpoint (why: see the failure "
                 "above and events.jsonl)", attempt, RETRIES + 1)
    stop = stop_request(run_dir)

    def progress(step: int) -> None:
        if progress_id:
            update_progress_artifact(progress_id, progress=100.0 * step / backend.steps)

    try:
        summary = backend.train(log=log.info, on_step=lambda step, metrics: progress(step), stop=stop)
    except Exception as exc:
        retried = attempt <= RETRIES and not isinstance(exc, (ValueError, TypeError)) \
            and getattr(exc, "retryable", True)
        message = (f"training attempt {attempt} of {RETRIES + 1} failed ({_first_line(exc)}); "
                   + ("a retry resumes from the last complete checkpoint and drops the records past it" if retried
                      else "not retried"))
        from pathlib import Path

        from engines.runs.runlog import RunLog

        rows = RunLog(run_dir).metrics()
        append_event(Path(run_dir), {"step": rows[-1]["step"] if rows else 0, "action": "retry" if retried else "stop",
                                     "message": message})
        log.error(message)
        raise
    return {"run_dir": run_dir, "resumed_from": summary["resumed_from"], "last_step": summary["last_step"]}
