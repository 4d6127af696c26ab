"""The cluster path's pipeline steps, each one Miles job (jobs.py) on the existing Ray cluster, called by the
rl-pipeline's tasks exactly where the tiny-cpu path calls the embedded engines:

    train_run(run, steps)       ONE Miles job trains the whole run: rollouts [resume point, steps) through --load,
                                evaluating itself before training and every eval_interval rollouts, saving every
                                --save-interval and at the end; its records land in the run directory as
                                tiny-cpu's do (results.py), live, while the job runs, so the flow publishes each
                                evaluation as it lands. A failed job is resubmitted by the task's retry from the
                                last complete checkpoint (Miles' rule: tracker + 1); rows and evaluations past it
                                are dropped first (MilesRecorder.begin), so each step is recorded once
    evaluate_step(run, step)    the step's eval/step_XXXXXX.json: the one Miles logged, else Miles' eval-only job
                                on the step's checkpoint (step 0: --ref-load, our converted checkpoint); the
                                pipeline never needs it (Miles evaluates in the training job), a user may

engines/backends/miles.py `MilesBackend` calls these for the rl-pipeline's tasks (and runs the cluster alignment
gate on a ClusterRun: engines/align sits above engines/train, so the gate's wiring lives there, not here); flows/params.py `PipelineParams.backend` builds
its ClusterRun from the flow's parameters (the deployment's Site, the MilesJob paths, the preset overrides). Everything that submits needs the cluster
(`gpu`-marked tests); the argv, the readback and the gate's files are tested on CPU against Miles' own code.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engines.profiles.site import Site
from engines.miles.checkpoints import list_checkpoints
from engines.miles.command import MilesCommand, MilesJob
from engines.miles.jobs import eval_only_argv, flag_values, run_argv
from engines.miles.results import MilesRecorder, MilesResultsError
from engines.miles.runner import (MilesOutcome, MilesRunError, PreparedJob, prepare_job, ray_job_logs, run_miles,
                                  stop_ray_job, wait_job_actors)
from engines.miles.submit import submit_argv
from engines.runs.stopping import StopRequest

LIVE_JOB = "miles-job.json"
"""<run_dir>/miles-job.json: the Ray job a training task has running ({"ray_job_id", "ray_address"}), removed
when it ends; a cancelled flow run's hook stops it from there if the flow process could not (`stop_live_job`)."""

@dataclass(frozen=True, kw_only=True)
class ClusterRun:
    """One rl-pipeline run on the cluster: the Miles job and where its results go."""

    preset: str
    """Run preset name (engines.presets.runs)."""
    job: MilesJob
    """Paths of the Miles job; save_dir is kept across flow runs, which is what makes them resume."""
    site: Site
    """RAY_ADDRESS, MASTER_ADDR, interfaces: preflight fails naming the missing deployment parameter."""
    run_dir: str
    """This host's run directory: metrics.jsonl, eval/, the Miles log."""
    eval_interval: int
    """Miles evaluates every this many rollouts (--eval-interval), and before training."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Planner overrides of the preset (engines.presets.runs OVERRIDES keys)."""
    align_sglang_url: str | None = None
    """An SGLang server serving hf_checkpoint for the alignment gate; None: launch one here (a GPU host)."""
    idle_timeout_s: float = 3600.0
    """Kill a job that prints nothing this long (a stalled collective), and stop its Ray job."""
    adapt: Callable[[MilesCommand], MilesCommand] | None = None
    """Applied to every built command before it is checked or submitted: the rehearsal's CPU substitutions
    (engines/upstream/rehearsal/cluster_run.py); None on a cluster."""

    def prepare(self) -> PreparedJob:
        prepared = prepare_job(self.preset, self.job, site=self.site, overrides=self.overrides)
        if self.adapt is None:
            return prepared
        command = self.adapt(prepared.command)
        return dataclasses.replace(prepared, command=command, submit_argv=submit_argv(command, self.site))

    def recorder(self, argv: list[str], **kwargs: Any) -> MilesRecorder:
        """A recorder set up from the job's own flags: eval datasets, samples per eval prompt, steps per rollout."""
        datasets = flag_values(argv, "--eval-prompt-data") or []
        pairs = dict(zip(datasets[0::2], datasets[1::2]))
        samples = flag_values(argv, "--n-samples-per-eval-prompt")
        steps = flag_values(argv, "--num-steps-per-rollout")
        return MilesRecorder(self.run_dir, num_steps_per_rollout=int(steps[0]) if steps else 1,
                             eval_dataset=next(iter(pairs), None), eval_problems=_rows_here(pairs),
                             n_samples_per_eval_prompt=int(samples[0]) if samples else None, **kwargs)

    def submit(self, prepared: PreparedJob, argv: list[str], *, recorder: MilesRecorder | None = None,
               expect_start_rollout: int | None = None, on_line: Callable[[str], None] | None = None,
               stop: StopRequest | None = None, timeout_s: float | None = None) -> MilesOutcome:
        """Run `argv` as the job's train.py argv on the cluster, recording its metric lines; a set `stop` ends it
        (`ray job stop`), as does running past `timeout_s` (None: no limit but idle_timeout_s)."""
        command = dataclasses.replace(prepared.command, argv=list(argv))
        try:
            return run_miles(submit_argv(command, self.site), log_path=self.job.log_path, env=prepared.submit_env,
                             idle_timeout_s=self.idle_timeout_s, timeout_s=timeout_s, on_line=on_line,
                             on_record=recorder.feed if recorder else None, expect_start_rollout=expect_start_rollout,
                             stop=stop, on_job=self._record_live_job,
                             stop_job=functools.partial(stop_ray_job, ray_cli=self.site.ray_cli),
                             job_logs=functools.partial(ray_job_logs, ray_cli=self.site.ray_cli),
                             job_actors=functools.partial(wait_job_actors, ray_cli=self.site.ray_cli))
        finally:
            if recorder is not None:
                recorder.finish()  # what was trained before a failure is committed; a resume drops the rest

    def _record_live_job(self, job_id: str | None) -> None:
        path = Path(self.run_dir) / LIVE_JOB
        if job_id is None:
            path.unlink(missing_ok=True)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"ray_job_id": job_id, "ray_address": self.site.resolved_ray_address,
                                   "ray_cli": self.site.ray_cli}))
        tmp.replace(path)


def _rows_here(datasets: Mapping[str, str]) -> dict[str, int]:
    """Problems per eval dataset, for the datasets readable on this host (JSONL rows); others are left out."""
    out = {}
    for name, path in datasets.items():
        p = Path(path)
        if p.is_file() and p.suffix == ".jsonl":
            with p.open(encoding="utf-8") as f:
                out[name] = sum(1 for line in f if line.strip())
    return out


def train_run(run: ClusterRun, steps: int, *, on_line: Callable[[str], None] | None = None,
              stop: StopRequest | None = None) -> dict[str, Any]:
    """One Miles job trains the run to rollout `steps`, resuming where the save directory says (checkpoints.py).

    Miles evaluates the weights it starts from unless that step's evaluation is already recorded (a resubmission
    after a failure), then every eval_interval rollouts; the records land live (results.py). Raises MilesRunError
    (with `.retryable`) when the job fails or ends without its last save."""
    prepared = run.prepare()
    start = prepared.resume.start_rollout_id
    say = on_line or (lambda message: None)
    for note in prepared.resume.notes:
        say(f"resume: {note}")
    recorder = run.recorder(prepared.command.argv, log=say)
    recorder.begin(start)
    lost = sorted(set(range(1, start + 1)) - {row["step"] for row in recorder.runlog.metrics()})
    if lost:  # a job that died after saving a rollout whose lines never reached the head's log
        say(f"steps {lost} are trained (their checkpoint is in --save, training continues from it) but their "
            f"records never reached this host (the job died before its log had them): metrics.jsonl lacks them")
    if start >= steps:  # trained; a job that died after its last save may not have evaluated it (Miles' own order)
        evaluated = [] if (Path(run.run_dir) / "eval" / f"step_{steps:06d}.json").exists() else \
            [evaluate_step(run, steps, on_line=on_line)["step"]]
        return {"resumed_from": start, "last_step": start, "skipped": True, "steps": [], "evaluated": evaluated}
    evaluated = (Path(run.run_dir) / "eval" / f"step_{start:06d}.json").exists()
    if start:
        say(f"resuming at rollout {start} from iter_{start - 1:07d} (Miles: tracker + 1)"
            + ("; its evaluation is recorded, so Miles skips the evaluation before training" if evaluated else ""))
    argv = run_argv(prepared.command.argv, steps=steps, eval_interval=run.eval_interval, evaluate_first=not evaluated)
    outcome = run.submit(prepared, argv, recorder=recorder, expect_start_rollout=start or None, on_line=on_line,
                         stop=stop)
    saved = [c.iteration for c in list_checkpoints(run.job.save_dir) if c.complete]
    if steps - 1 not in saved:
        raise MilesRunError(f"Miles ended the run without saving rollout {steps - 1} (iter_{steps - 1:07d} in "
                            f"{run.job.save_dir}); its last save is its final checkpoint", outcome)
    return {"resumed_from": start, "last_step": steps, "steps": recorder.committed, "evaluated": recorder.evaluated,
            "seconds": outcome.seconds, "log": str(outcome.log_path), "ray_job_id": outcome.ray_job_id}


def stop_live_job(run_dir: str | Path) -> str | None:
    """`ray job stop` the Ray job a training task of this run left running (<run_dir>/miles-job.json), if any;
    returns its id. For a cancelled flow run whose process was killed before it could stop the job itself."""
    path = Path(run_dir) / LIVE_JOB
    if not path.is_file():
        return None
    live = json.loads(path.read_text())
    env = {"RAY_ADDRESS": live["ray_address"]} if live.get("ray_address") else None
    if stop_ray_job(live["ray_job_id"], env, ray_cli=live.get("ray_cli", "ray")):
        path.unlink(missing_ok=True)
    return live["ray_job_id"]


def evaluate_step(run: ClusterRun, step: int, *, on_line: Callable[[str], None] | None = None) -> dict[str, Any]:
    """eval/step_XXXXXX.json for `step` (Miles' own record), running Miles' eval-only job when it is missing."""
    path = Path(run.run_dir) / "eval" / f"step_{step:06d}.json"
    if path.exists():
        return json.loads(path.read_text())
    where: dict[str, Any] = {}
    if step > 0:
        kept = {c.iteration for c in list_checkpoints(run.job.save_dir) if c.complete}
        if step - 1 not in kept:
            raise MilesResultsError(f"step {step} has no evaluation and its checkpoint iter_{step - 1:07d} is not in "
                                    f"{run.job.save_dir} (kept: {sorted(kept)}; pruned by --save-retain-interval?); "
                                    "evaluate at a kept step, or keep more checkpoints")
        where = {"checkpoint_dir": run.job.save_dir, "iteration": step - 1}
    prepared = run.prepare()
    argv = eval_only_argv(prepared.command.argv, **where)
    recorder = run.recorder(argv, eval_only_step=step)
    run.submit(prepared, argv, recorder=recorder, on_line=on_line)
    if step not in recorder.evaluated:
        raise MilesResultsError(f"Miles' eval-only job logged no `eval 0:` line for step {step}; see {run.job.log_path}")
    return json.loads(path.read_text())
