"""Prefect task: fail fast before anything expensive: the parallel layout fits (engines/layout), the data
loads, and the reward grades its golden cases right."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

GOLDEN = [("\\boxed{85}", "85", 1.0), ("The answer is \\boxed{85}.", "85", 1.0), ("\\boxed{84}", "85", 0.0),
          ("85", "85", 0.0), ("\\boxed{\\frac{1}{2}}", "0.5", 1.0)]


@task(name="preflight", cache_policy=NO_CACHE)
def preflight(preset: str, seed: int = 0) -> dict:
    from engines.launch import preflight_plan
    from rl.math_task import make_splits
    from rl.rewards import grade

    plan = preflight_plan(preset)  # raises InfeasibleLayout naming each violated rule and its fix
    wrong = [(r, label, want, grade(r, label).reward) for r, label, want in GOLDEN if grade(r, label).reward != want]
    if wrong:
        raise RuntimeError(f"reward function misgrades its golden cases: {wrong}")
    train, held_out = make_splits(64, 16, seed)
    return {"feasible": plan.feasible, "golden_cases": len(GOLDEN), "train_rows": len(train),
            "eval_rows": len(held_out), "layout": str(getattr(plan, "layout", ""))}
