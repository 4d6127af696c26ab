"""The nightly verdict on synthetic histories: a normal night passes, a pass@1 drop beyond the noise fails,
a drop within the noise of a small eval passes, too little history skips the pass@1 check (and says so),
and alignment over threshold or a rising logprob difference fail on their own.

    .venv/bin/python -m pytest tests/test_verdict.py -q
"""

from __future__ import annotations

from rl.verdict import nightly_verdict, same_preset

HISTORY = [{"pass@1": p} for p in (0.31, 0.29, 0.30, 0.32, 0.30)]


def _night(**kw) -> dict:
    base = {"align_mean": 0.01, "pass@1": 0.30, "n_problems": 200, "n_samples": 8,
            "diff_steps": list(range(1, 11)), "diff_values": [0.01 + 0.0005 * ((-1) ** i) for i in range(10)]}
    return {**base, **kw}


def test_normal_night_passes():
    v = nightly_verdict(_night(), HISTORY)
    assert v.passed and v.reasons == []
    assert v.checks["pass@1"]["status"] == "ok" and v.checks["drift"]["status"] == "ok"


def test_pass_at_1_regression_beyond_noise_fails():
    v = nightly_verdict(_night(**{"pass@1": 0.20}), HISTORY)
    assert not v.passed
    assert v.checks["pass@1"]["status"] == "fail" and "below the history band" in v.reasons[0]


def test_same_drop_on_a_tiny_eval_is_within_noise():
    v = nightly_verdict(_night(**{"pass@1": 0.20, "n_problems": 4, "n_samples": 2}), HISTORY)
    assert v.passed, v.reasons


def test_too_few_earlier_nights_skips_pass_at_1_and_says_so():
    v = nightly_verdict(_night(**{"pass@1": 0.01}), HISTORY[:2])
    assert v.passed
    assert v.checks["pass@1"] == {"status": "insufficient_history", "history": 2, "needed": 3}


def test_alignment_over_threshold_fails():
    v = nightly_verdict(_night(align_mean=0.2), HISTORY)
    assert not v.passed and v.reasons[0].startswith("alignment:")


def test_rising_logprob_difference_fails_as_drift():
    rising = [0.01 + 0.002 * i for i in range(10)]
    v = nightly_verdict(_night(diff_values=rising), HISTORY)
    assert not v.passed and v.checks["drift"]["status"] == "fail"


def test_missing_evaluation_fails_loudly():
    v = nightly_verdict(_night(**{"pass@1": None}), HISTORY)
    assert not v.passed and "no pass@1" in v.reasons[0]



def test_history_is_compared_per_preset():
    history = [{"pass@1": 0.3}, {"pass@1": 0.31, "preset": "tiny-cpu"}, {"pass@1": 0.05, "preset": "dsv4-flash-mi355x"}]
    assert same_preset(history, "tiny-cpu") == history[:2]  # records from before presets were recorded: tiny-cpu
    assert same_preset(history, "dsv4-flash-mi355x") == history[2:]


def test_each_landed_evaluation_is_checked_against_the_runs_earlier_ones() -> None:
    import doctest

    import rl.verdict
    from rl.verdict import evaluation_regression

    assert doctest.testmod(rl.verdict).failed == 0
    earlier = [{"step": 0, "pass@1": 0.29, "pass@1_stderr": 0.017}, {"step": 10, "pass@1": 0.45, "pass@1_stderr": 0.02}]
    drop = evaluation_regression({"step": 20, "pass@1": 0.36, "pass@1_stderr": 0.02}, earlier)
    assert drop["status"] == "regressed" and drop["best_step"] == 10 and abs(drop["drop"] - 0.09) < 1e-9
    assert evaluation_regression({"step": 20, "pass@1": 0.42, "pass@1_stderr": 0.02}, earlier)["status"] == "ok"
    # only earlier steps count (a resumed run may hold later files), and old records without a stderr say so
    assert evaluation_regression({"step": 0, "pass@1": 0.1, "pass@1_stderr": 0.01}, earlier)["status"] == "no_history"
    assert evaluation_regression({"step": 20, "pass@1": 0.1}, earlier)["status"] == "no_stderr"
