"""The GRPO loop, written as the algorithm reads (DESIGN.md, data flow of `train`):

    for step in steps:
        prompts  = the step's prompts (a pure function of the step: resume never repeats or skips data)
        groups   = rollout.generate(prompts, n samples each)            # FP8 rollout engine
        rewards  = grade(groups)                                        # boxed-answer reward
        groups   = dynamic sampling (drop all-equal groups, over-sample to refill)
        samples  = group-normalised advantages
        metrics  = learner.train_step(samples)                          # BF16 GRPO + TIS
        sync     = learner.export() -> rollout.load_weights()           # re-quantize, update, fidelity gate
        log metrics; every eval_interval: evaluate; every save_interval: checkpoint

`run_grpo` is that loop. The engines come in as two small protocols (Rollout, Learner) and what the run does
around each step (stop requests, hang capture, the run log, the mismatch budget's rollback) as LoopHooks, so this
module knows nothing of Ray, HTTP or Prefect; engines/train/run.py implements them for the embedded engines.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from rl.dynamic_sampling import DynamicSampler, has_signal
from rl.grading import Grader, GradingResult
from rl.grpo import group_advantages
from rl.passk import mean_pass_at_k, pass_at_k_stderr


@dataclass
class Completion:
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    routed_experts: Any = None
    """The experts the rollout routed every token to (int32 [prompt + output - 1, layers, top_k]) when the run
    asked for them (routing replay); None otherwise."""


@dataclass
class Group:
    """The n samples of one prompt, graded."""

    prompt_index: int
    prompt_ids: list[int]
    label: str
    completions: list[Completion]
    rewards: list[float] = field(default_factory=list)


class Rollout(Protocol):
    def generate(self, prompts: Sequence[Sequence[int]], *, n: int, temperature: float, max_new_tokens: int,
                 seed: int) -> list[list[Completion]]: ...

    def load_weights(self, path: str, version: str) -> dict[str, Any]: ...


class Learner(Protocol):
    def train_step(self, groups: list[Group], advantages: list[list[float]]) -> dict[str, float]: ...

    def export(self, path: str) -> None: ...

    def save(self, step: int) -> None:
        """Checkpoint weights, optimizer, RNG and the data cursor (= step), so a resumed run goes on after it."""
        ...


class LoopHooks(Protocol):
    """What a run does around the algorithm; each hook may raise to end the run."""

    def check_stop(self, step: int) -> None:
        """Raise when the run was asked to stop (before `step` starts)."""
        ...

    def guard(self, step: int) -> AbstractContextManager[None]:
        """Wraps a step's generate, train and sync: turns a hung engine call into the run's error."""
        ...

    def graded(self, step: int, metrics: dict[str, float]) -> None:
        """The step's rollout is generated and graded (its reward-function failures can be recorded)."""
        ...

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Record the step's metrics (written before its evaluation, which lands separately)."""
        ...

    def log_eval(self, step: int, result: dict[str, Any]) -> None:
        """Record a held-out evaluation of the weights after `step` (0: before training)."""
        ...

    def step_done(self, step: int, metrics: dict[str, float]) -> int | None:
        """The step is trained, evaluated and saved; return a step to go back to (rollback) or None to go on."""
        ...


@dataclass(kw_only=True)
class LoopConfig:
    prompts_per_step: int = 128
    """Prompts (groups) trained on per step, after dynamic sampling."""
    n_samples: int = 8
    """Samples per prompt (the GRPO group)."""
    temperature: float = 1.0
    max_new_tokens: int = 8
    eval_interval: int = 10
    """Evaluate every this many steps (and at step 0 before training)."""
    eval_samples: int = 8
    seed: int = 0
    dynamic_sampling: bool = True
    """Drop groups whose rewards are all equal (no learning signal) and over-sample prompts to refill the batch
    (DAPO dynamic sampling; rl/dynamic_sampling.py)."""
    dynamic_sampling_max_rounds: int = 4
    """Generation rounds per step before dynamic sampling stops refilling, warns and trains on the groups it has."""
    normalize_std: bool = True
    """Divide group-centred rewards by the group std (GRPO); False: mean-centred only (Dr.GRPO)."""
    advantage_eps: float = 1e-6
    """Added to the group std before dividing (Miles' 1e-6; TRL's GRPOTrainer uses 1e-4). > 0."""

    def __post_init__(self) -> None:
        if isinstance(self.n_samples, bool) or not isinstance(self.n_samples, int) or self.n_samples < 2:
            raise ValueError(f"n_samples={self.n_samples!r}, but GRPO needs at least 2 samples per prompt: the group "
                             "mean is the baseline, so a group of one always has advantage 0 (and no std). Set "
                             "n_samples >= 2 (the seed uses 8).")
        if not self.advantage_eps > 0:
            raise ValueError(f"advantage_eps={self.advantage_eps} must be > 0: it keeps a group whose rewards are all "
                             "equal from dividing by a zero std. Use 1e-6 (Miles) or 1e-4 (TRL).")
        if self.dynamic_sampling_max_rounds < 1:
            raise ValueError(f"dynamic_sampling_max_rounds={self.dynamic_sampling_max_rounds} must be >= 1 (1 = "
                             "filter without refilling). Set dynamic_sampling=False to turn dynamic sampling off "
                             "instead.")


def prompts_for_step(step: int, n_rows: int, per_step: int, seed: int, offset: int = 0) -> list[int]:
    """Indices of the prompts for `step` (1-based): epochs are seeded shuffles, so a step's prompts are fixed.

    `offset` shifts the cursor (extra prompts consumed by dynamic-sampling refills are taken after the step's
    own, from a separate stream, so the base schedule never moves).
    """
    start = (step - 1) * per_step + offset
    out = []
    for pos in range(start, start + per_step):
        epoch, i = divmod(pos, n_rows)
        order = list(range(n_rows))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        out.append(order[i])
    return out


def should_run(step: int, interval: int, last_step: int) -> bool:
    """Periodic actions fire every `interval` steps and always at the final step."""
    return interval > 0 and (step % interval == 0 or step == last_step)


def grade_groups(groups: list[Group], decode: Callable[[list[int]], str],
                 reward_fn: Callable[[str, str], float] | None = None, *, grader: Grader | None = None,
                 where: str = "grading") -> GradingResult:
    """Set every group's rewards; a sample whose reward function fails scores 0 and is counted (rl/grading.py)."""
    grader = grader or Grader(_required(reward_fn))
    texts = [decode(c.output_ids) for g in groups for c in g.completions]
    labels = [g.label for g in groups for _ in g.completions]
    prompts = _prompt_texts([g.prompt_ids for g in groups], [len(g.completions) for g in groups], decode, grader)
    result = grader.grade(texts, labels, where=where, prompts=prompts)
    rewards = iter(result.rewards)
    for g in groups:
        g.rewards = [next(rewards) for _ in g.completions]
    return result


def _prompt_texts(prompt_ids: Sequence[Sequence[int]], samples: list[int], decode, grader: Grader) -> list[str] | None:
    """Each sample's prompt as the model saw it (decoded once per prompt), for a reward that takes prompts."""
    if not grader.takes_prompt:
        return None
    return [text for ids, n in zip(prompt_ids, samples) for text in [decode(list(ids))] * n]


def _required(reward_fn: Callable[[str, str], float] | None) -> Callable[[str, str], float]:
    if reward_fn is None:
        raise TypeError("pass reward_fn or grader")
    return reward_fn


def rollout_step(step: int, *, rollout: Rollout, prompts: list[list[int]], labels: list[str],
                 config: LoopConfig, decode, reward_fn=None,
                 grader: Grader | None = None) -> tuple[list[Group], dict[str, float]]:
    """Generate and grade the step's groups, refilled by dynamic sampling when enabled.

    Grading goes through `grader` (or a default Grader around `reward_fn`): failed samples score 0, are
    counted in rollout/grader_errors and rollout/grader_error_ratio, and too many stop the run (GraderFailed).
    """
    grader = grader or Grader(_required(reward_fn))
    n_rows = len(prompts)
    consumed = 0
    graded = {"n": 0, "errors": 0, "reward_sum": 0.0}

    def generate(k: int) -> list[Group]:
        nonlocal consumed
        idx = prompts_for_step(step, n_rows, k, config.seed + 17, offset=consumed) if consumed \
            else prompts_for_step(step, n_rows, k, config.seed)
        consumed += k
        outs = rollout.generate([prompts[i] for i in idx], n=config.n_samples, temperature=config.temperature,
                                max_new_tokens=config.max_new_tokens, seed=config.seed * 100_003 + step * 101 + consumed)
        groups = [Group(i, prompts[i], labels[i], o) for i, o in zip(idx, outs)]
        result = grade_groups(groups, decode, grader=grader, where=f"step {step} (rollout)")
        graded["n"] += result.n
        graded["errors"] += result.errors
        graded["reward_sum"] += sum(result.rewards)
        return groups

    start = time.monotonic()
    sampler = DynamicSampler(target_groups=config.prompts_per_step, enabled=config.dynamic_sampling,
                             max_rounds=config.dynamic_sampling_max_rounds, rewards_of=lambda g: g.rewards)
    result = sampler.sample(generate)
    groups = result.groups
    completions = [c for g in groups for c in g.completions]
    rewards = [r for g in groups for r in g.rewards]
    metrics = {
        # every group filtered by dynamic sampling: the mean over what was generated, not 0 for nothing
        "rollout/raw_reward": sum(rewards) / len(rewards) if rewards else graded["reward_sum"] / max(1, graded["n"]),
        "rollout/response_len/mean": sum(len(c.output_ids) for c in completions) / max(1, len(completions)),
        "rollout/truncated_ratio": sum(c.finish_reason == "length" for c in completions) / max(1, len(completions)),
        "rollout/grader_errors": float(graded["errors"]),
        "rollout/grader_error_ratio": graded["errors"] / max(1, graded["n"]),
        "perf/rollout_time": time.monotonic() - start,
        # 1.0: no group to train on has rewards that differ (all filtered, or all equal): the step cannot learn
        "rollout/no_learning_signal": float(not any(has_signal(g.rewards) for g in groups)),
        **result.metrics(),
    }
    return groups, metrics


def advantages_of(groups: list[Group], normalize_std: bool = True, eps: float = 1e-6) -> list[list[float]]:
    if not groups:
        return []
    n = len(groups[0].rewards)
    if any(len(g.rewards) != n for g in groups):
        raise ValueError("every group must hold the same number of samples")
    return group_advantages(torch.tensor([g.rewards for g in groups]), normalize_std=normalize_std, eps=eps).tolist()


def evaluate(rollout: Rollout, prompts: list[list[int]], labels: list[str], *, n: int, max_new_tokens: int,
             decode, reward_fn=None, seed: int, grader: Grader | None = None) -> dict[str, Any]:
    """Held-out pass@k (unbiased) at temperature 1 with a fixed seed, plus truncation, length and grader errors
    (a sample whose reward function fails counts as not correct; too many stop with GraderFailed)."""
    grader = grader or Grader(_required(reward_fn))
    outs = rollout.generate(prompts, n=n, temperature=1.0, max_new_tokens=max_new_tokens, seed=seed)
    completions = [c for group in outs for c in group]
    texts = _prompt_texts(prompts, [len(group) for group in outs], decode, grader)
    graded = grader.grade([decode(c.output_ids) for c in completions],
                          [label for group, label in zip(outs, labels) for _ in group], where="held-out evaluation",
                          prompts=texts)
    flat = iter(r > 0 for r in graded.rewards)
    correct = [[next(flat) for _ in group] for group in outs]
    result: dict[str, Any] = {f"pass@{k}": mean_pass_at_k(correct, k) for k in (1, 2, 4, 8) if k <= n}
    # the noise of each number over the problems (rl/passk.py): a change smaller than ~2 of these is not learning
    result.update({f"pass@{k}_stderr": pass_at_k_stderr(correct, k) for k in (1, 2, 4, 8) if k <= n})
    result.update(truncated_ratio=sum(c.finish_reason == "length" for c in completions) / len(completions),
                  response_len=sum(len(c.output_ids) for c in completions) / len(completions),
                  n_problems=len(prompts), n_samples=n, grader_errors=graded.errors)
    return result


def sync_weights(learner: Learner, rollout: Rollout, path: str, step: int) -> float:
    """Export the learner's weights to `path` and load them into the rollout engine; the seconds it took."""
    start = time.monotonic()
    learner.export(path)
    rollout.load_weights(path, version=f"step-{step}")
    return time.monotonic() - start


@dataclass
class TaskData:
    """The prompts (token ids) and labels a run trains on and evaluates on."""

    prompts: list[list[int]]
    labels: list[str]
    eval_prompts: list[list[int]]
    eval_labels: list[str]


def run_grpo(*, rollout: Rollout, learner: Learner, data: TaskData, config: LoopConfig, decode, grader: Grader,
             eval_grader: Grader, hooks: LoopHooks, weights_path: str, start: int, last: int, final_step: int,
             save_interval: int, evaluate_first: bool) -> None:
    """GRPO steps start+1 .. last (`final_step`: the run's last step, where evaluation always fires).

    `evaluate_first`: evaluate the starting weights as step 0. Every eval_interval steps (and at final_step) the
    held-out set is evaluated; every save_interval steps (and at `last`) the learner saves a checkpoint.
    """
    def held_out() -> dict[str, Any]:
        return evaluate(rollout, data.eval_prompts, data.eval_labels, n=config.eval_samples,
                        max_new_tokens=config.max_new_tokens, decode=decode, grader=eval_grader, seed=config.seed + 99)

    if evaluate_first:
        hooks.log_eval(0, held_out())
    step = start + 1
    while step <= last:
        hooks.check_stop(step)
        t0 = time.monotonic()
        with hooks.guard(step):
            # generate, reward, dynamic sampling
            groups, metrics = rollout_step(step, rollout=rollout, prompts=data.prompts, labels=data.labels,
                                           config=config, decode=decode, grader=grader)
            hooks.graded(step, metrics)
            t1 = time.monotonic()
            if groups:  # dynamic sampling may have filtered every group: then there is nothing to step on
                advantages = advantages_of(groups, config.normalize_std, config.advantage_eps)
                metrics.update(learner.train_step(groups, advantages))
            t2 = time.monotonic()
            metrics["perf/update_weights_time"] = sync_weights(learner, rollout, weights_path, step) if groups else 0.0
        metrics.update({"perf/train_time": t2 - t1, "perf/step_time": time.monotonic() - t0})
        hooks.log_metrics(step, metrics)
        if should_run(step, config.eval_interval, final_step):
            result = held_out()
            hooks.log_eval(step, result)
            metrics.update({f"eval/math/{k}": v for k, v in result.items() if k.startswith("pass@")})
        if should_run(step, save_interval, last):
            learner.save(step)
        back = hooks.step_done(step, metrics)
        step = step + 1 if back is None else back + 1
