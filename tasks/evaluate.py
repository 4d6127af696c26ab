"""Prefect tasks: held-out pass@k of the weights at one step, by the run's backend (engines/backends
`Backend.evaluate`), each task with the retry policy its engines need; `Backend.eval_task` names which:

`held_out_eval` (embedded engines, engines/train/held_out.py): the rollout engine serving the weights over real
HTTP, graded by the run's eval_reward; a crash or timeout is retried once after 5 s, a bad input never.
`miles_eval` (cluster, engines/miles/pipeline.py): Miles' own evaluation of the step's checkpoint (the record
Miles logged during training, else its eval-only job, a cluster job: retried once after a minute, whatever failed).

Both write eval/step_XXXXXX.json and return it.

    eval_task(backend)(backend, 10, "runs/x/weights/current")
"""

from __future__ import annotations

from prefect import Task, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from engines.backends import Backend


def _transient(task, task_run, state) -> bool:
    """Retry a crash or a timeout once, never a bad input (a ValueError: bad eval data, an unknown reward)."""
    try:
        state.result()
    except (ValueError, TypeError):
        return False
    except Exception:  # noqa: BLE001 - anything else may pass on a second try
        return True
    return False


@task(name="held-out-eval", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5, timeout_seconds=3 * 3600,
      retry_condition_fn=_transient)
def held_out_eval(backend: Backend, step: int, model_dir: str) -> dict:
    return backend.evaluate(step, model_dir, log=get_run_logger().info)


@task(name="miles-eval", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=60, timeout_seconds=6 * 3600)
def miles_eval(backend: Backend, step: int, model_dir: str) -> dict:
    return backend.evaluate(step, model_dir, log=get_run_logger().info)


EVAL_TASKS: dict[str, Task] = {t.name: t for t in (held_out_eval, miles_eval)}
"""The evaluation tasks by name, the name a backend's `eval_task` gives."""


def eval_task(backend: Backend) -> Task:
    """The task that evaluates with `backend` (KeyError naming the known tasks for a backend naming another)."""
    try:
        return EVAL_TASKS[backend.eval_task]
    except KeyError:
        raise KeyError(f"{type(backend).__name__}.eval_task is {backend.eval_task!r}; tasks/evaluate.py has "
                       f"{', '.join(EVAL_TASKS)}") from None
