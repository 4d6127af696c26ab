"""Miles' own logged rollout and eval metrics, read back from the rehearsal's driver log (miles.log).

Train-stage lines (`step N: {'train/loss': ..., 'train/grad_norm': ...}`, N the accumulated train step) join
their rollout's row (N // --num-steps-per-rollout). The lines are parsed by the cluster job's reader (engines/miles/metrics.py: `parse_metric_line`,
`eval_datasets`), names kept as Miles logs them. The cluster's MilesRecorder (results.py) is not used: it commits
a row only once a rollout was trained, and `--debug-rollout-only` trains nothing.

    m = read_metrics(work / "miles.log")
    m.rollouts["0"]["rollout/response_len/mean"], m.evals[0]["datasets"]["aime"]["pass@4"]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engines.miles.metrics import eval_datasets, parse_metric_line
from engines.miles.results import ROLLOUT_KINDS


@dataclass
class MilesMetrics:
    rollouts: dict[str, dict[str, float]] = field(default_factory=dict)
    """{rollout id (str, a JSON key): every rollout-side metric Miles logged for it (perf, rollout, ...)}."""
    evals: list[dict] = field(default_factory=list)
    """[{"rollout": id, "datasets": {name: {"reward", "pass@k", ...}}}] in log order."""
    trained: list[int] = field(default_factory=list)
    """The rollout id of each train step Miles logged, in log order (a rollout trained twice appears twice)."""


def read_metrics(log: Path, steps_per_rollout: int = 1) -> MilesMetrics:
    """What Miles logged in `log`; an absent log (Miles never started) reads as no metrics."""
    out = MilesMetrics()
    if not log.is_file():
        return out
    last_step = None
    with log.open(errors="replace") as lines:
        for line in lines:
            record = parse_metric_line(line)
            if record is None:
                continue
            if record.kind == "step" and (record.index, record.metrics) == last_step:
                continue  # Miles logs each train step twice (log_utils.py and model.py), the same dict
            if record.kind == "step":  # Miles' train step (--num-steps-per-rollout 1: the rollout id)
                last_step = (record.index, record.metrics)
                out.rollouts.setdefault(str(record.index // steps_per_rollout), {}).update(record.metrics)
                if record.index % steps_per_rollout == 0:
                    out.trained.append(record.index // steps_per_rollout)
            elif record.kind in ROLLOUT_KINDS:
                out.rollouts.setdefault(str(record.index), {}).update(record.metrics)
            elif record.kind == "eval":
                out.evals.append({"rollout": record.index, "datasets": eval_datasets(record.metrics)})
    return out


def metrics_summary(metrics: MilesMetrics) -> list[str]:
    """Terminal lines: one per rollout (a few of Miles' headline metrics), one per eval dataset."""
    keys = ("rollout/raw_reward", "rollout/response_len/mean", "rollout/truncated_ratio", "perf/rollout_time",
            "train/loss", "train/grad_norm", "train/train_rollout_logprob_abs_diff", "train/tis", "train/tis_clipfrac")
    lines = []
    for rollout, values in sorted(metrics.rollouts.items(), key=lambda kv: int(kv[0])):
        shown = ", ".join(f"{k}={values[k]:.4g}" for k in keys if k in values)
        lines.append(f"rollout {rollout}: {shown or f'{len(values)} metrics'}")
    for ev in metrics.evals:
        for name, values in ev["datasets"].items():
            lines.append(f"eval {ev['rollout']} {name}: " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(values.items())))
    return lines
