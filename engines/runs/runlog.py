"""The run directory (DESIGN.md Artifacts): `config.json`, `metrics.jsonl`, `eval/step_XXXXXX.json`,
`checkpoints/`, plots and reports added by later stages.

metrics.jsonl is one JSON object per committed step. A resumed run first drops rows past the step it
resumes from (they were logged after the last checkpoint, and their weights are gone), so the series
stays continuous with no duplicate step rows.

Optional metric sinks (TensorBoard, W&B: engines/runs/sinks.py) get each row right after it is committed
here, each eval result right after its JSON is written, and a rewind whenever rows are dropped, so they
carry the same series as metrics.jsonl.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from engines.runs.sinks import MetricSinks


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN; a missing value is honest
    return value


class RunLog:
    def __init__(self, run_dir: str | Path, sinks: MetricSinks | None = None) -> None:
        self.dir = Path(run_dir)
        self.sinks = sinks if sinks is not None else MetricSinks()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.dir / "metrics.jsonl"
        self.eval_dir = self.dir / "eval"

    def check_config(self, config: dict, *, may_change: tuple[str, ...] = ("steps",)) -> None:
        """Refuse (ValueError) a config that differs from the one in config.json outside the `may_change` fields;
        writes nothing, so a run can check first and write config.json only once its inputs are checked."""
        path = self.dir / "config.json"
        if path.exists():
            old = json.loads(path.read_text())
            changed = sorted(k for k in set(old) | set(config) if k not in may_change and old.get(k) != config.get(k))
            if changed:
                raise ValueError(f"{path} holds a different run configuration (fields {changed}); resume with the "
                                 "same settings or choose a new output directory")

    def write_config(self, config: dict, *, may_change: tuple[str, ...] = ("steps",)) -> None:
        """config.json; a resumed run must bring the same config except the `may_change` (operational) fields."""
        self.check_config(config, may_change=may_change)
        _atomic_write(self.dir / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")

    def metrics(self) -> list[dict]:
        if not self.metrics_path.exists():
            return []
        rows = []
        for i, line in enumerate(self.metrics_path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                if i == len(self.metrics_path.read_text().splitlines()):
                    break  # a torn last line from a killed writer: dropped by truncate_after
                raise ValueError(f"{self.metrics_path}:{i}: corrupt metrics row; fix or delete the line") from None
        return rows

    def truncate_after(self, step: int) -> int:
        """Keep rows with step <= `step`; returns how many were dropped."""
        rows = self.metrics()
        kept = [r for r in rows if r["step"] <= step]
        _atomic_write(self.metrics_path, "".join(json.dumps(r) + "\n" for r in kept))
        self.sinks.rewind(step)
        return len(rows) - len(kept)

    def append_metrics(self, step: int, metrics: dict[str, float]) -> None:
        last = self.metrics()[-1]["step"] if self.metrics_path.exists() and self.metrics() else 0
        if step <= last:
            raise ValueError(f"metrics for step {step} after step {last}: a step is logged once, in order")
        row = {"step": step, **{k: _clean(v) for k, v in sorted(metrics.items())}}
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.sinks.log_metrics(row)

    def write_eval(self, step: int, result: dict) -> Path:
        path = self.eval_dir / f"step_{step:06d}.json"
        _atomic_write(path, json.dumps({"step": step, **result}, indent=2) + "\n")
        self.sinks.log_eval(step, result)
        return path

    def evals(self) -> list[dict]:
        if not self.eval_dir.exists():
            return []
        return [json.loads(p.read_text()) for p in sorted(self.eval_dir.glob("step_*.json"))]
