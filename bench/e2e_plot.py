"""The figure of `v4rl bench e2e`: held-out pass@1 and pass@8 of both sides against training seconds (the seed's
figure 5, with wall-clock seconds on the x axis so that speed and learning show in one picture).

    plot_pass_at_k_vs_seconds(json.loads(Path("runs/bench/e2e.json").read_text()), Path("runs/bench/e2e.png"))
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engines.runs.report import _save, plt

STYLE = {"v4rl": {"color": "tab:blue", "label": "v4rl train"}, "trl": {"color": "tab:orange", "label": "TRL GRPOTrainer"}}


def plot_pass_at_k_vs_seconds(result: dict[str, Any], path: Path) -> Path:
    """One line per side and k (pass@1 solid with +-2 standard errors, pass@8 dashed), x = cumulative step seconds."""
    fig, ax = plt.subplots(figsize=(7.5, 4))
    for side, evals in result["evals"].items():
        style = STYLE.get(side, {"color": None, "label": side})
        seconds = [e["train_seconds"] for e in evals]
        ax.errorbar(seconds, [e["pass@1"] for e in evals], yerr=[2 * e["pass@1_se"] for e in evals], fmt="o-",
                    color=style["color"], capsize=2, label=f"{style['label']} pass@1")
        ax.plot(seconds, [e["pass@8"] for e in evals], "s--", color=style["color"], label=f"{style['label']} pass@8")
    s = result["settings"]
    for arm, arm_result in result.get("arms", {}).items():  # pass@1 only: the arms are there to compare learning
        if "evals" not in arm_result:  # failed on every seed
            continue
        evals = arm_result["evals"]
        ax.plot([e["train_seconds"] for e in evals], [e["pass@1"] for e in evals], ".:", label=f"arm {arm} pass@1")
    ax.set(xlabel="training seconds (sum of GRPO step times)", ylabel="held-out pass@k", ylim=(0, 1),
           title=f"Held-out pass@k against time: {result['steps']} steps of {s['prompts_per_step']} x "
                 f"{s['n_samples']}, speedup {result['speedup']:.2f}x")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, Path(path))
