"""The nightly verdict: does tonight's short validation run regress against the history of earlier nights?

A night fails on any of:
  alignment   the cross-engine mean |Δlogprob| is over its threshold (the seed's bring-up value: 0.09);
  drift       train/rollout |Δlogprob| rises over the run's steps: OLS slope more than z standard errors
              above zero (rl.stats.drift);
  pass@1      tonight's held-out pass@1 lies below the history's band by more than the noise of both:
              mean_hist - z * sqrt(var_hist + p(1-p)/n_tonight), where n_tonight is the number of graded
              samples (problems x samples per problem, a conservative i.i.d. approximation).
With fewer than `min_history` earlier nights the pass@1 check cannot tell noise from regression: it is
skipped and the verdict says so (the night still fails on alignment or drift). Nights are compared with
nights of the same preset only (`same_preset`): a cluster run's AIME pass@1 is no band for tiny-cpu's.

    >>> v = nightly_verdict({"align_mean": 0.01, "pass@1": 0.30, "n_problems": 100, "n_samples": 8},
    ...                     [{"pass@1": 0.31}, {"pass@1": 0.29}, {"pass@1": 0.30}])
    >>> v.passed, v.checks["pass@1"]["status"]
    (True, 'ok')
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from rl.stats import drift


@dataclass
class Verdict:
    passed: bool
    reasons: list[str] = field(default_factory=list)
    checks: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def same_preset(history: list[dict], preset: str) -> list[dict]:
    """The records of nights that ran `preset` (records written before nights had a preset were tiny-cpu)."""
    return [h for h in history if h.get("preset", "tiny-cpu") == preset]


def nightly_verdict(tonight: dict, history: list[dict], *, align_threshold: float = 0.09, z: float = 2.0,
                    min_history: int = 3) -> Verdict:
    """tonight: {"align_mean", "pass@1", "n_problems", "n_samples", optional "diff_steps"/"diff_values"};
    history: earlier nights' records with at least "pass@1"."""
    reasons: list[str] = []
    checks: dict = {}

    align = tonight.get("align_mean")
    if align is not None:
        ok = align <= align_threshold
        checks["alignment"] = {"status": "ok" if ok else "fail", "mean_abs_diff": align, "threshold": align_threshold}
        if not ok:
            reasons.append(f"alignment: mean |Δlogprob| {align:.4f} is over the threshold {align_threshold}")

    steps, values = tonight.get("diff_steps") or [], tonight.get("diff_values") or []
    if len(values) >= 3:
        fit = drift(steps, values)
        rising = fit.slope - z * fit.stderr > 0
        checks["drift"] = {"status": "fail" if rising else "ok", "slope": fit.slope, "stderr": fit.stderr}
        if rising:
            reasons.append(f"drift: train/rollout |Δlogprob| rises by {fit.slope:.2e}/step "
                           f"(stderr {fit.stderr:.1e}, more than {z} standard errors above 0)")

    past = [h["pass@1"] for h in history if h.get("pass@1") is not None]
    p, n = tonight.get("pass@1"), tonight.get("n_problems", 0) * tonight.get("n_samples", 0)
    if p is None:
        checks["pass@1"] = {"status": "missing"}
        reasons.append("pass@1: tonight's evaluation produced no pass@1")
    elif len(past) < min_history:
        checks["pass@1"] = {"status": "insufficient_history", "history": len(past), "needed": min_history}
    else:
        mean = sum(past) / len(past)
        var = sum((x - mean) ** 2 for x in past) / (len(past) - 1)
        noise = p * (1 - p) / n if n else 0.25
        lower = mean - z * math.sqrt(var + noise)
        ok = p >= lower
        checks["pass@1"] = {"status": "ok" if ok else "fail", "tonight": p, "history_mean": mean, "band_low": lower,
                            "history": len(past), "graded_samples": n}
        if not ok:
            reasons.append(f"pass@1: {p:.3f} is below the history band (mean {mean:.3f} over {len(past)} nights, "
                           f"lower edge {lower:.3f} at {z} sigma of history spread plus sampling noise)")
    return Verdict(passed=not reasons, reasons=reasons, checks=checks)


def evaluation_regression(now: dict, earlier: list[dict], *, z: float = 2.0) -> dict:
    """The regression check of one evaluation as it lands, against the run's earlier evaluations: pass@1 below the
    best earlier pass@1 by more than z standard errors of the difference (each evaluation's `pass@1_stderr`, the
    spread over its problems). Returns {"status": "ok"|"regressed"|"no_history"|"no_stderr", ...}.

    >>> evaluation_regression({"step": 20, "pass@1": 0.20, "pass@1_stderr": 0.02},
    ...                       [{"step": 10, "pass@1": 0.40, "pass@1_stderr": 0.02}])["status"]
    'regressed'
    >>> evaluation_regression({"step": 20, "pass@1": 0.38, "pass@1_stderr": 0.02},
    ...                       [{"step": 10, "pass@1": 0.40, "pass@1_stderr": 0.02}])["status"]
    'ok'
    """
    past = [e for e in earlier if e.get("pass@1") is not None and e.get("step", -1) < now.get("step", 0)]
    if now.get("pass@1") is None or not past:
        return {"status": "no_history"}
    best = max(past, key=lambda e: e["pass@1"])
    se_now, se_best = now.get("pass@1_stderr"), best.get("pass@1_stderr")
    if se_now is None or se_best is None:  # evaluations written before the stderr was recorded
        return {"status": "no_stderr", "best_step": best.get("step")}
    band = z * math.sqrt(se_now ** 2 + se_best ** 2)
    drop = best["pass@1"] - now["pass@1"]
    return {"status": "regressed" if drop > band else "ok", "pass@1": now["pass@1"], "best_pass@1": best["pass@1"],
            "best_step": best.get("step"), "drop": drop, "band": band}
