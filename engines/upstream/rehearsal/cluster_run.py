"""The cluster path's own `ClusterRun` on this machine: a run of the `cluster-rehearsal` preset (the seed's Miles job
at the rehearsal's sizes), submitted by engines/miles/pipeline.py (`train_run`, `evaluate_step`, the alignment
gate's train-only job) to a local Ray head's Jobs API, v4rl's engine serving as the job's external SGLang.

`local_cluster` sets up what a cluster provides (the tiny FP8-expert checkpoint at the job's `hf_checkpoint` when it
is not there yet, the data under <work>/data, `v4rl serve-rollout` on 127.0.0.1, a Ray head with logical GPUs and
the Jobs API), prints the rehearsal's substitution table once, and yields a ClusterRun whose `adapt` turns each job
the preset builds into the rehearsal's job (engines/upstream/rehearsal/job.py `rehearsal_job`, stage full: the
seed's cluster job with each CPU substitution applied and listed), keeping the run's own numbers and paths
(RUN_FLAGS); everything it started is stopped when the block ends, Ctrl-C included. The flow enters it through
engines/backends/local_cluster.py; the job's --ref-load is the flow's conversion (the convert task writes it).

    job = MilesJob(run_id="r", hf_checkpoint=..., ref_load=..., save_dir=..., miles_dir="", log_dir=...)
    with local_cluster(work, job, run_dir=work / "run") as run:
        summary = train_run(run, 3)       # ONE `ray job submit` of Miles' train.py; metrics into run.run_dir
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engines.miles.command import MilesCommand, MilesJob
from engines.miles.jobs import flag_values, with_flags
from engines.miles.pipeline import ClusterRun
from engines.presets.runs import REHEARSAL_RUN
from engines.upstream.rehearsal.job import (RehearsalPaths, Substitution, flag_text, rehearsal_job,
                                              substitution_table)
from engines.upstream.rehearsal.ray_session import RaySession
from engines.upstream.rehearsal.submitted import WATCH_S, job_env

PRESET = REHEARSAL_RUN.name
"""The run preset whose job this cluster runs (engines/presets/runs.py REHEARSAL_RUN): its sizes are the rehearsal's,
so Miles' parser resolves the submitted argv to that preset's values (preflight compares them)."""
RUN_FLAGS = ("--num-rollout", "--rollout-batch-size", "--n-samples-per-prompt", "--global-batch-size",
             "--eval-interval", "--n-samples-per-eval-prompt", "--lr", "--save-interval", "--hf-checkpoint",
             "--ref-load", "--load", "--save", "--prompt-data", "--eval-prompt-data", "--input-key", "--label-key")
"""The run's own numbers and paths: the built job's values win over the rehearsal job's (equal at the preset's
defaults), so a flow run's steps, data and checkpoints are the ones Miles gets."""


def rehearsal_command(command: MilesCommand, *, preset, paths: RehearsalPaths, engine_addr: str, context_length: int,
                      layout: str, impl_args: list[str], env: dict[str, str], mark: str) -> MilesCommand:
    """The rehearsal's job (stage full) of `preset` in place of the built `command`, with the command's RUN_FLAGS
    kept (ClusterRun.prepare adapts the job before train_run / evaluate_step / align_argv set their per-submission
    flags on it) and the stage's environment (the bootstrap first on PYTHONPATH) as every rank's runtime env."""
    job = rehearsal_job(preset, paths, engine_addr=engine_addr, stage="full", context_length=context_length,
                        layout=layout)
    kept = {flag[2:].replace("-", "_"): values for flag in RUN_FLAGS
            if (values := flag_values(command.argv, flag)) is not None}
    return dataclasses.replace(command, argv=with_flags(job.argv + impl_args, **kept), env=job_env(env, mark))


@contextmanager
def local_cluster(work: Path, job: MilesJob, *, run_dir: str | Path, eval_interval: int = 1,
                  overrides: Mapping[str, Any] | None = None,
                  miles_dir: str | None = None, megatron_dir: str | None = None, dsv4_impl: str = "miles",
                  layout: str = "1", log=print) -> Iterator[ClusterRun]:
    """Set up the local cluster in `work` for `job` (its checkpoint, save and log paths; Miles and Megatron-LM are
    resolved here: the given checkouts, else the vendored pins, else $V4RL_MILES_DIR / $V4RL_MEGATRON_DIR), yield
    its ClusterRun, stop everything at the end. RehearsalError (one line) for a Miles or Megatron-LM that cannot
    run, a busy port or too little memory, before anything starts."""
    import uuid

    from engines.presets.runs import SEED_RUN
    from engines.upstream.rehearsal import run as r
    from engines.upstream.rehearsal.job import rehearsal_layout
    from engines.upstream.rehearsal.tiny_model import make_tiny_checkpoint

    r._require_memory(layout, rehearsal_layout(layout).memory_gib)
    miles, megatron, gen = r.resolve_trees(r.RehearsalRequest(miles_dir=miles_dir, megatron_dir=megatron_dir))
    impl_args = r._impl_args(miles, dsv4_impl)
    seed = dataclasses.replace(SEED_RUN, miles=dataclasses.replace(SEED_RUN.miles, generation=gen, dsv4_impl=dsv4_impl))
    work = Path(work).resolve()
    hf = Path(job.hf_checkpoint)
    if not (hf / "config.json").is_file():
        make_tiny_checkpoint(hf, expert_dtype="fp8")
    train, evals = r.write_data(work)
    paths = RehearsalPaths(hf, train, evals, work)
    engine_port, ray_port = r.free_port(0, "engine"), r.free_port(0, "ray")
    engine_addr = f"127.0.0.1:{engine_port}"
    context_length = r._context_length(hf)
    probe = rehearsal_job(seed, paths, engine_addr=engine_addr, stage="full", context_length=context_length,
                          layout=layout)
    env = {**r._stage_env("full", probe.env, miles, megatron, ray_port),  # with stage full's broadcast over gloo,
           "V4RL_REHEARSAL_BROADCASTS": str(work / "broadcasts"),         # each broadcast recorded (full.py)
           "V4RL_REHEARSAL_ENGINE_URL": f"http://{engine_addr}"}
    engine = ray = None
    ray_dir = r._ray_temp_dir(work)
    watching = threading.Event()
    try:
        engine = r._start_engine(hf, engine_port, work / "engine.log")
        threading.Thread(target=_stop_on_refusal, args=(work / "engine.log", run_dir, watching), daemon=True,
                         name="local-cluster-engine-watch").start()
        ray = RaySession(ray_dir, port=ray_port, **probe.ray, env=env, log=work / "ray.log", jobs_api=True, cwd=work)
        _record_started(work, {"ray start": ray.process.pid, "serve-rollout": engine.pid}, ray_dir)
        log(f"local cluster: v4rl's engine {engine_addr}, Ray head {ray.address} (Jobs API {ray.jobs_address}), "
            f"Miles {miles} (generation {gen}), Megatron-LM {megatron}")
        generation = {"miles_generation": gen, "dsv4_impl": dsv4_impl}  # the checkout's, whatever the caller assumed
        adapt = _Adapt(seed, paths, engine_addr, context_length, layout, impl_args, env, uuid.uuid4().hex)
        run = ClusterRun(preset=PRESET, job=dataclasses.replace(job, miles_dir=str(miles), megatron_dir=str(megatron),
                                                                data_dir=str(work / "data")),
                         site=ray.site(), run_dir=str(run_dir), eval_interval=eval_interval,
                         overrides={**(overrides or {}), **generation},
                         align_sglang_url=f"http://{engine_addr}", adapt=adapt)
        rows = run_rows(probe.substitutions + r._impl_rows(probe.argv, impl_args), run.prepare().command.argv)
        log(f"cluster-rehearsal: the seed's Miles job with these CPU substitutions (docs/rehearsal.md):\n"
            f"{substitution_table(rows)}")
        yield run
    finally:
        watching.set()
        r.stop_session(ray, engine, ray_dir, work)
        (work / STARTED).unlink(missing_ok=True)


STARTED = "started.json"
"""<work>/started.json: the process groups the local cluster runs (by what their leader's command line holds) and
its Ray temp dir, while it runs; `stop_local_cluster` ends them when the flow process could not (it was killed)."""


def _record_started(work: Path, groups: dict[str, int], ray_dir: Path) -> None:
    tmp = work / (STARTED + ".tmp")
    tmp.write_text(json.dumps({"groups": groups, "ray_dir": str(ray_dir)}))
    tmp.replace(work / STARTED)


def stop_local_cluster(work: str | Path) -> list[str]:
    """SIGKILL the process groups a local cluster in `work` left running (its flow process was killed before its
    own stop: Prefect's runner kills a cancelled flow 30 s after SIGTERM) and remove its Ray temp dir; returns what
    was stopped. A group whose leader no longer runs that command (the PID reused) is left alone."""
    import os
    import shutil
    import signal

    import psutil

    record_path = Path(work) / STARTED
    if not record_path.is_file():
        return []
    record = json.loads(record_path.read_text())
    stopped = []
    for command, pgid in record["groups"].items():
        try:
            if command in " ".join(psutil.Process(pgid).cmdline()):
                os.killpg(pgid, signal.SIGKILL)
                stopped.append(f"{command} (process group {pgid})")
        except (psutil.Error, ProcessLookupError):
            continue
    if not Path(record["ray_dir"]).is_relative_to(Path(work)):
        shutil.rmtree(record["ray_dir"], ignore_errors=True)
    record_path.unlink(missing_ok=True)
    return stopped


def _stop_on_refusal(engine_log: Path, run_dir: str | Path, done: threading.Event) -> None:
    """The engine's first refused request (a weight update it cannot take: the tensor and why) stops the run's
    training, naming it (engines/runs/stopping.py: the runner `ray job stop`s the job, not retried), where Miles would
    retry the request for a minute and a task retry would resubmit the same defect."""
    from engines.runs.stopping import request_stop
    from engines.upstream.rehearsal.run import _RefusalWatch

    refusals = _RefusalWatch(engine_log)
    while not done.wait(WATCH_S):
        refusal = refusals.first()
        if refusal:
            request_stop(run_dir, f"v4rl's engine (the job's SGLang) refused Miles' request: {refusal} "
                                  f"(engine log: {engine_log})")
            return


def run_rows(subs: list[Substitution], argv: list[str]) -> list[Substitution]:
    """The substitution rows with the submitted job's values of RUN_FLAGS (the run's own paths and numbers); a row
    whose value is then the cluster's drops out."""
    out = []
    for sub in subs:
        if sub.name in RUN_FLAGS:
            shown = flag_text(flag_values(argv, sub.name))
            if shown == sub.cluster:
                continue
            sub = dataclasses.replace(sub, rehearsal=shown)
        out.append(sub)
    return out


@dataclasses.dataclass(frozen=True)
class _Adapt:
    """ClusterRun.adapt of the local cluster: a picklable `rehearsal_command` with this setup's values."""

    preset: object
    paths: RehearsalPaths
    engine_addr: str
    context_length: int
    layout: str
    impl_args: list[str]
    env: dict[str, str]
    mark: str

    def __call__(self, command: MilesCommand) -> MilesCommand:
        return rehearsal_command(command, preset=self.preset, paths=self.paths, engine_addr=self.engine_addr,
                                 context_length=self.context_length, layout=self.layout, impl_args=self.impl_args,
                                 env=self.env, mark=self.mark)
