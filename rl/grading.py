"""Grade many samples with a reward function that may fail, without ever training silently on zeros.

What it does
    ``Grader(reward_fn).grade(responses, labels, where="step 3")`` calls ``reward_fn(response, label)``
    for every pair (``reward_fn(response, label, prompt)`` with ``takes_prompt=True`` and ``prompts=``: how a
    user's reward function is called, rl/reward_spec.py). A call that raises (or returns NaN/inf, or something
    that is not a number) scores 0.0 for that sample and is counted; the first failure of each kind (an
    exception type, or what came back instead of a number) is logged once, saying which it was: "raised KeyError:
    ..." or "returned str 'x', expected a number", with where it happened. When the fraction of failed samples in one call exceeds
    ``max_error_ratio`` the call raises :class:`GraderFailed` naming where, how many failed, the first
    failure and the fix, so a broken grader stops the run instead of feeding it zero rewards.

    ``workers > 0`` grades in a thread pool (``pool="thread"``) or a process pool (``pool="process"``,
    spawn start method; ``reward_fn`` must then be picklable: a module-level function or a
    ``functools.partial`` of one). The exception is caught inside the worker and only
    ``(reward, (kind, error text))`` crosses the pool, so counts, rewards and the stop rule are the same in
    every mode. Metrics follow DESIGN.md: ``rollout/grader_errors`` (failed samples in the step) and
    ``rollout/grader_error_ratio``.

How to run
    >>> from rl.grading import Grader
    >>> with Grader(lambda text, label: float(text == label), max_error_ratio=0.5) as grader:
    ...     result = grader.grade(["1", "2"], ["1", "1"], where="example")
    >>> result.rewards, result.errors
    ([1.0, 0.0], 0)
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import numbers
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["Grader", "GraderFailed", "GradingResult", "BadRewardValue", "DEFAULT_MAX_ERROR_RATIO"]

DEFAULT_MAX_ERROR_RATIO = 0.25
"""Largest fraction of samples in one grading call whose reward function may fail before the run stops."""

log = logging.getLogger(__name__)


class BadRewardValue(ValueError):
    """The reward function returned something other than one finite number; ``kind`` names what (e.g.
    "returned str"), the message says what was expected. Reported as returned, never as raised."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class GraderFailed(ValueError):
    """Too many samples of one grading call failed in the reward function (a ValueError: a retry of the same
    step cannot fix a broken grader)."""


@dataclass(frozen=True)
class GradingResult:
    """Rewards in input order (0.0 where the reward function failed) and the failure counts of one call."""

    rewards: list[float]
    errors: int
    first_error: str | None = None

    @property
    def n(self) -> int:
        return len(self.rewards)

    @property
    def error_ratio(self) -> float:
        return self.errors / self.n if self.n else 0.0


Failure = tuple[str, str]
"""(kind, message) of one failed sample: kind "KeyError" or "returned str", message a sentence naming it."""


def _describe(exc: BaseException) -> Failure:
    if isinstance(exc, BadRewardValue):  # a value that came back, not an exception of the user's code
        return exc.kind, str(exc)
    message = " ".join(str(exc).split())
    if len(message) > 300:
        message = message[:300] + "..."
    kind = type(exc).__name__
    return kind, f"the reward function raised {kind}: {message}" if message else f"the reward function raised {kind}"


def returned_value_error(raw: object) -> BadRewardValue | None:
    """Why a reward function's return value is not one finite number (None when it is)."""
    # numbers.Real: numpy scalars count as numbers (np.float32 is no float subclass); bool does not
    if isinstance(raw, bool) or not isinstance(raw, numbers.Real):
        kind = "None" if raw is None else type(raw).__name__
        return BadRewardValue(f"returned {kind}", f"the reward function returned {kind}"
                              + ("" if raw is None else f" {raw!r:.60}") + ", expected a number")
    if not math.isfinite(float(raw)):
        return BadRewardValue("returned a non-finite number",
                              f"the reward function returned {float(raw)}, expected a finite number")
    return None


def _grade_one(reward_fn: Callable[..., float], sample: tuple[str, ...]) -> tuple[float, Failure | None]:
    """One sample ``(response, label[, prompt])``, never raising: (reward, None) or (0.0, (kind, message))."""
    try:
        raw = reward_fn(*sample)
    except Exception as exc:  # noqa: BLE001 - a failing grader is counted and reported, not fatal per sample
        return 0.0, _describe(exc)
    bad = returned_value_error(raw)
    if bad is not None:
        return 0.0, (bad.kind, str(bad))
    return float(raw), None


def _grade_chunk(reward_fn: Callable[..., float], samples: list[tuple[str, ...]]) -> list[tuple[float, Failure | None]]:
    return [_grade_one(reward_fn, sample) for sample in samples]


@dataclass
class Grader:
    """Counts, logs and caps reward-function failures; optionally grades in a thread or process pool."""

    reward_fn: Callable[..., float]
    """``reward_fn(response, label) -> float`` (``reward_fn(response, label, prompt)`` with ``takes_prompt``)."""
    max_error_ratio: float = DEFAULT_MAX_ERROR_RATIO
    """A grading call in which a larger fraction of samples fail raises GraderFailed (0 tolerates none,
    1.0 never stops)."""
    workers: int = 0
    """0: grade in the calling thread; N: grade in a pool of N workers."""
    pool: Literal["thread", "process"] = "thread"
    takes_prompt: bool = False
    """The reward function also takes the sample's prompt text: every grade() call must then pass prompts."""
    total: int = 0
    total_errors: int = 0
    first_error_by_type: dict[str, str] = field(default_factory=dict)
    """The first failure message of each kind (exception type, or "returned str" ...), in the order they appeared."""
    _executor: Executor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_error_ratio <= 1.0:
            raise ValueError(f"max_grader_error_ratio={self.max_error_ratio} must lie in [0, 1]: the fraction of "
                             "samples per step whose reward function may fail before the run stops")
        if self.workers < 0:
            raise ValueError(f"grader_workers={self.workers} must be >= 0 (0 grades in the calling thread)")
        if self.pool not in ("thread", "process"):
            raise ValueError(f"grader_pool={self.pool!r} must be 'thread' or 'process'")

    # -- grading ----------------------------------------------------------------------------------------

    def grade(self, responses: Sequence[str], labels: Sequence[str], *, where: str,
              prompts: Sequence[str] | None = None) -> GradingResult:
        """Rewards for ``responses[i]`` against ``labels[i]`` (and ``prompts[i]`` when the reward takes prompts);
        raises GraderFailed over the cap (see module doc)."""
        if len(responses) != len(labels):
            raise ValueError(f"{where}: {len(responses)} responses but {len(labels)} labels; pass one label per "
                             "response (repeat a prompt's label for each of its samples)")
        if self.takes_prompt and (prompts is None or len(prompts) != len(responses)):
            raise ValueError(f"{where}: the reward function takes prompts; pass one prompt per response "
                             f"(got {'none' if prompts is None else len(prompts)} for {len(responses)})")
        samples = list(zip(responses, labels, prompts)) if self.takes_prompt else list(zip(responses, labels))
        outcomes = self._run(samples)
        failures = [error for _, error in outcomes if error is not None]
        result = GradingResult([reward for reward, _ in outcomes], len(failures), failures[0][1] if failures else None)
        self.total += result.n
        self.total_errors += result.errors
        self._log_new_types(failures, result, where)
        self.check(result, where=where)
        return result

    def check(self, result: GradingResult, *, where: str) -> None:
        """Raise GraderFailed when ``result``'s failure fraction exceeds ``max_error_ratio``."""
        if result.errors and result.error_ratio > self.max_error_ratio:
            raise GraderFailed(
                f"{where}: the reward function failed on {result.errors} of {result.n} samples "
                f"({result.error_ratio:.0%}, over max_grader_error_ratio {self.max_error_ratio:.0%}); first failure: "
                f"{result.first_error}. Fix the reward function (or the labels it rejects), or raise "
                "max_grader_error_ratio to tolerate failures (failed samples score 0)")

    def _log_new_types(self, failures: list[Failure], result: GradingResult, where: str) -> None:
        for kind, error in failures:
            if kind in self.first_error_by_type:
                continue
            self.first_error_by_type[kind] = error
            log.warning("%s: %s (%d of %d samples failed in this call; they score 0 and are counted in "
                        "rollout/grader_errors); further failures of this kind (%s) are counted, not logged",
                        where, error, result.errors, result.n, kind)

    # -- execution --------------------------------------------------------------------------------------

    def _run(self, samples: list[tuple[str, ...]]) -> list[tuple[float, Failure | None]]:
        if self.workers == 0 or len(samples) <= 1:
            return _grade_chunk(self.reward_fn, samples)
        executor = self._pool()
        size = max(1, math.ceil(len(samples) / (self.workers * 4)))
        chunks = [samples[i:i + size] for i in range(0, len(samples), size)]
        futures = [executor.submit(_grade_chunk, self.reward_fn, chunk) for chunk in chunks]
        return [outcome for future in futures for outcome in future.result()]

    def _pool(self) -> Executor:
        if self._executor is None:
            if self.pool == "process":
                self._executor = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
            else:
                self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="v4rl-grader")
        return self._executor

    def close(self) -> None:
        """Stop the pool's workers (a no-op without a pool)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def __enter__(self) -> Grader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
