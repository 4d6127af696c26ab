"""Pins rl.stats: logprob-difference summaries and the drift test behind "no upward drift".

Percentiles are checked against numpy, the OLS slope and its standard error against
numpy.polyfit, and the t-distribution p-value (written without scipy) against closed forms.
A flat noisy series must not read as drifting up and a rising one must. CPU only, < 1 s.
"""

from __future__ import annotations

import doctest
import math

import numpy as np
import pytest
import torch

import rl.stats
from rl.stats import (
    abs_diff_stats,
    by_position,
    drift,
    drifting_up,
    linear_fit,
    moving_average,
    quantile,
    student_t_two_sided_p,
)

NUM_GPUS = 0


def test_docstring_examples_run() -> None:
    result = doctest.testmod(rl.stats, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0


# --------------------------------------------------------------------------- per-token differences


def test_abs_diff_stats_known_array() -> None:
    a = torch.arange(101, dtype=torch.float32)  # |diff| = 0..100
    stats = abs_diff_stats(a, torch.zeros(101))
    assert stats == {"mean": 50.0, "p50": 50.0, "p99": 99.0, "max": 100.0}
    assert list(stats) == ["mean", "p50", "p99", "max"]


def test_abs_diff_stats_match_numpy_and_respect_mask() -> None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 50, generator=g), torch.randn(8, 50, generator=g)
    mask = torch.rand(8, 50, generator=g) > 0.25
    a[~mask] = float("nan")  # padding garbage must not matter
    stats = abs_diff_stats(a, b, mask)
    d = (a - b).abs()[mask].double().numpy()
    assert stats["mean"] == pytest.approx(d.mean())
    assert stats["p50"] == pytest.approx(np.percentile(d, 50))
    assert stats["p99"] == pytest.approx(np.percentile(d, 99))
    assert stats["max"] == pytest.approx(d.max())


@pytest.mark.parametrize("n", [1, 2, 7, 1000])
def test_quantile_matches_numpy(n: int) -> None:
    x = np.random.default_rng(n).normal(size=n)
    s = torch.sort(torch.from_numpy(x)).values
    for q in (0.0, 0.01, 0.5, 0.99, 1.0):
        assert quantile(s, q) == pytest.approx(np.quantile(x, q))


def test_abs_diff_stats_errors() -> None:
    with pytest.raises(ValueError, match="no unmasked tokens"):
        abs_diff_stats(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="1 of 2 unmasked tokens have a non-finite"):
        abs_diff_stats(torch.tensor([0.0, float("-inf")]), torch.zeros(2))
    with pytest.raises(ValueError, match="shapes differ"):
        abs_diff_stats(torch.zeros(3), torch.zeros(4))


def test_by_position_means_counts_and_buckets() -> None:
    a = torch.tensor([[1.0, 2.0, 3.0, 4.0, float("nan")], [3.0, 4.0, 0.0, 0.0, 0.0]])
    b = torch.zeros(2, 5)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    means, counts = by_position(a, b, mask, return_counts=True)
    torch.testing.assert_close(means[:4], torch.tensor([2.0, 3.0, 3.0, 4.0], dtype=torch.float64))
    assert math.isnan(float(means[4]))
    assert counts.tolist() == [2, 2, 1, 1, 0]
    pooled, pooled_counts = by_position(a, b, mask, bucket=2, return_counts=True)
    torch.testing.assert_close(pooled[:2], torch.tensor([10 / 4, 7 / 2], dtype=torch.float64))
    assert math.isnan(float(pooled[2])) and pooled_counts.tolist() == [4, 2, 0]
    with pytest.raises(ValueError, match="batch, position"):
        by_position(torch.zeros(3), torch.zeros(3))


def test_by_position_shows_growth_along_the_sequence() -> None:
    g = torch.Generator().manual_seed(1)
    diff = torch.rand(64, 32, generator=g) * torch.linspace(0.01, 0.2, 32)  # mismatch grows with position
    means = by_position(diff, torch.zeros_like(diff))
    fit = drift(np.arange(32), means.numpy())
    assert drifting_up(fit.slope, fit.stderr)


# --------------------------------------------------------------------------- drift


def test_drift_matches_numpy_polyfit() -> None:
    rng = np.random.default_rng(0)
    x = np.arange(0, 100, 1.0)
    y = 0.09 + 1e-4 * x + rng.normal(scale=0.01, size=x.size)
    fit = drift(x, y)
    (slope, intercept), cov = np.polyfit(x, y, 1, cov=True)
    assert fit.slope == pytest.approx(slope, rel=1e-9)
    assert fit.intercept == pytest.approx(intercept, rel=1e-9)
    assert fit.stderr == pytest.approx(math.sqrt(cov[0, 0]), rel=1e-9)
    assert fit.t == pytest.approx(slope / math.sqrt(cov[0, 0]))
    assert fit.n == 100
    slope_, stderr_, *_ = fit  # unpacks as (slope, stderr, t, p_value, intercept, n)
    assert (slope_, stderr_) == (fit.slope, fit.stderr)


def test_flat_noisy_series_is_not_drifting_up() -> None:
    flagged = 0
    for seed in range(50):
        rng = np.random.default_rng(seed)
        y = 0.09 + rng.normal(scale=0.01, size=100)
        fit = drift(np.arange(100), y)
        flagged += drifting_up(fit.slope, fit.stderr)
        assert 0.0 <= fit.p_value <= 1.0
    assert flagged <= 3  # one-sided 2-sigma: ~2.3% false positives expected


def test_rising_series_is_drifting_up_and_falling_is_not() -> None:
    rng = np.random.default_rng(7)
    steps = np.arange(100)
    noise = rng.normal(scale=0.01, size=100)
    rising = drift(steps, 0.09 + 3e-4 * steps + noise)  # +0.03 over 100 steps under 0.01 noise
    assert drifting_up(rising.slope, rising.stderr) and rising.p_value < 1e-6
    falling = drift(steps, 0.09 - 3e-4 * steps + noise)
    assert not drifting_up(falling.slope, falling.stderr)
    # a rise that is real but below the tolerance is not flagged
    assert not drifting_up(rising.slope, rising.stderr, min_slope=1e-3)


def test_drift_edge_cases() -> None:
    perfect = drift([0, 1, 2, 3], [1.0, 2.0, 3.0, 4.0])
    assert perfect.stderr == 0.0 and perfect.t == math.inf and perfect.p_value == 0.0
    flat = drift([0, 1, 2], [5.0, 5.0, 5.0])
    assert flat.slope == 0.0 and flat.t == 0.0 and flat.p_value == pytest.approx(1.0)
    with_gaps = drift([0, 1, 2, 3, 4], [1.0, float("nan"), 3.0, 4.0, 5.0])
    assert with_gaps.n == 4 and with_gaps.slope == pytest.approx(1.0)
    assert drift(torch.arange(5), torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0])).n == 5
    with pytest.raises(ValueError, match="at least 3 finite points"):
        drift([0, 1], [0.0, 1.0])
    with pytest.raises(ValueError, match="two distinct x"):
        drift([2, 2, 2], [0.0, 1.0, 2.0])
    with pytest.raises(ValueError, match="differ in length"):
        drift([0, 1, 2], [0.0, 1.0])


@pytest.mark.parametrize("t", [0.0, 0.3, 1.0, 2.5, 12.7062, 100.0])
def test_student_t_p_value_closed_forms(t: float) -> None:
    assert student_t_two_sided_p(t, 1) == pytest.approx(1 - 2 / math.pi * math.atan(t), abs=1e-12)
    assert student_t_two_sided_p(-t, 2) == pytest.approx(1 - t / math.sqrt(2 + t * t), abs=1e-12)


@pytest.mark.parametrize(
    ("t", "df"),
    [(12.706205, 1), (4.302653, 2), (2.570582, 5), (2.228139, 10), (2.042272, 30), (1.983972, 100)],
)
def test_student_t_p_value_critical_values(t: float, df: int) -> None:
    assert student_t_two_sided_p(t, df) == pytest.approx(0.05, abs=2e-6)


def test_student_t_large_df_is_normal() -> None:
    assert student_t_two_sided_p(1.959964, 1e6) == pytest.approx(0.05, abs=1e-5)
    assert student_t_two_sided_p(math.inf, 5) == 0.0 and math.isnan(student_t_two_sided_p(math.nan, 5))


# --------------------------------------------------------------------------- plot helpers


def test_moving_average() -> None:
    v = np.arange(10, dtype=float)
    out = moving_average(v, 3)
    np.testing.assert_allclose(out[2:], np.convolve(v, np.ones(3) / 3, mode="valid"))
    np.testing.assert_allclose(out[:2], [0.0, 0.5])
    np.testing.assert_array_equal(moving_average(v, 1), v)
    gaps = moving_average([1.0, float("nan"), 3.0, float("nan"), float("nan")], 2)
    np.testing.assert_allclose(gaps[:4], [1.0, 1.0, 3.0, 3.0])
    assert math.isnan(gaps[4])
    with pytest.raises(ValueError, match="window"):
        moving_average(v, 0)


def test_linear_fit() -> None:
    slope, intercept = linear_fit(np.arange(5), 2.5 * np.arange(5) - 1.0)
    assert slope == pytest.approx(2.5) and intercept == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="two distinct x"):
        linear_fit([1.0], [2.0])
