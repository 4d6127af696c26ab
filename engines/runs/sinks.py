"""Optional metric sinks: TensorBoard and Weights & Biases, fed exactly the rows metrics.jsonl commits.

`metrics.jsonl` and `eval/step_XXXXXX.json` are always written (engines/runs/runlog.py); the sinks named
in the training config's `metric_sinks` mirror them for dashboards:

    v4rl train --out runs/grpo --tensorboard --wandb     # TrainRunConfig(metric_sinks=["tensorboard", "wandb"])
    tensorboard --logdir runs/grpo/tensorboard           # scalars written to <run_dir>/tensorboard/
    wandb sync runs/grpo/wandb/offline-run-*             # W&B runs offline unless WANDB_MODE=online

Every metrics row goes in as scalars at step = row["step"]; every eval result goes in as
`eval/math/<key>` (pass@k, truncated_ratio, ...) at its step. The RunLog calls the sinks right after it
has committed a row, and calls `rewind(step)` whenever it drops rows past `step` (resume, rollback), so a
resumed run shows one continuous series:

- TensorBoard: the next event file starts with a purge marker at step+1 (SummaryWriter's `purge_step`),
  which makes TensorBoard's readers hide the earlier files' events from that step on; the replayed steps
  show their new values.
- W&B cannot take back a logged step. Its run id is derived from the run directory (kept in
  `<run_dir>/wandb/v4rl-state.json` with the last step sent), every session resumes the same W&B run
  (`resume="allow"`), and steps W&B already holds are not sent again: a resumed run replays them with the
  same values (training resumes deterministically) up to timing metrics.

W&B needs no account here: unless WANDB_MODE says otherwise it runs offline, writes under
`<run_dir>/wandb/`, never touches the network and never prompts; its error reporting is off unless
WANDB_ERROR_REPORTING is set. `close()` finishes the W&B run (marked failed when the training failed) and
stops the wandb-core service process it started.

    .venv/bin/python -m pytest tests/test_metric_sinks.py -q
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Protocol

SINK_NAMES = ("tensorboard", "wandb")
"""Values `metric_sinks` accepts."""
_PACKAGE_OF = {"tensorboard": "tensorboard", "wandb": "wandb"}
EVAL_NAME = "math"
"""Eval scalars are named eval/<EVAL_NAME>/<key>, as DESIGN.md's metric list (Miles' names)."""


class MetricSinkUnavailable(ValueError):
    """A configured sink whose package is missing (a configuration problem: retrying cannot fix it)."""


def check_sink_names(names: Any, field: str = "metric_sinks") -> list[str]:
    """The sink names in order without repeats; ValueError naming `field` and the allowed values otherwise."""
    if isinstance(names, str) or not isinstance(names, (list, tuple)):
        raise ValueError(f"{field} must be a list of sink names, got {names!r}; use e.g. "
                         f"{list(SINK_NAMES)!r}, or [] for metrics.jsonl only")
    unknown = [n for n in names if n not in SINK_NAMES]
    if unknown:
        raise ValueError(f"{field} has unknown metric sink(s) {unknown}; allowed: {', '.join(SINK_NAMES)} "
                         "(metrics.jsonl and eval/ are always written; [] adds nothing)")
    return list(dict.fromkeys(names))


def _scalars(values: dict[str, Any]) -> dict[str, float]:
    # metrics.jsonl stores a non-finite value as null and evals carry counts: only numbers are plotted
    return {k: float(v) for k, v in values.items()
            if isinstance(v, (int, float)) and math.isfinite(float(v))}


class MetricSink(Protocol):
    def log(self, step: int, scalars: dict[str, float], *, kind: str) -> None: ...

    def rewind(self, step: int) -> None: ...

    def close(self, *, failed: bool) -> None: ...


class TensorBoardSink:
    """Scalars into <run_dir>/tensorboard/ through torch's SummaryWriter, flushed every row."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self._writer = None
        self._purge_step: int | None = None

    def _open(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.log_dir), purge_step=self._purge_step)
        return self._writer

    def log(self, step: int, scalars: dict[str, float], *, kind: str) -> None:
        writer = self._open()
        for name, value in scalars.items():
            writer.add_scalar(name, value, global_step=step)
        writer.flush()  # default flush is every 120 s: a dashboard should see the step, a crash keep it

    def rewind(self, step: int) -> None:
        # The purge marker is written when a writer opens, so the next rows go to a fresh file
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._purge_step = step + 1

    def close(self, *, failed: bool) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def wandb_run_id(run_dir: Path) -> str:
    """The run directory's name (W&B-safe) plus a hash of its absolute path: stable across resumes, distinct
    for same-named runs under different roots."""
    path = Path(run_dir).expanduser().resolve()
    name = re.sub(r"[^A-Za-z0-9_-]", "-", path.name)[:48] or "run"
    return f"{name}-{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"


class WandbSink:
    """One W&B run per training run, resumed by every session; offline under <run_dir>/wandb/ by default."""

    def __init__(self, run_dir: Path, config: dict | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.config = config
        self.state_path = self.run_dir / "wandb" / "v4rl-state.json"
        state = json.loads(self.state_path.read_text()) if self.state_path.exists() else {}
        # The id is kept once chosen, so a run directory moved elsewhere still resumes its W&B run
        self.state = {"run_id": wandb_run_id(self.run_dir), "last_step": {"metrics": -1, "eval": -1}, **state}
        self.run = None

    @property
    def run_id(self) -> str:
        return self.state["run_id"]

    def _open(self):
        if self.run is None:
            # Read by wandb when it spawns its service: no crash reports or telemetry leave the machine
            os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
            import wandb

            settings = wandb.Settings(
                mode=os.environ.get("WANDB_MODE", "offline"), silent=True, console="off", disable_git=True,
                save_code=False, x_save_requirements=False, x_disable_stats=True, x_disable_meta=True,
                x_disable_machine_info=True)
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "v4rl"), id=self.run_id,
                                  name=self.run_dir.name, resume="allow", dir=str(self.run_dir),
                                  config=self.config, settings=settings)
        return self.run

    def log(self, step: int, scalars: dict[str, float], *, kind: str) -> None:
        if step <= self.state["last_step"][kind]:
            return  # W&B holds this step from an earlier session and cannot take it back
        self._open().log(scalars, step=step)
        self.state["last_step"][kind] = step
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        tmp.write_text(json.dumps(self.state, indent=1) + "\n")
        os.replace(tmp, self.state_path)

    def rewind(self, step: int) -> None:
        pass  # nothing to undo: replayed steps are skipped by `log` (see the module docstring)

    def close(self, *, failed: bool) -> None:
        if self.run is None:
            return
        import wandb

        try:
            self.run.finish(exit_code=1 if failed else 0)
        finally:
            self.run = None
            # finish() leaves the wandb-core service running until interpreter exit; this stops it (and with
            # it any other W&B run of this process: training owns W&B here)
            wandb.teardown()


class MetricSinks:
    """The configured sinks as one: RunLog feeds it, the training run closes it (a context manager)."""

    def __init__(self, sinks: dict[str, MetricSink] | None = None, *, eval_name: str = EVAL_NAME) -> None:
        self.sinks = dict(sinks or {})
        self.eval_name = eval_name

    def log_metrics(self, row: dict[str, Any]) -> None:
        scalars = _scalars({k: v for k, v in row.items() if k != "step"})
        for sink in self.sinks.values():
            sink.log(row["step"], scalars, kind="metrics")

    def log_eval(self, step: int, result: dict[str, Any]) -> None:
        scalars = _scalars({f"eval/{self.eval_name}/{k}": v for k, v in result.items() if k != "step"})
        for sink in self.sinks.values():
            sink.log(step, scalars, kind="eval")

    def rewind(self, step: int) -> None:
        for sink in self.sinks.values():
            sink.rewind(step)

    def close(self, *, failed: bool = False) -> None:
        """Close every sink, even when one fails to; the first error is raised afterwards."""
        first: BaseException | None = None
        for sink in self.sinks.values():
            try:
                sink.close(failed=failed)
            except Exception as exc:  # noqa: BLE001 - the other sinks must still be closed
                first = first or exc
        if first is not None:
            raise first

    def __enter__(self) -> "MetricSinks":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=exc_type is not None)


def open_sinks(names: list[str] | tuple[str, ...], run_dir: str | Path, *, config: dict | None = None) -> MetricSinks:
    """The sinks named in `names` for run_dir (nothing starts until the first row arrives).

    `config` is stored as the W&B run's config. A sink whose package is missing is a MetricSinkUnavailable
    (a ValueError) saying what to install.
    """
    names = check_sink_names(names)
    for name in names:
        if importlib.util.find_spec(_PACKAGE_OF[name]) is None:
            raise MetricSinkUnavailable(
                f"metric_sinks includes {name!r} but the {_PACKAGE_OF[name]} package is not installed; run "
                f"`pip install {_PACKAGE_OF[name]}` (or ./setup.sh, which installs the project's dependencies), "
                f"or drop {name!r} from metric_sinks")
    run_dir = Path(run_dir)
    made: dict[str, MetricSink] = {}
    for name in names:
        made[name] = TensorBoardSink(run_dir / "tensorboard") if name == "tensorboard" else WandbSink(run_dir, config)
    return MetricSinks(made)
