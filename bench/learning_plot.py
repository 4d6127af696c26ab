"""The figure and the table of `v4rl bench learning`: held-out pass@1 and pass@8 per arm against the step, +-1
standard error across seeds where there are several; the markdown table the docs show, from the same JSON.

    plot_learning(json.loads(Path("runs/bench/learning.json").read_text()), Path("runs/bench/learning.png"))
    print(learning_table(json.loads(Path("runs/bench/learning.json").read_text())))
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engines.runs.report import _save, plt


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


def _pm(mean: float | None, se: float | None, signed: bool = False, digits: int = 3) -> str:
    if mean is None:
        return "-"
    text = f"{mean:{'+' if signed else ''}.{digits}f}"
    return text if se is None else f"{text} ± {se:.{digits}f}"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def learning_table(result: dict[str, Any], steps: tuple[int, ...] | None = None) -> str:
    """One markdown row per arm: pass@1 at the chosen evaluations (default: first, every other, last), pass@8 at
    the last, the paired gap to BF16 rollout where measured, the mismatch and masking numbers, seconds per step."""
    evaluated = [e["step"] for e in result["arms"][0]["evals"]]
    shown = steps or tuple(sorted({evaluated[0], *evaluated[::2], evaluated[-1]}))
    head = ["arm", "trainer forward", *(f"pass@1 step {s}" for s in shown), f"pass@8 step {shown[-1]}",
            "gap to bf16-tis, pass@1", "mean abs Δlogprob", "masked tokens", "masked seqs", "router mismatch",
            "s/step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm in result["arms"]:
        at = {e["step"]: e for e in arm["evals"]}
        gap = arm.get("gap_pass@1_vs_bf16") or {}
        gap_text = "-" if arm["arm"] == "bf16-tis" or gap.get("mean") is None else (
            f"{_pm(gap['mean'], gap['se'], signed=True)} (steps ≥ {gap['from_step']}); "
            f"{_pm(gap['last'], gap['last_se'], signed=True)} "
            f"at {gap['last_step']}")
        ratio = arm.get("step_seconds_vs_bf16")
        seconds = _num(arm["step_seconds"], ".1f") + (f" ({ratio:.2f}x)" if ratio and arm["arm"] != "bf16-tis"
                                                      else "")
        row = [arm["arm"], "FP8 weights" if arm.get("trainer_sees_fp8", arm["rollout_weights"] == "fp8") else "BF16",
               *(_pm(at[s]["pass@1"], at[s]["pass@1_se"]) if s in at else "-" for s in shown),
               _pm(at[shown[-1]]["pass@8"], at[shown[-1]]["pass@8_se"]), gap_text,
               _num(arm["abs_dlogprob"], ".4f"), _num(arm["masked_token_frac"], ".3f"),
               _num(arm["masked_seq_frac"], ".3f"), _num(arm["router_mismatch_frac"], ".4f"), seconds]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
