"""Run report: the seed's figures as PNGs (reward per step with moving average and linear fit, train/rollout
logprob difference per step against the run's mismatch threshold, held-out pass@k per evaluation with one
standard error over the problems as error bars) and a markdown summary that embeds them. Numbers too small for
four decimals (a drift slope and its standard error) are written in scientific notation, never as 0.0000.

    python -c "from engines.runs.report import write_report; print(write_report('runs/grpo'))"
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from engines.runs.runlog import RunLog  # noqa: E402
from rl.stats import drift, linear_fit, moving_average  # noqa: E402


MIN_SMOOTHING_WINDOW = 5
"""Smallest moving-average window of the reward plot: with len // 10 alone a 10-step run would get a window of
1, a 'moving average' identical to the raw series."""


def smoothing_window(n_points: int) -> int:
    """The reward plot's moving-average window: a tenth of the series, at least MIN_SMOOTHING_WINDOW points (and
    never more than the series).

    >>> smoothing_window(10), smoothing_window(100), smoothing_window(300), smoothing_window(3)
    (5, 10, 30, 3)
    """
    return max(1, min(n_points, max(MIN_SMOOTHING_WINDOW, n_points // 10)))


def fmt(value: float) -> str:
    """A report number: 4 decimals, or 2 significant digits in scientific notation when 4 decimals would show
    (nearly) nothing.

    >>> fmt(0.4537), fmt(-2.7e-05), fmt(0.0), fmt(3e-4)
    ('0.4537', '-2.7e-05', '0.0000', '3.0e-04')
    """
    if value != 0 and abs(value) < 1e-3:
        return f"{value:.1e}"
    return f"{value:.4f}"


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _steps_axis(ax) -> None:
    """Steps are whole numbers: no 0.5 ticks on a 2- or 3-step run."""
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, path)
    return path


def plot_reward(rows: list[dict], path: Path) -> Path | None:
    steps, values = _series(rows, "rollout/raw_reward")
    if not steps:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, values, ".", alpha=0.5, label="per step")
    window = smoothing_window(len(values))
    ax.plot(steps, moving_average(values, window), label=f"moving average ({window} steps, trailing)")
    if len(steps) >= 2:
        slope, intercept = linear_fit(steps, values)
        ax.plot(steps, [slope * s + intercept for s in steps], "--", label=f"linear fit (slope {slope:+.4f}/step)")
    ax.set(xlabel="step", ylabel="rollout/raw_reward", title="Online raw reward")
    _steps_axis(ax)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, frameon=False)
    return _save(fig, path)


def plot_logprob_diff(rows: list[dict], path: Path, threshold: float | None = None) -> Path | None:
    """|Δlogprob| per step; `threshold` (the run's mismatch_threshold) as a line: steps above it count against
    the mismatch budget. When the series sits far below the line the y axis is logarithmic, so both read."""
    steps, values = _series(rows, "train/train_rollout_logprob_abs_diff")
    if not steps:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, values, ".-", label="mean |train - rollout| logprob")
    ax.set(xlabel="step", ylabel="train/train_rollout_logprob_abs_diff", title="Train vs rollout logprob difference")
    _steps_axis(ax)
    positive = [v for v in values if v > 0]
    if threshold:
        ax.axhline(threshold, color="tab:red", linestyle="--",
                   label=f"mismatch_threshold {threshold:g} (steps above count against the budget)")
    if threshold and positive and threshold > 5 * max(positive):
        ax.set_yscale("log")
        ax.set_ylim(bottom=min(positive) / 2, top=threshold * 2)
    else:
        ax.set_ylim(bottom=0, top=max([*values, threshold or 0]) * 1.15 or None)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    return _save(fig, path)


def plot_pass_at_k(evals: list[dict], path: Path) -> Path | None:
    if not evals:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for k in (1, 2, 4, 8):
        pts = [(e["step"], e[f"pass@{k}"], e.get(f"pass@{k}_stderr")) for e in evals if f"pass@{k}" in e]
        if pts:
            bars = [p[2] for p in pts] if all(p[2] is not None for p in pts) else None
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=bars, fmt="o-", capsize=3, label=f"pass@{k}")
    last = evals[-1]
    size = (f"{last['n_problems']} problems x {last['n_samples']} samples"
            if "n_problems" in last and "n_samples" in last else "")
    noise = "bars: ±1 standard error over the problems" if any("pass@1_stderr" in e for e in evals) else ""
    title = "Held-out pass@k" + (f" ({'; '.join(p for p in (size, noise) if p)})" if size or noise else "")
    ax.set(xlabel="step", ylabel="held-out pass@k", ylim=(0, 1))
    _steps_axis(ax)
    ax.set_title(title, fontsize=10)
    # below the axes, never over the points (pass@8 lives near the top, pass@1 near the middle)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=4, frameon=False)
    return _save(fig, path)


def summarize(run_dir: str | Path) -> dict:
    """Headline numbers: reward first vs last third, logprob-diff mean and drift, pass@k first vs last eval."""
    log = RunLog(run_dir)
    rows, evals = log.metrics(), log.evals()
    out: dict = {"steps": len(rows), "evals": len(evals)}
    _, reward = _series(rows, "rollout/raw_reward")
    if len(reward) >= 3:
        third = len(reward) // 3
        out["reward_first_third"] = sum(reward[:third]) / third
        out["reward_last_third"] = sum(reward[-third:]) / third
    steps, diff = _series(rows, "train/train_rollout_logprob_abs_diff")
    if diff:
        out["logprob_abs_diff_mean"] = sum(diff) / len(diff)
        if len(diff) >= 3:
            fit = drift(steps, diff)
            out["logprob_abs_diff_slope"], out["logprob_abs_diff_slope_stderr"] = fit.slope, fit.stderr
    if evals:
        for k in (1, 8):
            key = f"pass@{k}"
            if key in evals[0]:
                out[f"{key}_first"], out[f"{key}_last"] = evals[0][key], evals[-1][key]
    return out


def _eval_table(evals: list[dict]) -> list[str]:
    """Markdown rows: step, problems x samples, pass@k ± one standard error (when recorded), truncation."""
    keys = [k for k in ("pass@1", "pass@2", "pass@4", "pass@8") if k in evals[0]]
    extra = [k for k in ("truncated_ratio",) if k in evals[0]]
    sized = "n_problems" in evals[0]
    head = ["step"] + (["problems x samples"] if sized else []) + keys + extra
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for e in evals:
        cells = [str(e["step"])] + ([f"{e.get('n_problems', '?')} x {e.get('n_samples', '?')}"] if sized else [])
        cells += [f"{e[k]:.3f} ± {e[k + '_stderr']:.3f}" if k + "_stderr" in e else f"{e[k]:.3f}" if k in e else ""
                  for k in keys]
        cells += [f"{e[k]:.3f}" if k in e else "" for k in extra]
        lines.append("| " + " | ".join(cells) + " |")
    if any("pass@1_stderr" in e for e in evals):
        lines += ["", "± is one standard error over the held-out problems (rl/passk.py): two evaluations closer "
                      "than about twice it cannot be told apart from sampling noise."]
    return lines


def _mismatch_threshold(run_dir: Path) -> float | None:
    """The run's mismatch_threshold from its config.json (the embedded trainer's TrainRunConfig); None if absent."""
    try:
        value = json.loads((run_dir / "config.json").read_text()).get("mismatch_threshold")
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) else None


def _img(path: Path | None) -> str:
    if path is None:
        return ""
    return f"![{path.stem}](data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()})\n\n"


def write_report(run_dir: str | Path, *, title: str = "v4rl run report", extra_markdown: str = "",
                 links: dict[str, str] | None = None) -> dict:
    """Plots into run_dir/plots, report.md into run_dir; returns {"markdown", "summary", "plots"}."""
    run_dir = Path(run_dir)
    log = RunLog(run_dir)
    rows, evals = log.metrics(), log.evals()
    plots = {"reward": plot_reward(rows, run_dir / "plots" / "reward.png"),
             "logprob_diff": plot_logprob_diff(rows, run_dir / "plots" / "logprob_diff.png",
                                               _mismatch_threshold(run_dir)),
             "pass_at_k": plot_pass_at_k(evals, run_dir / "plots" / "pass_at_k.png")}
    summary = summarize(run_dir)
    lines = [f"# {title}", "", f"Run directory: `{run_dir}`", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {fmt(v)} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in summary.items()]
    if evals:
        lines += ["", "## Held-out evaluation", ""] + _eval_table(evals)
    events_path = run_dir / "events.jsonl"
    if events_path.exists():
        events = [json.loads(line) for line in events_path.read_text().splitlines() if line.strip()]
        lines += ["", "## Events", ""] + [f"- step {e['step']}: {e['message']}" for e in events]
    if links:
        lines += ["", "## Uploaded", ""] + [f"- [{name}]({url})" for name, url in links.items()]
    markdown = "\n".join(lines) + "\n\n" + extra_markdown
    file_markdown = markdown + "".join(f"![{n}](plots/{p.name})\n\n" for n, p in plots.items() if p)
    tmp = run_dir / ".report.md.tmp"
    tmp.write_text(file_markdown)
    os.replace(tmp, run_dir / "report.md")
    ui_markdown = markdown + "".join(_img(p) for p in plots.values())
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return {"markdown": ui_markdown, "summary": summary, "plots": {k: str(v) for k, v in plots.items() if v}}
