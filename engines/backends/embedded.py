"""The embedded backend (`Backend`): the rl-pipeline's steps on our engines, on this host. An adapter: each step
is one call into the package that owns the engine.

    align      engines/align: our rollout engine generates once, the trainer (from torch_dist, BF16) and
               transformers' reference rescore the same tokens, the first diverging layer and sub-block named
    train      engines/train/run.py `run_training`: rollout worker and trainer as Ray actors, the GRPO loop of
               rl/loop.py, evaluating into eval/ every eval_interval steps, checkpointing every save_interval
    evaluate   engines/train/held_out.py `held_out_eval`: our engine serving the weights over real HTTP (our
               SGLang-compatible server on 127.0.0.1, the client that drives real SGLang), graded as in training

flows/params.py `PipelineParams.backend` builds it for tiny-cpu; the training settings are one TrainRunConfig,
typed across the Prefect task boundary (no dict form in between).

    backend = EmbeddedBackend(run_dir="runs/x", config=TrainRunConfig(steps=20))
    backend.evaluate(0, "ckpt/hf-fp8", log=print)      # eval/step_000000.json: {"pass@1": ..., ...}
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engines.align import AlignConfig
from engines.train.held_out import held_out_eval
from engines.train.run import TrainRunConfig, run_training
from engines.runs.runlog import RunLog
from engines.runs.sinks import open_sinks
from engines.runs.stopping import StopRequest


@dataclass(frozen=True, kw_only=True)
class EmbeddedBackend:
    """The embedded engines of one run: its directory and its training settings."""

    run_dir: str
    """This host's run directory (metrics.jsonl, eval/, checkpoints/, weights/)."""
    config: TrainRunConfig
    """Everything the trainer, the rollout engine and the held-out evaluation read."""

    @property
    def steps(self) -> int:
        return self.config.steps

    @property
    def cpu_steps(self) -> tuple[str, ...]:
        return ("convert", "verify", "cpu-align", "cpu-eval")

    @property
    def overrides(self) -> dict[str, Any]:
        return {}  # the embedded run plans the preset as it is; its numbers are the TrainRunConfig's

    @property
    def megatron_names(self) -> str:
        return "plugin"  # the embedded trainer reads either name set; plugin is what the converter writes by default

    @property
    def eval_task(self) -> str:
        return "held-out-eval"

    def check(self, *, log: Callable[[str], None]) -> dict[str, Any]:
        # TrainRunConfig validated its fields when built; no job or remote engine to check before the run
        return {}

    def align(self, hf_dir: str, torch_dist_dir: str, config: AlignConfig, *,
              log: Callable[[str], None]) -> dict[str, Any]:
        from engines.align import align

        return align(hf_dir, torch_dist_dir, config, log=log)

    def train(self, *, log: Callable[[str], None], on_step: Callable[[int, dict], None],
              stop: StopRequest) -> dict[str, Any]:
        return run_training(self.run_dir, self.config, log=log, on_step=on_step, stop=stop)

    def evaluate(self, step: int, model_dir: str, *, log: Callable[[str], None]) -> dict[str, Any]:
        result = held_out_eval(model_dir, self.config)
        with open_sinks(self.config.metric_sinks, self.run_dir) as sinks:  # the training's dashboards get it too
            RunLog(self.run_dir, sinks=sinks).write_eval(step, result)
        log(f"step {step} evaluated on {model_dir}: {self.config.n_eval} held-out problems")
        return result
