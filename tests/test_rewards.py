"""Golden tests for rl.rewards: boxed-answer extraction and math-verify grading, on any thread."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from rl import rewards
from rl.rewards import Grade, RewardStats, extract_boxed, grade, grade_batch, math_reward

# (response, label, expected reward, expected reason)
GOLDEN: list[tuple[str, str, float, str]] = [
    # plain integers (the synthetic task and DAPO)
    ("Compute 47+38. \\boxed{85}", "85", 1.0, "correct"),
    ("\\boxed{84}", "85", 0.0, "wrong"),
    ("\\boxed{ 85 }", "85", 1.0, "correct"),
    ("\\boxed{85}", " 85\n", 1.0, "correct"),
    ("\\boxed{+5}", "5", 1.0, "correct"),
    ("\\boxed{-5}", "5", 0.0, "wrong"),
    ("\\boxed{5.}", "5", 1.0, "correct"),
    ("\\boxed{5.0}", "5", 1.0, "correct"),
    ("\\boxed{05}", "5", 1.0, "correct"),
    # digit grouping
    ("\\boxed{1,000}", "1000", 1.0, "correct"),
    ("\\boxed{1000}", "1,000", 1.0, "correct"),
    ("\\boxed{1{,}000}", "1000", 1.0, "correct"),
    ("\\boxed{1\\,000}", "1000", 1.0, "correct"),
    ("\\boxed{1 000}", "1000", 1.0, "correct"),
    ("\\boxed{1,000,000}", "1000000", 1.0, "correct"),
    ("\\boxed{5,6}", "5", 0.0, "wrong"),  # a set {5, 6}, not 56
    # fractions and decimals
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0, "correct"),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0, "correct"),
    ("\\boxed{1/2}", "\\frac12", 1.0, "correct"),
    ("\\boxed{\\dfrac{1}{2}}", "1/2", 1.0, "correct"),
    ("\\boxed{\\tfrac{3}{4}}", "0.75", 1.0, "correct"),
    ("\\boxed{0.333}", "\\frac{1}{3}", 0.0, "wrong"),
    ("\\boxed{\\frac{17}{2}}", "8.5", 1.0, "correct"),
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0, "wrong"),
    # LaTeX forms
    ("\\boxed{\\left(1,2\\right)}", "(1,2)", 1.0, "correct"),
    ("\\boxed{\\sqrt{18}}", "3\\sqrt{2}", 1.0, "correct"),
    ("\\boxed{2\\pi}", "\\pi*2", 1.0, "correct"),
    ("\\boxed{\\{2,1\\}}", "\\{1,2\\}", 1.0, "correct"),
    ("\\boxed{x=5}", "5", 1.0, "correct"),
    ("\\boxed{5\\text{ cm}}", "5", 1.0, "correct"),
    ("\\boxed{\\text{5 apples}}", "5", 0.0, "wrong"),
    ("\\boxed{85\\%}", "85", 1.0, "correct"),  # math-verify's percent leniency
    ("\\boxed{\\mathbf{85}}", "85", 1.0, "correct"),
    ("\\boxed{10^{100}}", "10^{100}", 1.0, "correct"),
    ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0, "correct"),
    # nested braces, several boxes, \fbox, spacing
    ("\\boxed{\\frac{\\sqrt{4}}{4}}", "1/2", 1.0, "correct"),
    ("first \\boxed{3}, then \\boxed{85}", "85", 1.0, "correct"),
    ("first \\boxed{85}, then \\boxed{3}", "85", 0.0, "wrong"),
    ("\\fbox{85}", "85", 1.0, "correct"),
    ("\\boxed{85} and finally \\fbox{7}", "7", 1.0, "correct"),
    ("\\boxed {85}", "85", 1.0, "correct"),
    ("\\boxed 85", "85", 1.0, "correct"),
    ("The answer is $\\boxed{\\frac{1}{2}}$.", "0.5", 1.0, "correct"),
    # no / broken boxes
    ("The answer is 85.", "85", 0.0, "no_box"),
    ("", "85", 0.0, "no_box"),
    ("\\boxedx{85}", "85", 0.0, "no_box"),
    ("truncated \\boxed{8", "85", 0.0, "unclosed_box"),
    ("\\boxed{85} then truncated \\boxed{\\frac{1}{2}", "85", 0.0, "unclosed_box"),
    ("\\boxed{}", "85", 0.0, "empty_box"),
    # math-verify compares values and repairs dangling operators (see literal_only below)
    ("\\boxed{47+38}", "85", 1.0, "correct"),
    ("\\boxed{85+}", "85", 1.0, "correct"),
    ("\\boxed{\\frac{170}{2}}", "85", 1.0, "correct"),
    ("\\boxed{8 5}", "85", 0.0, "wrong"),
    # bounded work: would hang sympy for minutes without the guards
    ("\\boxed{9^{9^{9}}}", "85", 0.0, "too_complex"),
    ("\\boxed{10000000!}", "85", 0.0, "too_complex"),
    ("\\boxed{\\binom{1000000}{500000}}", "85", 0.0, "too_complex"),
    ("\\boxed{" + "1" * 300 + "}", "85", 0.0, "too_long"),
    # bad gold labels are data errors, not wrong answers
    ("\\boxed{85}", "", 0.0, "bad_label"),
]


def _key(grades: list[Grade]) -> list[tuple[float, str, str | None]]:
    return [(g.reward, g.reason, g.extracted) for g in grades]


@pytest.mark.parametrize(("response", "label", "reward", "reason"), GOLDEN)
def test_golden_case(response: str, label: str, reward: float, reason: str) -> None:
    result = grade(response, label)
    assert (result.reward, result.reason) == (reward, reason), result
    assert math_reward(response, label) == reward


def test_golden_set_is_large_enough() -> None:
    assert len(GOLDEN) >= 30
    assert {reason for *_, reason in GOLDEN} >= {"correct", "wrong", "no_box", "too_complex"}


def test_same_results_on_main_thread_and_in_thread_pool() -> None:
    responses = [r for r, *_ in GOLDEN]
    labels = [label for _, label, *_ in GOLDEN]
    assert threading.current_thread() is threading.main_thread()
    on_main = grade_batch(responses, labels)

    def worker() -> list[Grade]:
        assert threading.current_thread() is not threading.main_thread()
        return grade_batch(responses, labels)

    with ThreadPoolExecutor(max_workers=1) as pool:
        in_worker = pool.submit(worker).result(timeout=60)
    assert _key(in_worker) == _key(on_main)

    # Many threads at once, sharing one stats object: same grades, exact counts.
    stats = RewardStats()
    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(grade_batch, responses, labels, stats) for _ in range(4)]
        concurrent = [f.result(timeout=120) for f in futures]
    for result in concurrent:
        assert _key(result) == _key(on_main)
    n_correct = sum(g.reason == "correct" for g in on_main)
    assert stats.n == 4 * len(GOLDEN)
    assert stats.n_correct == 4 * n_correct
    assert sum(stats.reasons.values()) == stats.n


def test_injected_grader_error_is_counted_not_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_verify(*args: object, **kwargs: object) -> bool:
        raise RuntimeError("sympy exploded")

    monkeypatch.setattr(rewards, "verify", broken_verify)
    stats = RewardStats()
    grades = grade_batch(["\\boxed{85}", "no box here"], ["85", "85"], stats)
    assert grades[0].reason == "error"
    assert grades[0].reward == 0.0
    assert grades[0].error is not None and "RuntimeError: sympy exploded" in grades[0].error
    assert grades[1].reason == "no_box"  # never reaches the grader
    assert stats.n_errors == 1
    assert stats.reasons == {"error": 1, "no_box": 1}
    assert stats.reasons.get("wrong", 0) == 0
    assert "sympy exploded" in stats.first_errors[0]


def test_injected_error_from_thread_pool_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_parse(*args: object, **kwargs: object) -> list[object]:
        raise ValueError("parser bug")

    monkeypatch.setattr(rewards, "parse", broken_parse)
    stats = RewardStats()
    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(lambda _: grade_batch(["\\boxed{1}"], ["1"], stats), range(8)))
    # The parser raising on the label is a grader failure too: reason "error", not "wrong".
    assert stats.n == 8 and stats.n_errors == 8 and stats.n_correct == 0
    assert stats.reasons == {"error": 8}
    assert "parser bug" in stats.first_errors[0]


def test_bad_label_is_an_error_with_a_hint() -> None:
    stats = RewardStats()
    (result,) = grade_batch(["\\boxed{85}"], [""], stats)
    assert result.reason == "bad_label"
    assert result.error is not None and "label" in result.error
    assert stats.n_errors == 1


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        ("85", "correct"),
        ("+85", "correct"),
        ("85.0", "correct"),
        ("47+38", "not_literal"),
        ("85+", "not_literal"),
        ("\\frac{170}{2}", "not_literal"),
        ("84", "wrong"),
    ],
)
def test_literal_only_rejects_expressions(answer: str, reason: str) -> None:
    result = grade("\\boxed{" + answer + "}", "85", literal_only=True)
    assert result.reason == reason
    assert math_reward("\\boxed{" + answer + "}", "85", literal_only=True) == result.reward
    assert grade_batch(["\\boxed{1,000}"], ["1000"], literal_only=True)[0].reason == "correct"


def test_extract_boxed() -> None:
    assert extract_boxed("\\boxed{\\frac{1}{2}}") == ("\\frac{1}{2}", None)
    assert extract_boxed("a \\boxed{1} b \\fbox{2}") == ("2", None)
    assert extract_boxed("\\boxed{\\{1\\}}") == ("\\{1\\}", None)
    assert extract_boxed("nothing") == (None, "no_box")
    assert extract_boxed("\\boxed{\\frac{1}{2}") == (None, "unclosed_box")


def test_grade_batch_length_mismatch() -> None:
    with pytest.raises(ValueError, match="2 responses but 1 labels"):
        grade_batch(["a", "b"], ["1"])


def test_stats_snapshot() -> None:
    stats = RewardStats()
    grade_batch(["\\boxed{1}", "\\boxed{2}", "x"], ["1", "1", "1"], stats)
    snap = stats.as_dict()
    assert snap["n"] == 3 and snap["n_correct"] == 1 and snap["n_errors"] == 0
    assert snap["reasons"] == {"correct": 1, "wrong": 1, "no_box": 1}
    assert stats.accuracy == pytest.approx(1 / 3)
    assert snap["max_seconds"] >= 0.0
