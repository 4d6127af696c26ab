"""Which reward scores a dataset: a built-in grader by name, or the user's own function by import path.

What it does
    A run names its reward with one string (``TrainRunConfig.reward`` / ``eval_reward``, ``v4rl train --reward``,
    the flow parameters ``reward`` / ``eval_reward`` in the Prefect form):

    ``auto``              per dataset: ``literal`` for the synthetic addition task, ``math-verify`` for a data file
    ``literal``           the last ``\\boxed{}`` must be a plain number equal to the label (the synthetic task, where
                          restating ``47+38`` is not an answer)
    ``math-verify``       the last ``\\boxed{}`` equals the label under math-verify (``\\frac12`` = ``0.5``,
                          ``1,000`` = ``1000``); Miles' ``--rm-type math`` agrees except that it refuses an
                          unevaluated expression for an integer label (``47+38`` for ``85``) and an unreduced
                          fraction (tests/conformance/test_miles_reward_and_data.py)
    ``module:function``   the user's reward function (contract below), imported by path in every process that
                          grades (the training driver, each process-pool worker, the Prefect evaluation task)

    ``check_reward_spec(spec, what="reward")`` validates the string (for an import path: the module imports, the
    attribute is a function, its signature takes the contract's keywords) and raises :class:`RewardSpecError`
    naming the setting and the fix. ``resolve_reward(spec, data_file)`` turns it into a :class:`RewardChoice`
    whose ``grader(...)`` is an :class:`rl.grading.Grader`: a sample whose reward raises, returns NaN, None or a
    non-number scores 0 and is counted in ``rollout/grader_errors`` like any grader failure.
    ``check_reward(choice, prompt, label)`` runs a built-in's golden cases, or calls a user's function once on a
    well-formed sample (preflight and the start of ``run_training``), raising :class:`RewardCheckFailed`.

The reward-function contract (TRL's ``reward_funcs``, keyword arguments)
    ``reward(prompts: list[str], completions: list[str], label: list[str], **kwargs) -> list[float]``: one reward
    per completion. ``prompts`` is each prompt as the model saw it (its tokens decoded; for a message-list prompt,
    the last user message), ``completions`` the generated texts (plain strings, also for message-list data) and
    ``label`` the gold answers from the data file's ``label`` column (strings; integer labels arrive as
    ``"34"``). v4rl calls it with one sample per call, so a failure scores only that sample. ``async def`` works
    too. A TRL reward function that takes these names works unchanged; one that reads another dataset column
    (TRL's ``accuracy_reward(completions, solution, **kwargs)``) plugs in through a two-line wrapper:

    >>> def ends_with_label(prompts, completions, label, **kwargs):
    ...     return [1.0 if c.strip().endswith(a) else 0.0 for c, a in zip(completions, label)]
    >>> def trl_style(completions, solution, **kwargs):          # a TRL reward for a "solution" column
    ...     return [float(a in c) for c, a in zip(completions, solution)]
    >>> def wrapped(prompts, completions, label, **kwargs):     # what you point --reward at
    ...     return trl_style(completions, solution=label)
    >>> call_reward_function(ends_with_label, "6 times 7 is 42", "42", prompt="What is 6*7?")
    1.0
    >>> call_reward_function(wrapped, "so 41", "42", prompt="What is 6*7?")
    0.0
    >>> check_signature(trl_style, "reward", "my_rewards:trl_style")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    rl.reward_spec.RewardSpecError: reward='my_rewards:trl_style': ...(missing a required argument: 'solution')...

How to run
    v4rl train --out runs/dapo --train-data dapo.jsonl                          # math-verify (auto)
    PYTHONPATH=. v4rl train --out runs/mine --train-data dapo.jsonl --reward my_rewards:score
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["AUTO", "BUILTIN_REWARDS", "GOLDEN_CASES", "RewardSpecError", "RewardCheckFailed", "RewardChoice",
           "ImportedReward", "check_reward_spec", "check_signature", "load_reward_function", "call_reward_function",
           "resolve_reward", "check_reward"]

AUTO = "auto"
BUILTIN_REWARDS = ("literal", "math-verify")
"""Built-in graders (rl/rewards.py); with ``auto`` the names a reward setting accepts besides an import path."""

GOLDEN_CASES: dict[str, tuple[tuple[str, str, float], ...]] = {
    "literal": (("\\boxed{85}", "85", 1.0), ("The answer is \\boxed{85}.", "85", 1.0), ("\\boxed{84}", "85", 0.0),
                ("85", "85", 0.0), ("\\boxed{1,000}", "1000", 1.0), ("\\boxed{47+38}", "85", 0.0)),
    "math-verify": (("\\boxed{85}", "85", 1.0), ("The answer is \\boxed{85}.", "85", 1.0), ("\\boxed{84}", "85", 0.0),
                    ("85", "85", 0.0), ("\\boxed{\\frac{1}{2}}", "0.5", 1.0), ("\\boxed{47+38}", "85", 1.0)),
}
"""(response, label, expected reward) per built-in grader: preflight refuses a grader that misgrades one."""

CONTRACT = "reward(prompts: list[str], completions: list[str], label: list[str], **kwargs) -> list[float]"
_CALL_KEYWORDS = ("prompts", "completions", "label")


class RewardSpecError(ValueError):
    """A reward setting names no grader, or an import path that does not resolve to a usable function."""


class RewardCheckFailed(ValueError):
    """A grader misgrades its golden cases, or a user's reward function fails on a well-formed sample."""


# --------------------------------------------------------------------------- the spec string


def check_reward_spec(spec: str, what: str = "reward") -> str:
    """The spec with surrounding space removed; raises RewardSpecError naming ``what`` and the fix."""
    text = (spec or "").strip()
    if text == AUTO or text in BUILTIN_REWARDS:
        return text
    if ":" not in text:
        raise RewardSpecError(
            f"{what}={spec!r} is neither a grader nor an import path; use {AUTO} (literal for the synthetic task, "
            f"math-verify for a data file), {' or '.join(BUILTIN_REWARDS)}, or package.module:function for your "
            f"own reward function ({CONTRACT})")
    load_reward_function(text, what)
    return text


@functools.lru_cache(maxsize=None)  # per process: every sample a worker grades would otherwise re-resolve it
def load_reward_function(path: str, what: str = "reward") -> Callable[..., Any]:
    """The function at ``package.module:function`` (``function`` may be dotted), its signature checked."""
    fn = _import(path, what)
    check_signature(fn, what, path)
    return fn


def _import(path: str, what: str) -> Callable[..., Any]:
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute or ":" in attribute:
        raise RewardSpecError(f"{what}={path!r} must look like package.module:function (one colon, both sides "
                              "non-empty)")
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise RewardSpecError(
                f"{what}={path!r}: no module named {exc.name!r} on sys.path; put the folder holding it on "
                "PYTHONPATH (e.g. PYTHONPATH=. v4rl train ...; the training driver, its grading processes and the "
                "Prefect worker all import it) or install its package") from None
        raise RewardSpecError(f"{what}={path!r}: importing {module_name!r} failed ({exc}); install what it "
                              "imports") from exc
    except Exception as exc:
        raise RewardSpecError(f"{what}={path!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}; "
                              "fix the module") from exc
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise RewardSpecError(f"{what}={path!r}: {getattr(target, '__name__', target)!r} has no attribute "
                                  f"{part!r}; check the function name after the colon")
        target = getattr(target, part)
    if inspect.isclass(target) or not callable(target):
        raise RewardSpecError(f"{what}={path!r} is a {type(target).__name__}, not a function; point it at a "
                              f"function (or callable instance) with the signature {CONTRACT}")
    return target


def check_signature(fn: Callable[..., Any], what: str, path: str) -> None:
    """Raise RewardSpecError unless ``fn(prompts=..., completions=..., label=...)`` binds."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C callable without a signature: its first call tells (a counted grader error)
    try:
        signature.bind(**{name: [] for name in _CALL_KEYWORDS})
    except TypeError as exc:
        raise RewardSpecError(
            f"{what}={path!r}: {getattr(fn, '__name__', 'the function')}{signature} cannot be called with the "
            f"keywords v4rl passes ({exc}). The contract is {CONTRACT}: accept prompts, completions and label "
            "(lists, one entry per sample) and **kwargs, or wrap a function that reads other columns "
            "(see rl/reward_spec.py)") from None


# --------------------------------------------------------------------------- calling a user's function


def call_reward_function(fn: Callable[..., Any], response: str, label: str, prompt: str) -> Any:
    """One sample through the contract: ``fn(prompts=[prompt], completions=[response], label=[label])[0]``.

    Raises rl.grading.BadRewardValue when the result is not one reward (the Grader counts it as a failure, reported
    as what was returned, not as raised); the value itself is checked by the Grader (a finite number)."""
    from rl.grading import BadRewardValue

    out = fn(prompts=[prompt], completions=[response], label=[label])
    if inspect.isawaitable(out):
        out = asyncio.run(_awaited(out))
    if isinstance(out, (str, bytes)) or not hasattr(out, "__len__"):
        kind = type(out).__name__
        raise BadRewardValue(f"returned {kind} instead of a list",
                             f"the reward function returned {kind} {out!r:.60}, expected a list with one number per "
                             f"completion (the contract: {CONTRACT})")
    if len(out) != 1:
        raise BadRewardValue("returned a list of another length",
                             f"the reward function returned {len(out)} rewards for 1 completion, expected 1")
    return out[0]


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


@dataclass(frozen=True)
class ImportedReward:
    """A user's reward function as a per-sample grader ``(response, label, prompt) -> reward``.

    Pickles as its import path alone, so process-pool workers import the function themselves."""

    path: str

    def __call__(self, response: str, label: str, prompt: str) -> Any:
        return call_reward_function(load_reward_function(self.path), response, label, prompt)


# --------------------------------------------------------------------------- resolving and checking


@dataclass(frozen=True)
class RewardChoice:
    """The reward of one dataset: its name and the per-sample function a Grader calls."""

    name: str
    """literal, math-verify or the import path."""
    fn: Callable[..., Any]
    """``fn(response, label)``, or ``fn(response, label, prompt)`` when ``takes_prompt``."""
    takes_prompt: bool = False

    def grader(self, **kwargs: Any):
        """An rl.grading.Grader around this reward (kwargs: max_error_ratio, workers, pool)."""
        from rl.grading import Grader

        return Grader(self.fn, takes_prompt=self.takes_prompt, **kwargs)


def resolve_reward(spec: str, data_file: str = "", what: str = "reward") -> RewardChoice:
    """The reward for a dataset: ``auto`` is literal for the synthetic task (no ``data_file``), math-verify for a
    file; a built-in name or an import path is used as given."""
    name = check_reward_spec(spec, what)
    if name == AUTO:
        name = "math-verify" if data_file else "literal"
    if name in BUILTIN_REWARDS:
        from rl import rewards  # looked up now, not at import: tests substitute rl.rewards.strict_math_reward

        return RewardChoice(name, functools.partial(rewards.strict_math_reward, literal_only=name == "literal"))
    return RewardChoice(name, ImportedReward(name), takes_prompt=True)


def check_reward(choice: RewardChoice, prompt: str, label: str, what: str = "reward") -> int:
    """A built-in grades its GOLDEN_CASES right; a user's function returns a finite number for ``prompt`` answered
    with ``\\boxed{label}``. Returns the number of cases checked; raises RewardCheckFailed naming ``what``."""
    if choice.takes_prompt:
        cases: tuple[tuple[str, str, float | None], ...] = ((f"\\boxed{{{label}}}", label, None),)
    else:
        cases = GOLDEN_CASES[choice.name]
    with choice.grader(max_error_ratio=1.0) as grader:  # failures are judged here, with this check's own message
        result = grader.grade([response for response, _, _ in cases], [gold for _, gold, _ in cases],
                              where=f"{what} check", prompts=[prompt] * len(cases) if choice.takes_prompt else None)
    if result.errors:
        response, gold, _ = cases[0]
        raise RewardCheckFailed(
            f"{what}={choice.name} failed on a well-formed sample (completion {response!r}, label {gold!r}, prompt "
            f"{prompt[:80]!r}): {result.first_error}; fix the function (contract: {CONTRACT})")
    wrong = [(response, gold, want, got) for (response, gold, want), got in zip(cases, result.rewards)
             if want is not None and got != want]
    if wrong:
        raise RewardCheckFailed(f"{what}={choice.name} misgrades its golden cases (response, label, expected, got): "
                                f"{wrong}; the grader (rl/rewards.py) or math-verify changed behaviour")
    return len(cases)
