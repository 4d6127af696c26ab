"""The cluster path's own `ClusterRun` on this machine: the preset's Miles job, with the rehearsal's CPU
substitutions, submitted by engines/miles/pipeline.py's `train_run` and `evaluate_step` to a local Ray head's Jobs
API, v4rl's engine serving as the job's external SGLang (the alignment gate's job would go through the same
`ClusterRun.prepare`; not run here yet).

`rehearsal_cluster_run` sets up what a cluster provides (the tiny FP8-expert checkpoint as `hf_checkpoint`, v4rl's
torch_dist conversion of it as `--ref-load`, the data, `v4rl serve-rollout` on 127.0.0.1, a Ray head with logical
GPUs and the Jobs API) and yields a ClusterRun whose `adapt` turns each job the preset builds into the rehearsal's
job of that preset (engines/upstream/rehearsal/job.py `rehearsal_job`, stage full: the cluster job with each CPU
substitution applied and listed); everything it started is stopped when the block ends, Ctrl-C included.

    with rehearsal_cluster_run(SEED_RUN, work) as run:
        summary = train_run(run, 3)       # ONE `ray job submit` of Miles' train.py; metrics into run.run_dir
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from engines.miles.command import MilesCommand, MilesJob
from engines.miles.pipeline import ClusterRun
from engines.upstream.rehearsal.job import RehearsalPaths, rehearsal_job
from engines.upstream.rehearsal.ray_session import RaySession
from engines.upstream.rehearsal.submitted import job_env


def rehearsal_command(command: MilesCommand, *, preset, paths: RehearsalPaths, engine_addr: str, context_length: int,
                      layout: str, impl_args: list[str], env: dict[str, str], mark: str) -> MilesCommand:
    """The rehearsal's job (stage full) of `preset` in place of the cluster's built `command` (ClusterRun.prepare
    adapts the job before train_run / evaluate_step set their per-submission flags on it: --num-rollout,
    --skip-eval-before-train, ...), with the stage's environment (the bootstrap first on PYTHONPATH) as every
    rank's runtime env."""
    job = rehearsal_job(preset, paths, engine_addr=engine_addr, stage="full", context_length=context_length,
                        layout=layout)
    return dataclasses.replace(command, argv=job.argv + impl_args, env=job_env(env, mark))


@contextmanager
def rehearsal_cluster_run(preset, work: Path, *, miles_dir: str | None = None, megatron_dir: str | None = None,
                          dsv4_impl: str | None = None, layout: str = "1", eval_interval: int = 1,
                          log=print) -> Iterator[ClusterRun]:
    """Set up the local cluster for `preset`'s job in `work`, yield its ClusterRun, stop everything at the end."""
    import uuid

    from engines.upstream.rehearsal import run as r
    from engines.upstream.rehearsal.tiny_model import make_tiny_checkpoint

    miles, megatron, gen = r.resolve_trees(r.RehearsalRequest(miles_dir=miles_dir, megatron_dir=megatron_dir))
    impl_args = r._impl_args(miles, dsv4_impl)
    preset = dataclasses.replace(preset, miles=dataclasses.replace(preset.miles, generation=gen))
    work = Path(work).resolve()
    hf = work / "hf-fp8-experts"
    if not (hf / "config.json").is_file():
        make_tiny_checkpoint(hf, expert_dtype="fp8")
    train, evals = r.write_data(work)
    r._convert_ref(hf, work / "ref", miles, log)
    paths = RehearsalPaths(hf, train, evals, work)
    engine_port, ray_port = r.free_port(0, "engine"), r.free_port(0, "ray")
    probe = rehearsal_job(preset, paths, engine_addr=f"127.0.0.1:{engine_port}", stage="full",
                          context_length=r._context_length(hf), layout=layout)
    env = {**r._stage_env("full", probe.env, miles, megatron, ray_port),  # with stage full's broadcast over gloo,
           "V4RL_REHEARSAL_BROADCASTS": str(work / "broadcasts"),         # each broadcast recorded (full.py)
           "V4RL_REHEARSAL_ENGINE_URL": f"http://127.0.0.1:{engine_port}"}
    engine = ray = None
    ray_dir = r._ray_temp_dir(work)
    try:
        engine = r._start_engine(hf, engine_port, work / "engine.log")
        ray = RaySession(ray_dir, port=ray_port, **probe.ray, env=env, log=work / "ray.log", jobs_api=True, cwd=work)
        log(f"local cluster: v4rl's engine 127.0.0.1:{engine_port}, Ray head {ray.address} (Jobs API "
            f"{ray.jobs_address}), Miles {miles} (generation {gen})")
        job = MilesJob(run_id="miles", hf_checkpoint=str(hf), ref_load=str(work / "ref"), save_dir=str(work / "save"),
                       miles_dir=str(miles), megatron_dir=str(megatron), data_dir=str(work / "data"),
                       log_dir=str(work))
        adapt = _Adapt(preset, paths, f"127.0.0.1:{engine_port}", r._context_length(hf), layout, impl_args, env,
                       uuid.uuid4().hex)
        yield ClusterRun(preset=preset.name, job=job, site=ray.site(), run_dir=str(work / "run"),
                         eval_interval=eval_interval, adapt=adapt)
    finally:
        r.stop_session(ray, engine, ray_dir, work)


@dataclasses.dataclass(frozen=True)
class _Adapt:
    """ClusterRun.adapt of the rehearsal: a picklable `rehearsal_command` with this setup's values."""

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
