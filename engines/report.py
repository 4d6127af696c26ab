"""Run report: the seed's figures as PNGs (reward per step with moving average and linear fit, train/rollout
logprob difference per step, held-out pass@k per evaluation) and a markdown summary that embeds them.

    python -c "from engines.report import write_report; print(write_report('runs/grpo'))"
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from engines.train.runlog import RunLog  # noqa: E402
from rl.stats import drift, linear_fit, moving_average  # noqa: E402


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


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
    ax.plot(steps, moving_average(values, max(1, len(values) // 10)), label="moving average")
    if len(steps) >= 2:
        slope, intercept = linear_fit(steps, values)
        ax.plot(steps, [slope * s + intercept for s in steps], "--", label=f"linear fit (slope {slope:+.4f}/step)")
    ax.set(xlabel="step", ylabel="rollout/raw_reward", title="Online raw reward")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_logprob_diff(rows: list[dict], path: Path) -> Path | None:
    steps, values = _series(rows, "train/train_rollout_logprob_abs_diff")
    if not steps:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, values, ".-", label="mean |train - rollout| logprob")
    ax.set(xlabel="step", ylabel="train/train_rollout_logprob_abs_diff", title="Train vs rollout logprob difference")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_pass_at_k(evals: list[dict], path: Path) -> Path | None:
    if not evals:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for k in (1, 2, 4, 8):
        pts = [(e["step"], e[f"pass@{k}"]) for e in evals if f"pass@{k}" in e]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"pass@{k}")
    ax.set(xlabel="step", ylabel="held-out pass@k", title="Held-out pass@k", ylim=(0, 1))
    ax.legend(fontsize=8)
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
             "logprob_diff": plot_logprob_diff(rows, run_dir / "plots" / "logprob_diff.png"),
             "pass_at_k": plot_pass_at_k(evals, run_dir / "plots" / "pass_at_k.png")}
    summary = summarize(run_dir)
    lines = [f"# {title}", "", f"Run directory: `{run_dir}`", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {v:.4f} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in summary.items()]
    if evals:
        keys = [k for k in ("pass@1", "pass@2", "pass@4", "pass@8", "truncated_ratio") if k in evals[0]]
        lines += ["", "## Held-out evaluation", "", "| step | " + " | ".join(keys) + " |",
                  "|---" * (len(keys) + 1) + "|"]
        lines += [f"| {e['step']} | " + " | ".join(f"{e[k]:.3f}" for k in keys) + " |" for e in evals]
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
