"""The arms of `v4rl bench e2e --arms ...`: `v4rl train` with one of its differences from TRL taken away, to find
which of them makes it learn differently per step (issue 42). Every arm runs the same seeds, prompts and held-out
evaluation as TRL's side of the same seed; `v4rl` is the unchanged default and the only arm timed step by step
against TRL.

  v4rl             `v4rl train` as the bench runs it (bench/e2e_settings.py v4rl_config)
  bf16-rollout     the rollout serves unquantized BF16 weights, the trainer forwards BF16 (no FP8 round trip)
  no-fake-quant    FP8 rollout, but the trainer forwards its BF16 weights (no quantization-aware forward), as
                   Megatron does on the cluster
  no-correction    no rollout correction (TIS off: TRL corrects nothing)
  full-sequences   every sample forwarded whole (no shared prompt prefix)
  one-micro-batch  the whole step in one micro-batch (a token budget no step reaches)
  trl-eps          TRL's advantage epsilon, 1e-4 (v4rl's, as Miles': 1e-6)
  trl-like         TRL's choices at once: BF16 rollout, no correction, whole sequences, TRL's epsilon (not one
                   micro-batch: TRL accumulates micro-batches too, and the whole step at once needs ~20 GB here)

    from bench.e2e_arms import arm_config
    config = arm_config("bf16-rollout", v4rl_config(settings))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from rl.correction_setting import RolloutCorrection

DEFAULT_ARM = "v4rl"


def _bf16_rollout(config):
    return dataclasses.replace(config, rollout_weights="bf16", quantization_aware=False)


def _no_fake_quant(config):
    return dataclasses.replace(config, quantization_aware=False)


def _no_correction(config):
    return dataclasses.replace(config, rollout_correction=RolloutCorrection(mode="none"))


def _full_sequences(config):
    return dataclasses.replace(config, share_prompt_prefix=False)


def _one_micro_batch(config):
    return dataclasses.replace(config, max_tokens_per_gpu=1 << 30)


def _trl_eps(config):
    return dataclasses.replace(config, loop=dataclasses.replace(config.loop, advantage_eps=1e-4))


CHANGES: dict[str, Callable] = {
    "bf16-rollout": _bf16_rollout, "no-fake-quant": _no_fake_quant, "no-correction": _no_correction,
    "full-sequences": _full_sequences,
    "one-micro-batch": _one_micro_batch, "trl-eps": _trl_eps,
}
"""Each single-difference arm: TrainRunConfig -> TrainRunConfig."""
TRL_LIKE = ("bf16-rollout", "no-correction", "full-sequences", "trl-eps")
"""The changes the trl-like arm makes together."""
ARMS: tuple[str, ...] = (DEFAULT_ARM, *CHANGES, "trl-like")


def arm_config(arm: str, config):
    """`config` (the bench's `v4rl train` configuration) changed as `arm` says."""
    if arm == DEFAULT_ARM:
        return config
    if arm == "trl-like":
        for name in TRL_LIKE:
            config = CHANGES[name](config)
        return config
    return CHANGES[arm](config)


def parse_arms(arms: str | None) -> list[str]:
    """The arms to run, the default first (it is timed against TRL): a comma list or None (the default only). An
    unknown name is one line naming the known ones."""
    names = [a.strip() for a in (arms or "").split(",") if a.strip()]
    unknown = [a for a in names if a not in ARMS]
    if unknown:
        raise ValueError(f"--arms: unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    return [DEFAULT_ARM, *[a for a in ARMS if a in names and a != DEFAULT_ARM]]
