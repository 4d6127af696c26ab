"""Miles' records -> the run directory tiny-cpu writes: `metrics.jsonl` rows and `eval/step_XXXXXX.json`.

So the report, its plots and the nightly verdict (engines/runs/report.py, rl/verdict.py) read a cluster run exactly
as a tiny-cpu one. Steps count trained rollouts, as tiny-cpu's do:

  - row `step = R + 1` holds rollout R: the rollout side's `perf R` (rollout/response_len/*,
    rollout/truncated_ratio, perf/rollout_time), the trainer's `rollout R` (rollout/raw_reward, ...), its
    `step` lines for R (train/*; the mean when --num-steps-per-rollout > 1; Miles prints each twice, the copy
    is the same record) and its `perf R` (perf/*_time). A row is committed once R was trained (a `step`
    record) and a later record shows R is over; a rollout generated but never trained leaves no row.
  - `eval R` is the evaluation of the weights after R + 1 trained rollouts, except the evaluation before
    training that a run makes at its first rollout (train.py: `rollout_id == start_rollout_id`, logged
    before that rollout is generated), which is step R; an eval-only job (`--num-rollout 0`) logs `eval 0`
    for whatever it loaded, so its step is given (`eval_only_step`).

A resumed run starts again at rollout S = checkpoint + 1: rows past step S and evaluations past step S are
dropped before its first record (`begin`, RunLog.truncate_after), and a log that goes back to an earlier
rollout (one file appended by a killed and a resumed run) is read the same way. So each step keeps one row,
the one of the rollout that made the weights training continued from.

    rec = MilesRecorder(run_dir, eval_problems={"aime": 30}, n_samples_per_eval_prompt=8)
    rec.begin(resume.start_rollout_id); run_miles(..., on_record=rec.feed); rec.finish()
    record_log("miles.log", run_dir)       # the same from a log file, afterwards
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from engines.miles.metrics import RAY_JOB_SUBMITTED, MetricRecord, eval_datasets, parse_metric_line
from engines.runs.runlog import RunLog
from engines.runs.sinks import MetricSinks

ROLLOUT_KINDS = ("perf", "rollout", "multi_turn", "passrate")
"""Record kinds whose number is a rollout id (a `step` line's number is the accumulated train step)."""


class MilesResultsError(ValueError):
    """Miles' output lacks what the run directory needs (e.g. pass@k without --log-passrate); says the fix."""


@dataclass
class _Row:
    metrics: dict[str, float] = field(default_factory=dict)
    train: list[dict[str, float]] = field(default_factory=list)
    train_steps: set[int] = field(default_factory=set)


def eval_result(metrics: Mapping[str, float], *, primary: str | None = None,
                eval_problems: Mapping[str, int] | None = None, n_samples: int | None = None,
                source: str = "") -> dict[str, Any]:
    """One `eval N:` record as tiny-cpu's eval JSON body: the primary dataset's pass@k, truncated_ratio and
    response_len flat (what the report, plots and verdict read), every dataset under "datasets"."""
    datasets = eval_datasets(metrics)
    if not datasets:
        raise MilesResultsError(f"{source or 'eval record'}: no eval/<dataset>-none_reward_ratio in {sorted(metrics)}; "
                                "is this an `eval N:` line of Miles main?")
    name = primary or next(iter(datasets))
    if name not in datasets:
        raise MilesResultsError(f"{source}: no eval dataset {name!r} in Miles' record (it has {sorted(datasets)}); "
                                "use the name given to --eval-prompt-data")
    main = datasets[name]
    if not any(k.startswith("pass@") for k in main):
        raise MilesResultsError(f"{source}: Miles logged no eval/{name}-pass@k; the job must pass --log-passrate "
                                "(and --n-samples-per-eval-prompt > 1) for pass@k to be computed")
    result: dict[str, Any] = {k: v for k, v in main.items() if k.startswith("pass@")}
    result["truncated_ratio"] = main.get("truncated_ratio")
    result["response_len"] = main.get("response_len/mean")
    result["reward"] = main.get("reward")
    result["none_reward_ratio"] = main.get("none_reward_ratio")
    if eval_problems and name in eval_problems:
        result["n_problems"] = eval_problems[name]
    if n_samples:
        result["n_samples"] = n_samples
    result.update(dataset=name, datasets=datasets, source=source)
    return {k: v for k, v in result.items() if v is not None}


class MilesRecorder:
    """Feeds Miles' metric records into a RunLog, one row per trained rollout and one JSON per evaluation."""

    def __init__(self, run_dir: str | Path, *, num_steps_per_rollout: int = 1, eval_dataset: str | None = None,
                 eval_problems: Mapping[str, int] | None = None, n_samples_per_eval_prompt: int | None = None,
                 eval_only_step: int | None = None, sinks: MetricSinks | None = None,
                 log: Callable[[str], None] = lambda message: None) -> None:
        if num_steps_per_rollout < 1:
            raise ValueError(f"num_steps_per_rollout must be >= 1 (--num-steps-per-rollout), got {num_steps_per_rollout}")
        self.runlog = RunLog(run_dir, sinks=sinks)
        self.k = num_steps_per_rollout
        self.eval_dataset, self.eval_problems = eval_dataset, dict(eval_problems or {})
        self.n_samples, self.eval_only_step, self.log = n_samples_per_eval_prompt, eval_only_step, log
        self.rows: dict[int, _Row] = {}
        self.seen: set[int] = set()
        """Rollout ids this run has produced a record for (an eval of one of them is after training)."""
        self.started: int | None = None
        self.committed: list[int] = []
        self.evaluated: list[int] = []

    # ------------------------------------------------------------------------------------------ run bounds
    def begin(self, start_rollout_id: int) -> None:
        """A (resumed) run starts at `start_rollout_id`: forget what it will redo, on disk and here."""
        self.started = start_rollout_id
        self.rows = {r: row for r, row in self.rows.items() if r < start_rollout_id}
        self.seen = set()
        dropped = self.runlog.truncate_after(start_rollout_id)
        stale = [e["step"] for e in self.runlog.evals() if e["step"] > start_rollout_id]
        for step in stale:  # weights of a rollout the resumed run trains again: its evaluation is redone too
            (self.runlog.eval_dir / f"step_{step:06d}.json").unlink()
        if dropped or stale:
            self.log(f"resuming at rollout {start_rollout_id}: dropped {dropped} metrics rows and the evaluations "
                     f"of steps {stale} made after the checkpoint")

    def _rollout_of(self, record: MetricRecord) -> int:
        return record.index // self.k if record.kind.endswith("step") else record.index

    def new_run(self) -> None:
        """The next record starts a new Miles job (a `ray job submit` line in the log): begin at its rollout."""
        self.started = None

    def feed(self, record: MetricRecord) -> None:
        rollout = self._rollout_of(record)
        if self.eval_only_step is not None:  # `eval 0` of an eval-only job: weights it loaded, nothing trained
            if record.kind == "eval":
                self._write_eval(record, rollout)
            return
        if self.started is None:
            self.begin(rollout)
        elif self.seen and self._goes_back(record, rollout):
            self.begin(rollout)  # one log, two runs without a submission line between them
        if record.kind == "eval":
            self._commit(before=rollout + (1 if rollout in self.seen else 0))
            self._write_eval(record, rollout)
            return
        self._commit(before=rollout)
        self.seen.add(rollout)
        row = self.rows.setdefault(rollout, _Row())
        if record.kind.endswith("step"):
            if record.index not in row.train_steps:  # Miles prints every train step twice
                row.train_steps.add(record.index)
                row.train.append(record.metrics)
        elif record.kind in ROLLOUT_KINDS:
            row.metrics.update(record.metrics)

    def _goes_back(self, record: MetricRecord, rollout: int) -> bool:
        """A record only a new run can have made: an earlier rollout than this run reached, or the rollout side
        generating a rollout that was already trained. (A new run's evaluation before training at a rollout the
        old run trained but did not save looks like the old run's evaluation after it: only the submission
        line tells them apart, which run_miles' log has.)"""
        if rollout < max(self.seen):
            return True
        row = self.rows.get(rollout)
        return (record.kind == "perf" and row is not None and bool(row.train)
                and any(k.startswith("rollout/") for k in record.metrics))

    def finish(self) -> list[int]:
        """Commit every trained rollout still pending (the job ended); returns the steps committed so far."""
        self._commit(before=None)
        return self.committed

    # ---------------------------------------------------------------------------------------------- writing
    def _commit(self, *, before: int | None) -> None:
        for rollout in sorted(self.rows):
            if before is not None and rollout >= before:
                break
            row = self.rows.pop(rollout)
            if not row.train:
                continue  # generated, never trained (the job died or was stopped mid-rollout)
            train = {key: sum(m[key] for m in row.train if key in m) / sum(key in m for m in row.train)
                     for key in {k for m in row.train for k in m}}
            self.runlog.append_metrics(rollout + 1, {**row.metrics, **train})
            self.committed.append(rollout + 1)

    def _write_eval(self, record: MetricRecord, rollout: int) -> None:
        if self.eval_only_step is not None:
            step = self.eval_only_step
        else:
            step = rollout + 1 if rollout in self.seen else rollout
        result = eval_result(record.metrics, primary=self.eval_dataset, eval_problems=self.eval_problems,
                             n_samples=self.n_samples, source=f"miles eval {record.index}")
        self.runlog.write_eval(step, result)
        self.evaluated.append(step)


def record_lines(lines: Iterable[str], run_dir: str | Path, **recorder_kwargs: Any) -> MilesRecorder:
    """Every metric line of a Miles log (one or several runs appended) into run_dir; returns the recorder."""
    recorder = MilesRecorder(run_dir, **recorder_kwargs)
    for line in lines:
        if RAY_JOB_SUBMITTED.search(line):
            recorder.new_run()
        record = parse_metric_line(line)
        if record is not None:
            recorder.feed(record)
    recorder.finish()
    return recorder


def record_log(log_path: str | Path, run_dir: str | Path, **recorder_kwargs: Any) -> MilesRecorder:
    """record_lines over a log file run_miles wrote (`<run_id>.log`)."""
    path = Path(log_path)
    if not path.is_file():
        raise FileNotFoundError(f"Miles log {path} does not exist; run_miles writes it at MilesJob.log_path")
    with path.open(encoding="utf-8", errors="replace") as lines:
        return record_lines(lines, run_dir, **recorder_kwargs)
