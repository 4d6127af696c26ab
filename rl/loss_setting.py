"""How the policy loss aggregates its per-token terms over a step: the one setting (pure data, no torch) that the
embedded trainer (rl.grpo.GRPOConfig), the embedded run (engines/train/run.py TrainRunConfig) and the Miles job
(engines/presets/spec.py AlgorithmSpec -> engines/miles/train_args.py) read, so the two backends train the
same objective. docs/loss.md says what the conformance tests prove about it.

    >>> check_loss_aggregation("token-mean"), miles_loss_flags("token-mean")
    ('token-mean', ['--calculate-per-token-loss'])
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["DEFAULT_LOSS_AGGREGATION", "LOSS_AGGREGATIONS", "LossAggregation", "check_loss_aggregation",
           "miles_loss_flags"]

LossAggregation = Literal["sample-mean", "token-mean"]
"""How a step's per-token policy-gradient terms become one loss:

``sample-mean``  each sample's mean over its own loss tokens, averaged over the step's samples: every response
                 weighs the same whatever its length. Miles' default (``sum_of_sample_mean``, the step's loss
                 divided by its sample count); no Miles flag. TRL's ``loss_type="grpo"``.
``token-mean``   the mean over every loss token of the step: a long response weighs in proportion to its length
                 (DAPO's token-level loss). Miles ``--calculate-per-token-loss``; TRL's ``loss_type="dapo"``.
"""

LOSS_AGGREGATIONS: tuple[str, ...] = get_args(LossAggregation)
DEFAULT_LOSS_AGGREGATION: LossAggregation = "sample-mean"
"""What the cluster job has always trained: v4rl's Miles argv never passed --calculate-per-token-loss."""

_MILES_FLAGS: dict[str, list[str]] = {"sample-mean": [], "token-mean": ["--calculate-per-token-loss"]}


def check_loss_aggregation(value: object, where: str = "loss_aggregation") -> LossAggregation:
    """``value`` when it names an aggregation, else ValueError naming ``where`` and the choices.

    >>> check_loss_aggregation("token_mean")
    Traceback (most recent call last):
    ValueError: loss_aggregation='token_mean': choose sample-mean (each sample's token mean, averaged over the samples; Miles' default) or token-mean (the mean over all the step's tokens; Miles --calculate-per-token-loss)
    """
    if value not in LOSS_AGGREGATIONS:
        raise ValueError(f"{where}={value!r}: choose sample-mean (each sample's token mean, averaged over the "
                         "samples; Miles' default) or token-mean (the mean over all the step's tokens; Miles "
                         "--calculate-per-token-loss)")
    return value  # type: ignore[return-value]


def miles_loss_flags(aggregation: LossAggregation) -> list[str]:
    """The Miles flags that make its loss reduce as ``aggregation`` does."""
    return list(_MILES_FLAGS[check_loss_aggregation(aggregation)])
