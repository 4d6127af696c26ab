"""A training run in words for the terminal: each held-out evaluation on one line as it lands, and, when the run
ends or is interrupted, its report written and where the report, plots and checkpoints are.

    eval_line(10, {"pass@1": 0.31, "pass@1_stderr": 0.04, "pass@8": 0.75, "pass@8_stderr": 0.05, ...})
    # 'eval step 10: pass@1 0.310 ± 0.040, pass@8 0.750 ± 0.050 (64 problems x 8 samples)'
    run_summary(Path("runs/grpo"))   # ['held-out pass@1: step 0 ... -> step 20 ...', 'report: ...', ...]
"""

from __future__ import annotations

from pathlib import Path

from engines.runs.checkpointing import latest_step
from engines.runs.runlog import RunLog


def _value(result: dict, key: str) -> str:
    err = result.get(f"{key}_stderr")
    return f"{result[key]:.3f}" + (f" ± {err:.3f}" if err is not None else "")


def eval_line(step: int, result: dict) -> str:
    """One evaluation: pass@1 and the largest k evaluated, each ± one standard error over the problems."""
    ks = [k for k in (1, 2, 4, 8) if f"pass@{k}" in result]
    shown = ", ".join(f"pass@{k} {_value(result, f'pass@{k}')}" for k in dict.fromkeys(ks[:1] + ks[-1:]))
    size = f" ({result['n_problems']} problems x {result.get('n_samples', '?')} samples)" \
        if "n_problems" in result else ""
    return f"eval step {step}: {shown or 'no pass@k'}{size}"


def pass_at_k_lines(run_dir: Path) -> list[str]:
    """Held-out pass@1 and pass@8 at the first and last evaluation, each ± one standard error over the problems,
    and how large a change must be to stand out of that noise (about twice the larger standard error)."""
    evals = RunLog(run_dir).evals()
    if not evals:
        return []
    first, last = evals[0], evals[-1]
    lines = []
    for key in ("pass@1", "pass@8"):
        if key not in first or key not in last:
            continue
        errs = [e.get(f"{key}_stderr") for e in (first, last)]
        line = f"held-out {key}: step {first['step']} {_value(first, key)} -> step {last['step']} {_value(last, key)}"
        if None not in errs and last is not first:
            change, noise = last[key] - first[key], 2 * max(errs)
            verdict = "beyond" if abs(change) > noise else "within"
            line += f" (change {change:+.3f}, {verdict} the noise of ±{noise:.3f})"
        lines.append(line)
    if "n_problems" in last:
        lines.append(f"({last['n_problems']} held-out problems x {last.get('n_samples', '?')} samples per evaluation;"
                     " ± is one standard error over the problems)")
    return lines


def run_summary(run_dir: Path) -> list[str]:
    """Writes the run's report (report.md and plots/, engines/runs/report.py) and returns the lines that say
    what the run reached and where the report, plots, checkpoints and served weights are."""
    from engines.runs.report import write_report

    run_dir = Path(run_dir)
    lines = [line for line in pass_at_k_lines(run_dir) if line.startswith("held-out")]
    if RunLog(run_dir).metrics_path.exists() or RunLog(run_dir).eval_dir.exists():
        plots = write_report(run_dir)["plots"]
        lines.append(f"report: {run_dir / 'report.md'}")
        if plots:
            lines.append("plots: " + ", ".join(plots.values()))
    step = latest_step(run_dir / "checkpoints")
    lines.append(f"checkpoints: {run_dir / 'checkpoints'} " + (f"(latest: step {step})" if step else "(none yet)"))
    weights = run_dir / "weights" / "current"
    if (weights / "config.json").exists():
        lines.append(f"weights: {weights} (HF checkpoint the rollout served last)")
    return lines
