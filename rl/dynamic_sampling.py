"""DAPO dynamic sampling: drop groups with no learning signal, over-sample prompts to refill.

What it does
    A group (the n responses to one prompt) whose rewards are all equal (all wrong, or all
    right) has GRPO advantage 0 for every token: it adds nothing to the gradient but still
    counts in the loss's denominator (its tokens or its samples), diluting the step. ``filter_groups`` finds the groups
    that carry signal; ``DynamicSampler.sample(generate)`` asks the rollout for prompts, keeps
    the groups with signal, and asks for more until it holds ``target_groups`` of them.

    Refill rounds are sized from the keep rate seen so far (``missing / keep_rate``, the rate
    floored at 1/4), and bounded by ``max_rounds`` generate calls and ``max_prompts`` prompts
    per step. At the cap it never aborts: it emits a :class:`DynamicSamplingWarning` with the
    numbers and the fix, and returns the groups it has (possibly none: then skip the optimizer
    step). Groups beyond the target are discarded (``surplus``); the prompts they used are
    still consumed, so advance the data cursor by ``result.n_prompts`` for an exact resume.

    Equivalent to Miles' ``--dynamic-sampling-filter-path ...check_reward_nonzero_std`` with
    ``--over-sampling-batch-size``, and verl's ``algorithm.filter_groups`` with
    ``max_num_gen_batches`` (which raises at the cap; we warn and continue).

How to run
    >>> from rl.dynamic_sampling import DynamicSampler, filter_groups
    >>> filter_groups([[0, 0, 0], [0, 1, 0], [1, 1, 1]])
    [1]
    >>> batches = iter([[[0, 1], [1, 1]], [[0, 0], [1, 0]]])  # generate(2), then generate(2)
    >>> result = DynamicSampler(target_groups=2).sample(lambda n: next(batches))
    >>> result.groups, result.n_prompts, result.n_dropped
    ([[0, 1], [1, 0]], 4, 2)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

__all__ = [
    "DynamicSampler",
    "DynamicSamplingResult",
    "DynamicSamplingWarning",
    "default_rewards_of",
    "filter_groups",
    "has_signal",
]

G = TypeVar("G")

MIN_KEEP_RATE = 0.25
"""Floor of the keep-rate estimate used to size refill rounds (at most 4x the missing groups)."""


class DynamicSamplingWarning(UserWarning):
    """Dynamic sampling hit its cap (rounds, prompts or data) before filling the batch."""


def has_signal(rewards: Sequence[float]) -> bool:
    """True when a group's rewards are not all equal (exact comparison, as ``group_advantages``).

    >>> has_signal([1.0, 1.0]), has_signal([0.0, 1.0])
    (False, True)
    """
    values = [float(r) for r in rewards]
    if not values:
        raise ValueError("empty reward group: every prompt needs n_samples_per_prompt >= 2 scored responses")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(
            f"non-finite reward in group {values}: give unscorable samples a finite reward (e.g. 0) before filtering"
        )
    return max(values) != min(values)


def filter_groups(rewards_per_group: torch.Tensor | Sequence[Sequence[float]]) -> list[int]:
    """Indices of the groups whose rewards are not all equal (the ones with a learning signal).

    ``rewards_per_group`` is a ``[G, n]`` tensor or a sequence of per-group reward sequences
    (groups may differ in size). Order is preserved.

    >>> filter_groups(torch.tensor([[1.0, 1.0], [0.0, 1.0]]))
    [1]
    """
    if isinstance(rewards_per_group, torch.Tensor):
        if rewards_per_group.dim() != 2:
            raise ValueError(f"rewards_per_group must be [num_groups, n], got shape {tuple(rewards_per_group.shape)}")
        rewards_per_group = rewards_per_group.tolist()
    return [i for i, rewards in enumerate(rewards_per_group) if has_signal(rewards)]


def default_rewards_of(group: Any) -> Sequence[float]:
    """Rewards of a group: its ``.rewards`` attribute, its ``["rewards"]`` item, or the group itself."""
    if hasattr(group, "rewards"):
        return group.rewards
    if isinstance(group, dict):
        return group["rewards"]
    return group


@dataclass
class DynamicSamplingResult(Generic[G]):
    """Outcome of one :meth:`DynamicSampler.sample` call."""

    groups: list[G]
    """Groups to train on, in generation order (at most ``target_groups``)."""
    target_groups: int
    """Groups asked for."""
    n_prompts: int = 0
    """Prompts consumed (groups generated) over all rounds: advance the data cursor by this."""
    n_rounds: int = 0
    """Calls made to ``generate``."""
    n_no_signal: int = 0
    """Generated groups whose rewards were all equal."""
    n_dropped: int = 0
    """Groups removed for having no signal (equals ``n_no_signal`` when filtering is on, else 0)."""
    n_surplus: int = 0
    """Groups with signal discarded because the target was already reached."""
    capped: bool = False
    """True when sampling stopped at a cap (rounds, prompts, data) short of the target."""
    cap_reason: str = ""
    """Which cap stopped it (empty when not capped)."""

    @property
    def n_oversampled(self) -> int:
        """Prompts generated beyond the target."""
        return max(0, self.n_prompts - self.target_groups)

    def metrics(self) -> dict[str, float]:
        """Per-step metrics (``rollout/`` namespace, as Miles logs rollout statistics)."""
        return {
            "rollout/dynamic_filter_kept": float(len(self.groups)),
            "rollout/dynamic_filter_dropped": float(self.n_dropped),
            "rollout/dynamic_filter_no_signal": float(self.n_no_signal),
            "rollout/dynamic_filter_surplus": float(self.n_surplus),
            "rollout/dynamic_filter_oversampled": float(self.n_oversampled),
            "rollout/dynamic_filter_prompts": float(self.n_prompts),
            "rollout/dynamic_filter_rounds": float(self.n_rounds),
            "rollout/dynamic_filter_capped": float(self.capped),
            "rollout/dynamic_filter_drop_ratio": self.n_no_signal / self.n_prompts if self.n_prompts else 0.0,
        }


@dataclass(kw_only=True)
class DynamicSampler(Generic[G]):
    """Fill a batch with ``target_groups`` groups that carry signal, within a bounded budget.

    ``sample(generate)`` calls ``generate(k)``, which must roll out ``k`` new prompts (the next
    ones in the data order) and return at most ``k`` groups, one per prompt; fewer means the
    data ran out. Each group's rewards are read with ``rewards_of`` (default: ``.rewards``,
    ``["rewards"]`` or the group itself).
    """

    target_groups: int
    """Groups (prompts) per training step, e.g. the rollout batch size. >= 1."""
    max_rounds: int = 4
    """Most ``generate`` calls per step (1 = filter once, never refill). >= 1."""
    max_prompts: int | None = None
    """Most prompts consumed per step; None means ``4 * target_groups``. >= target_groups."""
    enabled: bool = True
    """False: one round of ``target_groups`` prompts, nothing dropped (no-signal groups are still counted)."""
    rewards_of: Callable[[G], Sequence[float]] = field(default=default_rewards_of)
    """Reads the rewards of one group."""

    def __post_init__(self) -> None:
        if self.target_groups < 1:
            raise ValueError(f"target_groups={self.target_groups} must be >= 1 (prompts per training step)")
        if self.max_rounds < 1:
            raise ValueError(
                f"max_rounds={self.max_rounds} must be >= 1; use enabled=False to turn dynamic sampling off"
            )
        if self.max_prompts is not None and self.max_prompts < self.target_groups:
            raise ValueError(
                f"max_prompts={self.max_prompts} < target_groups={self.target_groups}: the first round alone needs "
                f"{self.target_groups} prompts. Set max_prompts >= target_groups or leave it None "
                f"(= 4 * target_groups)."
            )

    @property
    def prompt_budget(self) -> int:
        """Most prompts one :meth:`sample` call may consume."""
        return self.max_prompts if self.max_prompts is not None else 4 * self.target_groups

    def _next_request(self, missing: int, n_prompts: int, n_kept_total: int) -> int:
        """Prompts to ask for next: ``missing / keep_rate`` with the rate floored, within the budget."""
        rate = max(n_kept_total / n_prompts, MIN_KEEP_RATE) if n_prompts else 1.0
        return min(math.ceil(missing / rate), self.prompt_budget - n_prompts)

    def sample(self, generate: Callable[[int], list[G]]) -> DynamicSamplingResult[G]:
        """Generate, filter and refill until ``target_groups`` are kept or a cap is hit (then warn)."""
        result: DynamicSamplingResult[G] = DynamicSamplingResult(groups=[], target_groups=self.target_groups)
        n_kept_total = 0  # groups with signal seen, surplus included (for the keep-rate estimate)
        rounds_allowed = self.max_rounds if self.enabled else 1
        while len(result.groups) < self.target_groups:
            if result.n_rounds >= rounds_allowed:
                result.cap_reason = f"max_rounds={self.max_rounds}"
                break
            request = self._next_request(self.target_groups - len(result.groups), result.n_prompts, n_kept_total)
            if request <= 0:
                result.cap_reason = f"max_prompts={self.prompt_budget}"
                break
            groups = list(generate(request))
            result.n_rounds += 1
            if len(groups) > request:
                raise ValueError(
                    f"generate({request}) returned {len(groups)} groups; it must return at most one group per "
                    "requested prompt (the prompt budget and the data cursor depend on it)"
                )
            result.n_prompts += len(groups)
            for group in groups:
                signal = has_signal(self.rewards_of(group))
                if not signal:
                    result.n_no_signal += 1
                    if self.enabled:
                        result.n_dropped += 1
                        continue
                n_kept_total += 1
                if len(result.groups) < self.target_groups:
                    result.groups.append(group)
                else:
                    result.n_surplus += 1
            if not groups:
                result.cap_reason = "data exhausted (generate returned no groups)"
                break
            if len(groups) < request and len(result.groups) < self.target_groups:
                result.cap_reason = f"data exhausted (generate returned {len(groups)} of {request} prompts)"
                break
        if len(result.groups) < self.target_groups:  # when disabled, only running out of data gets here
            result.capped = True
            self._warn(result)
        return result

    def _warn(self, r: DynamicSamplingResult[G]) -> None:
        kept = len(r.groups)
        consequence = (
            "no group has a learning signal: skip this optimizer step"
            if kept == 0
            else f"training this step on {kept} groups"
        )
        warnings.warn(
            f"dynamic sampling stopped at {r.cap_reason}: kept {kept} of {self.target_groups} groups after "
            f"{r.n_rounds} rounds and {r.n_prompts} prompts ({r.n_dropped} groups dropped because all their "
            f"rewards were equal); {consequence}. To fill the batch raise max_rounds (now {self.max_rounds}) or "
            f"max_prompts (now {self.prompt_budget}); if most groups are dropped the prompts are too hard or "
            "too easy for the model (check rollout/raw_reward and the reward function).",
            DynamicSamplingWarning,
            stacklevel=2,
        )
