"""Boxed-answer math rewards (1.0 / 0.0) graded with math-verify, safe to call from threads.

What it does
    ``grade(response, label)`` takes the LAST ``\\boxed{...}`` (or ``\\fbox{...}``) in a model
    response with a brace-matching scan (nested braces such as ``\\boxed{\\frac{1}{2}}`` work),
    parses it and the gold label with math-verify and returns a :class:`Grade`
    ``(reward, reason, extracted, error)``. ``grade_batch`` grades many pairs and feeds a
    thread-safe :class:`RewardStats`; ``math_reward`` is the plain ``float`` form used as a
    reward function (the Miles ``math`` reward: boxed answer from the whole response).

Reasons (``Grade.reason``)
    ``correct`` (reward 1), ``wrong``, ``no_box``, ``unclosed_box`` (the last box is cut off,
    e.g. a truncated response), ``empty_box``, ``too_long`` (answer longer than
    ``MAX_ANSWER_CHARS``), ``too_complex`` (an answer whose value would take sympy minutes to
    evaluate, e.g. ``9^{9^{9}}``), ``not_literal`` (only with ``literal_only=True``: the
    answer is an expression, not a plain number), ``bad_label`` (the gold label is empty or
    cannot be parsed: a data problem) and ``error`` (math-verify raised: a grader bug).
    ``bad_label`` and ``error`` are counted in ``RewardStats.n_errors``, never as ``wrong``.

Behaviour pinned by tests/test_rewards.py
    ``\\frac{1}{2}`` = ``\\dfrac12`` = ``1/2`` = ``0.5``; ``1,000`` = ``1{,}000`` = ``1\\,000``
    = ``1 000`` = ``1000`` (space-grouped digits are joined here, math-verify alone reads
    ``1 000`` as ``1*0``); ``+5`` = ``5`` = ``5.`` = ``5.0``; ``\\left(1,2\\right)`` = ``(1,2)``;
    units in ``\\text{}`` after a number are dropped (``5\\text{ cm}`` = ``5``) and, as in
    math-verify, ``85\\%`` = ``85``; ``0.333`` != ``1/3`` (6-decimal rounding); ``5,6`` is a set.
    math-verify compares VALUES: ``\\boxed{47+38}`` is correct for ``85`` and it repairs
    dangling operators (``85+`` reads as ``85``). Tasks where restating the question would be
    a reward hack grade with ``literal_only=True`` (plain numbers only).

Thread safety and time limits
    math-verify's own timeout uses ``signal.alarm``, which raises off the main thread (Ray
    workers, thread pools) and cannot interrupt a long C-level big-integer operation anyway.
    We call ``parse(..., parsing_timeout=None)`` and ``verify(..., timeout_seconds=None)``
    (no signals: identical results on any thread) and bound the work instead: answers are
    at most ``MAX_ANSWER_CHARS`` characters, and parsed values whose powers, factorials or
    binomials would exceed ``MAX_DIGITS`` decimal digits are rejected as ``too_complex``
    before math-verify compares them. These guards cover the known hang patterns (huge
    powers, factorials, binomials); they are heuristics, not a hard wall-clock limit.
    ``RewardStats.max_seconds`` records the slowest grade so a new slow pattern is visible.

How to run
    >>> from rl.rewards import grade, math_reward
    >>> grade("so the answer is \\\\boxed{\\\\frac{1}{2}}", "0.5").reward
    1.0
    >>> math_reward("\\\\boxed{84}", "85")
    0.0
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import math_verify.grader
import math_verify.parser
import sympy
from math_verify import parse, verify

# We turn math-verify's signal timeouts off on purpose and bound the work ourselves (the module doc, "Thread safety
# and time limits"); its once-per-process "Timeout is disabled ... you must provide the logic for timeout
# interruption yourself" warning describes exactly that choice, so it is marked as already shown.
math_verify.parser.TIMEOUT_WARNING_SHOWN = True
math_verify.grader.TIMEOUT_WARNING_SHOWN = True

__all__ = [
    "MAX_ANSWER_CHARS",
    "MAX_DIGITS",
    "REASONS",
    "ERROR_REASONS",
    "Grade",
    "RewardStats",
    "extract_boxed",
    "grade",
    "grade_batch",
    "math_reward",
    "GraderError",
    "strict_math_reward",
]

MAX_ANSWER_CHARS = 256
"""Longest boxed answer (characters) that is handed to math-verify."""

MAX_DIGITS = 20_000
"""Largest number of decimal digits a power/factorial/binomial in an answer may have."""

REASONS = (
    "correct",
    "wrong",
    "no_box",
    "unclosed_box",
    "empty_box",
    "too_long",
    "too_complex",
    "not_literal",
    "bad_label",
    "error",
)
ERROR_REASONS = frozenset({"bad_label", "error"})

_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# Digits grouped by thin spaces / spaces (1\,000, 1\ 000, 1~000, 1 000), optional sign and decimals.
_SPACE_GROUPED = re.compile(r"[+-]?\d{1,3}(?:(?:\\[,;:! ]|~|\s)+\d{3})+(?:\.\d+)?")
_GROUP_SEPARATOR = re.compile(r"\\[,;:! ]|~|\s")
_INT_LITERAL = re.compile(r"\d+")
# A plain number: optional sign, digits (comma / {,} grouping allowed), optional decimals.
_NUMBER_LITERAL = re.compile(r"[+-]?(?:\d+(?:(?:,|\{,\})\d{3})*(?:\.\d*)?|\.\d+)")


@dataclass(frozen=True)
class Grade:
    """Result of grading one response: ``reward`` is 1.0 only when ``reason == "correct"``."""

    reward: float
    reason: str
    extracted: str | None
    error: str | None = None


# --------------------------------------------------------------------------- extraction


def extract_boxed(response: str) -> tuple[str | None, str | None]:
    """Return ``(content, None)`` of the last ``\\boxed``/``\\fbox``, or ``(None, reason)``.

    ``reason`` is ``"no_box"`` when the response has no box and ``"unclosed_box"`` when the last
    box never closes its brace. ``\\boxed 5`` (no braces) yields ``"5"`` (the token up to the next
    space or ``$``), as the Hendrycks/Miles extractor does.
    """
    matches = list(_BOX_COMMAND.finditer(response))
    if not matches:
        return None, "no_box"
    i = matches[-1].end()
    n = len(response)
    while i < n and response[i] in " \t\n":
        i += 1
    if i >= n:
        return None, "unclosed_box"
    if response[i] != "{":
        token = re.match(r"[^\s$]*", response[i:])
        content = token.group(0) if token else ""
        return (content, None) if content else (None, "no_box")
    depth = 0
    j = i
    while j < n:
        ch = response[j]
        if ch == "\\":  # an escaped character (\{, \}, \\) never opens or closes the box
            j += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return response[i + 1 : j], None
        j += 1
    return None, "unclosed_box"


# --------------------------------------------------------------------------- guards


def _normalize(answer: str) -> str:
    """Strip whitespace and join space-grouped digits (``1\\,000`` -> ``1000``)."""
    answer = answer.strip()
    if _SPACE_GROUPED.fullmatch(answer):
        answer = _GROUP_SEPARATOR.sub("", answer)
    return answer


def _raw_complexity_problem(answer: str) -> str | None:
    """Reject binomials that sympy would evaluate for minutes while *parsing*."""
    if "binom" in answer or "choose" in answer:
        literals = [int(m) for m in _INT_LITERAL.findall(answer)] or [0]
        if max(literals) > 100_000 or "^" in answer or "!" in answer:
            return "binomial with large arguments"
    return None


def _log10_size(expr: Any, memo: dict[int, float]) -> float:
    """Rough upper bound of log10(|value| + 1) of a sympy tree; ``inf`` when astronomically big.

    Raises ``OverflowError`` when a power, factorial or binomial node exceeds ``MAX_DIGITS``
    digits, because evaluating it is what makes sympy hang.
    """
    key = id(expr)
    if key in memo:
        return memo[key]
    if isinstance(expr, sympy.Integer):
        size = abs(int(expr)).bit_length() * math.log10(2)
    elif isinstance(expr, sympy.Rational):
        size = max(abs(expr.p).bit_length(), abs(expr.q).bit_length()) * math.log10(2)
    elif isinstance(expr, sympy.Float):
        _sign, mantissa, exponent2, bits = expr._mpf_  # value = mantissa * 2**exponent2
        size = abs(exponent2 + bits) * math.log10(2) if mantissa else 0.0
    elif isinstance(expr, sympy.Pow):
        base = _log10_size(expr.base, memo)
        exponent = _log10_size(expr.exp, memo)
        if base == 0:
            size = 0.0
        else:
            size = math.inf if exponent > 15 else base * 10**exponent
        if size > MAX_DIGITS:
            raise OverflowError(f"power with about 10^{exponent:.0f} in the exponent")
    elif isinstance(expr, (sympy.factorial, sympy.factorial2, sympy.binomial)):
        arg = max(_log10_size(a, memo) for a in expr.args)
        n = math.inf if arg > 15 else 10**arg
        size = n * math.log10(max(n, 2))
        if size > MAX_DIGITS:
            raise OverflowError(f"{type(expr).__name__} of a number near 10^{arg:.0f}")
    elif isinstance(expr, sympy.MatrixBase):
        size = max((_log10_size(a, memo) for a in expr), default=0.0)
    elif isinstance(expr, sympy.Basic) and expr.args:
        parts = [_log10_size(a, memo) for a in expr.args]
        size = sum(parts) if isinstance(expr, sympy.Mul) else max(parts) + 1
    else:
        size = 0.0
    memo[key] = size
    return size


def _parsed_complexity_problem(parsed: list[Any]) -> str | None:
    for item in parsed:
        if isinstance(item, str):
            continue
        try:
            _log10_size(item, {})
        except OverflowError as exc:
            return str(exc)
    return None


# --------------------------------------------------------------------------- grading


def _parse_math(text: str) -> list[Any]:
    """math-verify parse of one bare answer, no signal-based timeout, errors raised."""
    wrapped = text if ("$" in text or "\\boxed" in text) else f"${text}$"
    return parse(wrapped, parsing_timeout=None, raise_on_error=True)  # type: ignore[arg-type]


def _parse_label(label: str) -> tuple[list[Any] | None, str | None]:
    """Parse the gold label; ``(None, why)`` when it is unusable."""
    text = _normalize(str(label))
    if not text:
        return None, "empty label"
    if len(text) > MAX_ANSWER_CHARS:
        return None, f"label longer than {MAX_ANSWER_CHARS} characters"
    problem = _raw_complexity_problem(text)
    if problem:
        return None, f"label too complex to evaluate: {problem}"
    parsed = _parse_math(text)
    if not parsed:
        return None, f"math-verify cannot parse label {text!r}"
    problem = _parsed_complexity_problem(parsed)
    if problem:
        return None, f"label too complex to evaluate: {problem}"
    return parsed, None


def _describe(exc: BaseException) -> str:
    message = str(exc)
    if len(message) > 300:
        message = message[:300] + "..."
    return f"{type(exc).__name__}: {message}"


def grade(response: str, label: str, *, literal_only: bool = False) -> Grade:
    """Grade one response against its gold label; never raises for bad model output.

    math-verify compares values, so ``\\boxed{47+38}`` is correct for ``85``. With
    ``literal_only=True`` the boxed answer must be a plain number (``85``, ``-3``, ``1,000``,
    ``2.50``), anything else scores 0 with reason ``not_literal``: use it for tasks where
    restating the question is not an answer (the synthetic addition task).
    """
    extracted, missing = extract_boxed(response)
    if extracted is None:
        return Grade(0.0, missing or "no_box", None)
    answer = _normalize(extracted)
    if not answer:
        return Grade(0.0, "empty_box", extracted)
    if len(answer) > MAX_ANSWER_CHARS:
        return Grade(0.0, "too_long", extracted)
    if literal_only and not _NUMBER_LITERAL.fullmatch(answer):
        return Grade(0.0, "not_literal", extracted)
    problem = _raw_complexity_problem(answer)
    if problem:
        return Grade(0.0, "too_complex", extracted, None)
    try:
        gold, label_problem = _parse_label(label)
    except Exception as exc:  # noqa: BLE001 - grader failures are reported, not hidden
        why = f"math-verify failed on label {label!r}: {_describe(exc)}"
        return Grade(0.0, "error", extracted, why)
    if gold is None:
        return Grade(
            0.0,
            "bad_label",
            extracted,
            f"label {label!r}: {label_problem}; fix the dataset row's label",
        )
    try:
        pred = _parse_math(answer)
        if not pred:
            return Grade(0.0, "wrong", extracted)
        if _parsed_complexity_problem(pred):
            return Grade(0.0, "too_complex", extracted)
        ok = verify(gold, pred, timeout_seconds=None, raise_on_error=True)
    except Exception as exc:  # noqa: BLE001 - counted as an error, never as a wrong answer
        return Grade(0.0, "error", extracted, f"math-verify failed on {answer!r}: {_describe(exc)}")
    return Grade(1.0, "correct", extracted) if ok else Grade(0.0, "wrong", extracted)


def math_reward(response: str, label: str, *, literal_only: bool = False) -> float:
    """1.0 when the last boxed answer equals ``label``, else 0.0 (see :func:`grade`)."""
    return grade(response, label, literal_only=literal_only).reward


class GraderError(RuntimeError):
    """math-verify failed, or the gold label is unusable: not a wrong answer (see :func:`strict_math_reward`)."""


def strict_math_reward(response: str, label: str, *, literal_only: bool = False) -> float:
    """:func:`math_reward`, but a grade with reason ``error`` or ``bad_label`` raises :class:`GraderError`.

    The reward path of training and evaluation uses this form with :class:`rl.grading.Grader`, which
    scores such a sample 0, counts it in ``rollout/grader_errors`` and stops the run when too many fail:
    a broken grader or a broken label column never trains silently on zeros. Picklable through
    ``functools.partial(strict_math_reward, literal_only=True)`` (process-pool grading).
    """
    result = grade(response, label, literal_only=literal_only)
    if result.reason in ERROR_REASONS:
        raise GraderError(f"[{result.reason}] {result.error or 'no detail'}")
    return result.reward


# --------------------------------------------------------------------------- statistics


@dataclass
class RewardStats:
    """Thread-safe running counts over grades; ``record`` may be called from any thread."""

    n: int = 0
    n_correct: int = 0
    n_errors: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    first_errors: list[str] = field(default_factory=list)
    max_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, result: Grade, seconds: float = 0.0) -> None:
        """Add one grade (and how long it took)."""
        with self._lock:
            self.n += 1
            self.n_correct += result.reason == "correct"
            self.reasons[result.reason] = self.reasons.get(result.reason, 0) + 1
            if result.reason in ERROR_REASONS:
                self.n_errors += 1
                if len(self.first_errors) < 5:
                    self.first_errors.append(result.error or result.reason)
            self.max_seconds = max(self.max_seconds, seconds)

    @property
    def accuracy(self) -> float:
        """Fraction of graded responses that were correct (0.0 when nothing was graded)."""
        with self._lock:
            return self.n_correct / self.n if self.n else 0.0

    def as_dict(self) -> dict[str, Any]:
        """A plain snapshot (JSON-ready) of all counters."""
        with self._lock:
            return {
                "n": self.n,
                "n_correct": self.n_correct,
                "n_errors": self.n_errors,
                "accuracy": self.n_correct / self.n if self.n else 0.0,
                "reasons": dict(self.reasons),
                "first_errors": list(self.first_errors),
                "max_seconds": self.max_seconds,
            }


def grade_batch(
    responses: Sequence[str],
    labels: Sequence[str],
    stats: RewardStats | None = None,
    *,
    literal_only: bool = False,
) -> list[Grade]:
    """Grade ``responses[i]`` against ``labels[i]``; record each grade in ``stats`` if given."""
    if len(responses) != len(labels):
        raise ValueError(
            f"grade_batch: {len(responses)} responses but {len(labels)} labels; "
            "pass one label per response (repeat a prompt's label for each of its samples)"
        )
    grades = []
    for response, label in zip(responses, labels):
        start = time.perf_counter()
        result = grade(response, label, literal_only=literal_only)
        if stats is not None:
            stats.record(result, time.perf_counter() - start)
        grades.append(result)
    return grades
