"""The settings both sides of `v4rl bench e2e` share, and the data both train on (bench/e2e.py runs them).

One `E2ESettings` describes the run; `v4rl_config` turns it into the `v4rl train` configuration and
bench/e2e_trl.py's `trl_config` into TRL's `GRPOConfig`, so a setting cannot differ between the sides by
accident. `step_prompts` lists, step by step, the prompts `v4rl train` draws (rl.loop.prompts_for_step over
the synthetic training split), which is the order TRL's unshuffled sampler reads them in.

    from bench.e2e_settings import E2ESettings, step_prompts
    rows = step_prompts(E2ESettings(steps=2, prompts_per_step=4))   # 8 {"prompt", "label"} rows
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from engines import TINY_BASE
from rl.loss_setting import LossAggregation, check_loss_aggregation

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BASE = TINY_BASE


@dataclass(kw_only=True)
class E2ESettings:
    steps: int = 20
    """GRPO steps per side. At the default a run takes ~27 minutes on an idle 2-core machine (~130-token prompts);
    TRL's steps (~66 s each against v4rl's ~9) dominate the cost."""
    prompts_per_step: int = 128
    """Prompts per GRPO step (v4rl's default). TRL's generation batch is prompts_per_step x n_samples."""
    n_samples: int = 8
    """Samples per prompt (v4rl n_samples, TRL num_generations); at least 2."""
    max_new_tokens: int = 8
    """Longest response (v4rl max_new_tokens, TRL max_completion_length)."""
    temperature: float = 1.0
    """Sampling temperature of training rollouts (held-out evaluation always samples at 1)."""
    lr: float = 1e-4
    """Constant AdamW learning rate of both sides (no warm-up, no decay)."""
    eval_interval: int = 5
    """Snapshot both sides' weights every this many steps (and at step 0 and the last step) for the held-out
    evaluation after training; 0 evaluates only step 0 and the last step."""
    n_eval: int = 200
    """Held-out problems of each evaluation (v4rl's default synthetic held-out set)."""
    eval_samples: int = 8
    """Samples per held-out problem: pass@1 and pass@8 need 8."""
    n_train: int = 4000
    """Training problems the step schedule cycles through (v4rl's default)."""
    seed: int = 0
    """Seed of the data split, the step schedule and both sides' sampling."""
    base: str = str(DEFAULT_BASE)
    """HF DeepSeek-V4 checkpoint both sides start from."""
    max_tokens_per_gpu: int = 8192
    """v4rl's micro-batch token budget; TRL's per_device_train_batch_size is chosen to fill the same budget."""
    loss_aggregation: LossAggregation = "token-mean"
    """Both sides' loss aggregation (rl/loss_setting.py): token-mean (v4rl's token mean, TRL's loss_type "dapo")
    or sample-mean (each sample's token mean averaged over the step: v4rl's and the cluster job's default, TRL's
    "grpo"). token-mean keeps the comparison the bench has always run."""

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "max_new_tokens", "n_eval", "n_train", "max_tokens_per_gpu"):
            if getattr(self, name) < 1:
                raise ValueError(f"E2ESettings.{name}={getattr(self, name)} must be >= 1")
        if self.n_samples < 2:
            raise ValueError(f"E2ESettings.n_samples={self.n_samples}: GRPO needs at least 2 samples per prompt")
        if self.eval_samples < 8:
            raise ValueError(f"E2ESettings.eval_samples={self.eval_samples}: pass@8 needs at least 8 samples")
        if self.eval_interval < 0:
            raise ValueError(f"E2ESettings.eval_interval={self.eval_interval} must be >= 0 (0: first and last step)")
        if self.temperature <= 0:
            raise ValueError(f"E2ESettings.temperature={self.temperature} must be > 0 (both sides sample)")
        if self.prompts_per_step > self.n_train:
            raise ValueError(f"E2ESettings.prompts_per_step={self.prompts_per_step} exceeds n_train={self.n_train}")
        check_loss_aggregation(self.loss_aggregation, "E2ESettings.loss_aggregation")
        if not (Path(self.base) / "config.json").exists():
            raise ValueError(f"E2ESettings.base={self.base} holds no config.json; point it at an HF DeepSeek-V4 "
                             "checkpoint (default: engines/tiny_base)")

    def eval_steps(self) -> list[int]:
        """Steps whose weights are evaluated: 0, every eval_interval, and the last.

        >>> E2ESettings(steps=12, eval_interval=5).eval_steps()
        [0, 5, 10, 12]
        """
        every = range(self.eval_interval, self.steps + 1, self.eval_interval) if self.eval_interval else []
        return sorted({0, *every, self.steps})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def v4rl_config(settings: E2ESettings):
    """The `v4rl train` configuration of the run: its defaults, with the shared settings, no in-run evaluation
    (both sides are evaluated afterwards by one evaluator) and one training checkpoint at the end."""
    from engines.train.run import TrainRunConfig
    from rl.loop import LoopConfig

    s = settings
    return TrainRunConfig(base=s.base, steps=s.steps, save_interval=s.steps, n_eval=s.n_eval, n_train=s.n_train,
                          lr=s.lr, max_tokens_per_gpu=s.max_tokens_per_gpu, loss_aggregation=s.loss_aggregation,
                          loop=LoopConfig(prompts_per_step=s.prompts_per_step, n_samples=s.n_samples,
                                          temperature=s.temperature, max_new_tokens=s.max_new_tokens,
                                          eval_interval=0, eval_samples=s.eval_samples, seed=s.seed,
                                          dynamic_sampling=False))


def step_prompts(settings: E2ESettings) -> list[dict[str, str]]:
    """The {"prompt", "label"} rows of steps 1..steps in the order `v4rl train` uses them (no dynamic sampling)."""
    from rl.loop import prompts_for_step
    from rl.math_task import make_splits

    s = settings
    train_rows, _ = make_splits(s.n_train, s.n_eval, s.seed)
    return [train_rows[i] for step in range(1, s.steps + 1)
            for i in prompts_for_step(step, len(train_rows), s.prompts_per_step, s.seed)]


def held_out_rows(settings: E2ESettings) -> list[dict[str, str]]:
    """v4rl's held-out set for the settings (make_splits draws it before, and independently of, the training set)."""
    from rl.math_task import make_splits

    return make_splits(0, settings.n_eval, settings.seed)[1]


def synthetic_grader():
    """The grader `v4rl train` uses for the synthetic task: a sample whose reward function fails scores 0 and is
    counted, too many fail the call (rl/grading.py)."""
    import functools

    from rl.grading import Grader
    from rl.rewards import strict_math_reward

    return Grader(functools.partial(strict_math_reward, literal_only=True))
