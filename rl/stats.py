"""Logprob-difference statistics and metric-series trends (pure torch / numpy, no scipy).

What it does
    Per-token comparisons of two engines' logprobs of the same tokens (rollout vs trainer,
    trainer vs reference): ``abs_diff_stats`` gives mean, median, p99 and max of
    ``|a - b|`` over the unmasked tokens (the ``token_abs_diff`` block of ``v4rl align`` and
    ``train/train_rollout_logprob_abs_diff``); ``by_position`` gives the mean per response
    position (does the mismatch grow along the sequence?).

    Over training steps: ``drift`` fits ``value = intercept + slope * step`` by ordinary least
    squares and returns the slope with its standard error, t statistic and two-sided p-value
    (Student t with n - 2 degrees of freedom); ``drifting_up`` says whether the slope is
    positive beyond ``z`` standard errors (the issue's "no upward drift" check).
    ``moving_average`` and ``linear_fit`` are for plots.

What it simplifies
    OLS assumes independent residuals; consecutive training steps are autocorrelated, so the
    standard error is optimistic. Use a generous ``z`` (the default 2) and, for noisy series,
    fit the moving average's trend only for display, never for the verdict.

How to run
    >>> import torch
    >>> from rl.stats import abs_diff_stats, drift, drifting_up
    >>> abs_diff_stats(torch.tensor([0.0, 1.0, 2.0]), torch.tensor([0.0, 0.0, 0.0]))
    {'mean': 1.0, 'p50': 1.0, 'p99': 1.98, 'max': 2.0}
    >>> fit = drift([0, 1, 2, 3, 4], [0.10, 0.11, 0.12, 0.14, 0.14])
    >>> round(fit.slope, 3), drifting_up(fit.slope, fit.stderr)
    (0.011, True)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "DriftFit",
    "abs_diff_stats",
    "by_position",
    "drift",
    "drifting_up",
    "linear_fit",
    "moving_average",
    "quantile",
    "student_t_two_sided_p",
]

ArrayLike = Sequence[float] | np.ndarray | Tensor


# --------------------------------------------------------------------------- per-token differences


def quantile(sorted_values: Tensor, q: float) -> float:
    """``q``-quantile of an ascending 1-D tensor, linear interpolation (numpy's default method).

    Works for any size (``torch.quantile`` refuses more than 2**24 elements).

    >>> quantile(torch.tensor([0.0, 1.0, 2.0, 3.0]), 0.5)
    1.5
    """
    n = sorted_values.numel()
    if n == 0:
        raise ValueError("quantile of an empty tensor")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q={q} must lie in [0, 1]")
    pos = q * (n - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    a, b = float(sorted_values[lo]), float(sorted_values[hi])
    return a + (b - a) * frac


def _abs_diff(a: Tensor, b: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """``|a - b|`` in float64 and the boolean mask (None when not given), shapes checked."""
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}; both must score the same tokens")
    d = (a.detach().double() - b.detach().double()).abs()
    if mask is not None:
        mask = torch.as_tensor(mask)
        if mask.shape != d.shape:
            raise ValueError(f"mask shape {tuple(mask.shape)} != logprobs shape {tuple(d.shape)}")
    return d, (None if mask is None else mask.to(torch.bool))


def abs_diff_stats(a: Tensor, b: Tensor, mask: Tensor | None = None) -> dict[str, float]:
    """``{"mean", "p50", "p99", "max"}`` of ``|a - b|`` over the unmasked tokens (float64 math).

    ``a`` and ``b`` are logprobs of the same tokens (any equal shapes). Raises ``ValueError``
    when no token is unmasked or a difference is not finite (an engine returned NaN/inf for a
    real token: a bug to surface, not to average away).

    >>> abs_diff_stats(torch.tensor([[0.0, 0.5], [3.0, 9.0]]), torch.zeros(2, 2), torch.tensor([[1, 1], [1, 0]]))
    {'mean': 1.1666666666666667, 'p50': 0.5, 'p99': 2.95, 'max': 3.0}
    """
    d, m = _abs_diff(a, b, mask)
    if m is not None:
        d = d[m]
    d = d.flatten()
    if d.numel() == 0:
        raise ValueError("no unmasked tokens to compare: check the response mask (is every response empty?)")
    if not torch.isfinite(d).all():
        n_bad = int((~torch.isfinite(d)).sum())
        raise ValueError(f"{n_bad} of {d.numel()} unmasked tokens have a non-finite logprob difference")
    s = torch.sort(d).values
    return {"mean": float(d.mean()), "p50": quantile(s, 0.5), "p99": quantile(s, 0.99), "max": float(s[-1])}


def by_position(
    a: Tensor,
    b: Tensor,
    mask: Tensor | None = None,
    *,
    bucket: int = 1,
    return_counts: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Mean ``|a - b|`` per response position: ``out[p] = sum_i m_ip |a_ip - b_ip| / sum_i m_ip``.

    ``a``, ``b``, ``mask`` are ``[B, T]`` with position along dim 1 (response-aligned: position
    0 is each response's first token). ``bucket > 1`` pools positions ``[k*bucket, (k+1)*bucket)``
    into one value (for long responses). Positions with no unmasked token are NaN. With
    ``return_counts`` also returns the token count behind each value.

    >>> a, mask = torch.tensor([[1.0, 2.0, 5.0], [3.0, 0.0, 0.0]]), torch.tensor([[1, 1, 0], [1, 1, 0]])
    >>> by_position(a, torch.zeros(2, 3), mask)
    tensor([2., 1., nan], dtype=torch.float64)
    """
    d, m = _abs_diff(a, b, mask)
    if d.dim() != 2:
        raise ValueError(f"by_position needs [batch, position] tensors, got shape {tuple(d.shape)}")
    if bucket < 1:
        raise ValueError(f"bucket={bucket} must be >= 1")
    w = torch.ones_like(d) if m is None else m.double()
    d = torch.where(w > 0, d, torch.zeros_like(d))  # padding may hold NaN/inf
    sums, counts = d.sum(dim=0), w.sum(dim=0)
    if bucket > 1:
        pad = (-sums.numel()) % bucket
        sums = torch.nn.functional.pad(sums, (0, pad)).view(-1, bucket).sum(dim=1)
        counts = torch.nn.functional.pad(counts, (0, pad)).view(-1, bucket).sum(dim=1)
    means = torch.where(counts > 0, sums / counts.clamp(min=1), torch.full_like(sums, math.nan))
    return (means, counts.long()) if return_counts else means


# --------------------------------------------------------------------------- series over steps


def _xy(x: ArrayLike, y: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Float64 arrays of equal length with non-finite pairs removed."""
    xa = np.asarray(x.detach().cpu() if isinstance(x, Tensor) else x, dtype=np.float64).ravel()
    ya = np.asarray(y.detach().cpu() if isinstance(y, Tensor) else y, dtype=np.float64).ravel()
    if xa.shape != ya.shape:
        raise ValueError(f"steps and values differ in length: {xa.size} vs {ya.size}")
    keep = np.isfinite(xa) & np.isfinite(ya)
    return xa[keep], ya[keep]


def linear_fit(x: ArrayLike, y: ArrayLike) -> tuple[float, float]:
    """Least-squares line ``y = intercept + slope * x``; returns ``(slope, intercept)``.

    Non-finite pairs are ignored. Needs two distinct ``x`` values.

    >>> linear_fit([0, 1, 2], [1.0, 3.0, 5.0])
    (2.0, 1.0)
    """
    xa, ya = _xy(x, y)
    if xa.size < 2 or np.ptp(xa) == 0:
        raise ValueError(f"a line needs at least two distinct x values, got {xa.size} finite points")
    xm, ym = xa.mean(), ya.mean()
    sxx = float(((xa - xm) ** 2).sum())
    slope = float(((xa - xm) * (ya - ym)).sum()) / sxx
    return slope, float(ym - slope * xm)


class DriftFit(NamedTuple):
    """OLS trend of a metric over steps. Unpacks as ``slope, stderr, t, p_value, intercept, n``."""

    slope: float
    """Change of the value per step."""
    stderr: float
    """Standard error of the slope, ``sqrt(SSR / (n - 2) / Sxx)``."""
    t: float
    """``slope / stderr`` (+-inf for a perfect non-flat fit, 0 for a perfect flat one)."""
    p_value: float
    """Two-sided p-value of ``slope == 0`` (Student t, n - 2 degrees of freedom)."""
    intercept: float
    """Value at step 0."""
    n: int
    """Finite points used."""


def drift(steps: ArrayLike, values: ArrayLike) -> DriftFit:
    """Slope of ``values`` over ``steps`` with its standard error, t and p (ordinary least squares).

    ``slope = Sxy / Sxx``, ``stderr = sqrt(SSR / (n - 2) / Sxx)``, where ``Sxx = sum (x - mean x)**2``,
    ``Sxy = sum (x - mean x)(y - mean y)``, ``SSR`` the residual sum of squares: the same
    numbers as ``numpy.polyfit(x, y, 1, cov=True)``. Non-finite pairs are dropped (``n`` says
    how many remain); needs 3 points and two distinct steps.

    >>> fit = drift([0, 1, 2, 3], [1.0, 1.2, 0.8, 1.0])
    >>> round(fit.slope, 4), round(fit.stderr, 4), round(fit.p_value, 3)
    (-0.04, 0.0849, 0.684)
    """
    xa, ya = _xy(steps, values)
    n = int(xa.size)
    if n < 3:
        raise ValueError(f"drift needs at least 3 finite points for a standard error, got {n}")
    slope, intercept = linear_fit(xa, ya)
    xm = xa.mean()
    sxx = float(((xa - xm) ** 2).sum())
    ssr = float(((ya - (intercept + slope * xa)) ** 2).sum())
    stderr = math.sqrt(ssr / (n - 2) / sxx)
    if stderr > 0:
        t = slope / stderr
    else:
        t = 0.0 if slope == 0 else math.copysign(math.inf, slope)
    return DriftFit(slope, stderr, t, student_t_two_sided_p(t, n - 2), intercept, n)


def drifting_up(slope: float, stderr: float, *, z: float = 2.0, min_slope: float = 0.0) -> bool:
    """True when the slope is positive beyond noise: ``slope - z * stderr > min_slope``.

    ``min_slope`` ignores rises too small to matter (e.g. ``0.01 / n_steps`` for a logprob diff
    that may not grow by more than 0.01 over the run).

    >>> drifting_up(0.001, 0.002), drifting_up(0.01, 0.002)
    (False, True)
    """
    if not stderr >= 0:
        raise ValueError(f"stderr={stderr} must be >= 0")
    return slope - z * stderr > min_slope


def moving_average(values: ArrayLike, window: int) -> np.ndarray:
    """Trailing mean over the last ``window`` finite values; the first points average what exists.

    ``out[i] = mean(values[max(0, i - window + 1) : i + 1])`` ignoring NaN (NaN when all are).

    >>> moving_average([1.0, 2.0, 3.0, 4.0], 2)
    array([1. , 1.5, 2.5, 3.5])
    """
    if window < 1:
        raise ValueError(f"window={window} must be >= 1")
    v = np.asarray(values.detach().cpu() if isinstance(values, Tensor) else values, dtype=np.float64).ravel()
    finite = np.isfinite(v)
    csum = np.concatenate([[0.0], np.cumsum(np.where(finite, v, 0.0))])
    ccount = np.concatenate([[0], np.cumsum(finite)])
    idx = np.arange(v.size)
    start = np.maximum(0, idx - window + 1)
    sums, counts = csum[idx + 1] - csum[start], ccount[idx + 1] - ccount[start]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


# --------------------------------------------------------------------------- Student t without scipy


def student_t_two_sided_p(t: float, df: float) -> float:
    """Two-sided p-value ``P(|T| >= |t|)`` for Student's t with ``df`` degrees of freedom.

    ``p = I_x(df/2, 1/2)`` with ``x = df / (df + t**2)`` (regularised incomplete beta).

    >>> round(student_t_two_sided_p(2.228139, 10), 4)
    0.05
    """
    if df <= 0:
        raise ValueError(f"df={df} must be > 0")
    if math.isnan(t):
        return math.nan
    if math.isinf(t):
        return 0.0
    return min(1.0, max(0.0, _betainc(df / 2.0, 0.5, df / (df + t * t))))


def _betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta ``I_x(a, b)`` (continued fraction, Numerical Recipes 6.4)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    front = math.exp(log_front)
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def _betacf(a: float, b: float, x: float, *, max_iter: int = 500, eps: float = 1e-15) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, max_iter + 1):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            delta = d * c
            h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h
