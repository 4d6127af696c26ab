"""Unbiased pass@k (Chen et al., 2021): the chance that at least one of k draws, without replacement, from
n samples of which c are correct, is correct: 1 - C(n-c, k) / C(n, k).

    >>> pass_at_k(8, 2, 1)
    0.25
    >>> round(pass_at_k(8, 2, 4), 4)
    0.7857

`pass_at_k_stderr` is the standard error of the mean over problems: the spread of the per-problem estimates
divided by the square root of the problem count. It holds both noises of an evaluation, which problems were
drawn and which samples each got, so two evaluations of n problems whose pass@k differ by less than about
two of them cannot be told apart (64 problems x 8 samples near pass@1 0.3: 0.02 when every problem is equally
hard, up to 0.057 when each is always or never solved).

    >>> round(pass_at_k_stderr([[True, False], [False, False], [True, True], [False, True]], 1), 4)
    0.2041
"""

from __future__ import annotations

from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """pass@k of one problem with n samples, c of them correct (requires k <= n)."""
    if not 0 <= c <= n:
        raise ValueError(f"correct count c={c} must lie in [0, n={n}]")
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must lie in [1, n={n}]: draw at least n samples per problem to report pass@{k}")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):  # C(n-c, k) / C(n, k) as a stable product
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def pass_at_k_stderr(correct_per_problem: Sequence[Sequence[bool]], k: int) -> float:
    """Standard error of mean_pass_at_k over problems (sample standard deviation / sqrt(problems)); 0 for one."""
    values = [pass_at_k(len(s), sum(bool(x) for x in s), k) for s in correct_per_problem]
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return (variance / len(values)) ** 0.5


def mean_pass_at_k(correct_per_problem: Sequence[Sequence[bool]], k: int) -> float:
    """Mean pass@k over problems, each given as its list of per-sample correctness."""
    if not correct_per_problem:
        raise ValueError("no problems to evaluate")
    return sum(pass_at_k(len(s), sum(bool(x) for x in s), k) for s in correct_per_problem) / len(correct_per_problem)
