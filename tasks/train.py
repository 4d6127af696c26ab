"""Prefect task: one segment of GRPO training. Retries resume from the run's last checkpoint (the trainer
reloads weights, optimizer, RNG and data cursor), and the cache key is the run key + segment end, not the
task run id, so a new flow run after a crash skips finished segments and resumes the interrupted one.

The config names the engines (flows/rl_pipeline.py `_train_config`): the embedded trainer and rollout engine,
or (`"engine": "miles"`) one Miles job on the cluster that trains up to the segment's end, resuming through
--load by Miles' own rules (engines/train/miles/pipeline.py `train_segment`)."""

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
    if config.get("engine") == "miles":
        from engines.train.miles.pipeline import ClusterRun, train_segment as miles_segment

        summary = miles_segment(ClusterRun.from_miles(config["cluster"]), until, on_line=log.info)
        if progress_id:
            update_progress_artifact(progress_id, progress=100.0 * until / config["steps"])
        return {"run_dir": run_dir, "resumed_from": summary["resumed_from"], "last_step": summary["last_step"]}
    cfg = TrainRunConfig(**{**config, "loop": LoopConfig(**config["loop"])})

    def on_step(step: int, metrics: dict) -> None:
        if progress_id:
            update_progress_artifact(progress_id, progress=100.0 * step / cfg.steps)

    summary = run_training(run_dir, cfg, until=until, log=log.info, on_step=on_step)
    return {"run_dir": run_dir, "resumed_from": summary["resumed_from"], "last_step": summary["last_step"]}
