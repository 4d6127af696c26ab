"""Prefect task: one segment of GRPO training. Retries resume from the run's last checkpoint (the trainer
reloads weights, optimizer, RNG and data cursor), and the cache key is the run key + segment end, not the
task run id, so a new flow run after a crash skips finished segments and resumes the interrupted one."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import update_progress_artifact


def _segment_key(context, parameters) -> str:
    return f"train-{parameters['fingerprint']}-until-{parameters['until']}"


def _transient(task, task_run, state) -> bool:
    """Retry crashes and timeouts, never configuration errors (a retry cannot fix a ValueError)."""
    try:
        state.result()
    except (ValueError, TypeError):
        return False
    except Exception:
        return True
    return False


@task(name="train-segment", cache_key_fn=_segment_key, persist_result=True, retries=2, retry_delay_seconds=[5, 30],
      retry_condition_fn=_transient, timeout_seconds=12 * 3600)
def train_segment(run_dir: str, config: dict, until: int, fingerprint: str, progress_id: str | None = None) -> dict:
    from engines.train.run import TrainRunConfig, run_training
    from rl.loop import LoopConfig

    log = get_run_logger()
    cfg = TrainRunConfig(**{**config, "loop": LoopConfig(**config["loop"])})

    def on_step(step: int, metrics: dict) -> None:
        if progress_id:
            update_progress_artifact(progress_id, progress=100.0 * step / cfg.steps)

    summary = run_training(run_dir, cfg, until=until, log=log.info, on_step=on_step)
    return {"run_dir": run_dir, "resumed_from": summary["resumed_from"], "last_step": summary["last_step"]}


@task(name="train-on-cluster", retries=2, retry_delay_seconds=[60, 300], retry_condition_fn=_transient,
      timeout_seconds=7 * 24 * 3600)
def train_on_cluster(preset: str, site: dict, job: dict, overrides: dict | None = None) -> dict:
    """The cluster path (GPU, `gpu`-marked in tests): the Miles job v4rl builds (engines.train.miles), submitted
    to the existing Ray cluster at site["ray_address"] with our torch_dist as --ref-load; a retry resumes through
    --load from job["save_dir"]'s latest iteration. `site` / `job` hold engines.site.Site / MilesJob fields
    (flows/params.py PipelineParams.site() / miles_job()); a missing site value or an infeasible layout is a
    ValueError and is not retried."""
    from engines.site import Site
    from engines.train.miles import MilesJob, run_job

    log = get_run_logger()
    outcome = run_job(preset, MilesJob(**job), site=Site(**site), overrides=overrides, on_line=log.info)
    last = outcome.last()
    return {"log": str(outcome.log_path), "seconds": outcome.seconds, "ray_job_id": outcome.ray_job_id,
            "last_step": getattr(last, "step", None)}
