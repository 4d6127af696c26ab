"""The figure of `v4rl bench learning`: held-out pass@1 and pass@8 per arm against the step, +-1 standard error
across seeds where there are several.

    plot_learning(json.loads(Path("runs/bench/learning.json").read_text()), Path("runs/bench/learning.png"))
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engines.train.report import _save, plt


def plot_learning(result: dict[str, Any], path: Path) -> Path:
    """Two panels (pass@1, pass@8), one line per arm; BF16 rollout drawn black so the FP8 arms read against it."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharex=True)
    for ax, k in zip(axes, ("pass@1", "pass@8")):
        for arm in result["arms"]:
            steps = [e["step"] for e in arm["evals"]]
            se = [e[f"{k}_se"] or 0.0 for e in arm["evals"]]
            ax.errorbar(steps, [e[k] for e in arm["evals"]], yerr=se, fmt="o-", capsize=2, label=arm["arm"],
                        color="black" if arm["rollout_weights"] == "bf16" else None)
        ax.set(xlabel="GRPO step", ylabel=f"held-out {k}", title=k)
        ax.grid(alpha=0.3)
    s = result["settings"]
    fig.suptitle(f"tiny-cpu: {s['seeds']} seed(s) x {s['steps']} steps of {s['prompts_per_step']} x "
                 f"{s['n_samples']}, {s['n_eval']} held-out problems x {s['eval_samples']}")
    axes[1].legend(fontsize=8, loc="lower right")
    return _save(fig, Path(path))
