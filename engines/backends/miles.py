"""The Miles backend (`Backend`): the rl-pipeline's steps as Miles jobs on the existing Ray cluster
(engines/train/miles/pipeline.py), nothing of the model loaded on this host but the conversion and its check. An
adapter: each step is one call into engines/train/miles/.

    check      the job exactly as it will be submitted, through Miles' own parse_args on CPU (miles/preflight.py),
               the model keys Miles builds against the checkpoint (miles/model_check.py) and, given `sglang_dir`, the
               SGLang the cluster runs taking one weight update as a fresh load (engines/checks/sglang_preflight.py)
    align      miles/pipeline.py `align_gate`: SGLang generates, Megatron rescores through Miles' train-only debug run
    train      miles/pipeline.py `train_run`: ONE Miles job trains the run, evaluating and saving itself
    evaluate   miles/pipeline.py `evaluate_step`: Miles' record of the step, else its eval-only job

flows/params.py `PipelineParams.backend` builds it for a GPU preset from the deployment's parameters (Site,
MilesJob paths, preset overrides); it crosses the Prefect task boundary as this typed object.

    backend = PipelineParams.preset_defaults("dsv4-flash-mi355x", ...).backend()
    backend.check(log=print)        # MilesRejected / SiteError before anything is submitted
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.train.miles.pipeline import ClusterRun, align_gate, evaluate_step, train_run
from engines.train.stopping import StopRequest


@dataclass(frozen=True, kw_only=True)
class MilesBackend:
    """The Miles engines of one run: the job and where its results go, and what preflight checks it against."""

    run: ClusterRun
    """The Miles job of the run (pipeline.py), its run directory and eval interval."""
    steps: int
    """Rollouts of the whole run (--num-rollout)."""
    megatron_names: str = "plugin"
    """torch_dist key names of the cluster's Miles generation: plugin (generation 1) or megatron (generation 2)."""
    miles_dir: str | None = None
    """Miles checkout on this host for preflight's parse_args check (None: the pinned sources)."""
    megatron_dir: str | None = None
    """Megatron-LM checkout on this host for the same check (None: the pinned sources)."""
    sglang_dir: str | None = None
    """SGLang source the cluster runs, checked on CPU for online-update fidelity (None: not checked)."""

    @property
    def run_dir(self) -> str:
        return self.run.run_dir

    @property
    def cpu_steps(self) -> tuple[str, ...]:
        return ("convert", "verify")

    @property
    def overrides(self) -> Mapping[str, Any]:
        return self.run.overrides

    @property
    def eval_task(self) -> str:
        return "miles-eval"

    def check(self, *, log: Callable[[str], None]) -> dict[str, Any]:
        out = {"miles": check_miles_job(self, log=log)}
        if self.sglang_dir:
            out["sglang_model"] = check_sglang_update(self.run.preset, self.run.overrides, self.sglang_dir, log=log)
        return out

    def align(self, hf_dir: str, torch_dist_dir: str, config: Any, *, log: Callable[[str], None]) -> dict[str, Any]:
        # the job's own hf_checkpoint and --ref-load are what the cluster reads; they are the flow's hf_dir/torch_dist
        return align_gate(self.run, config, on_line=log)

    def train(self, *, log: Callable[[str], None], on_step: Callable[[int, dict], None],
              stop: StopRequest) -> dict[str, Any]:
        summary = train_run(self.run, self.steps, on_line=log, stop=stop)
        on_step(summary["last_step"], {})  # the job's rows land in metrics.jsonl; progress is reported at its end
        return summary

    def evaluate(self, step: int, model_dir: str, *, log: Callable[[str], None]) -> dict[str, Any]:
        return evaluate_step(self.run, step, on_line=log)


def check_miles_job(backend: MilesBackend, *, log: Callable[[str], None]) -> dict[str, Any]:
    """Build the job as run_job will and run Miles' parse_args on it, then check the model keys Miles builds
    against the checkpoint; MilesRejected (not retried) when refused, SiteError naming a missing site parameter."""
    from engines.presets.runs import resolve
    from engines.profiles import get_profile
    from engines.train.miles.model_check import check_job_model_keys
    from engines.train.miles.preflight import MilesRejected, check_command

    run = backend.run
    prepared = run.prepare()  # SiteError / InfeasibleLayout / a config error, each naming the fix
    eff, inp = resolve(run.preset, dict(run.overrides))
    data_here = Path(run.job.data_dir).is_dir()  # dataset files are checked where this host sees the cluster's disk
    if not data_here:
        log(f"warning: data_dir {run.job.data_dir} is not on this host: the preset's dataset files are not checked "
            "here")
    check = check_command(prepared.command, eff, run.job, cluster=inp.cluster, profile=get_profile(eff.profile),
                          miles_dir=backend.miles_dir, megatron_dir=backend.megatron_dir, check_data=data_here)
    if not check.ok:
        raise MilesRejected(check.summary())
    log(f"{check.summary()} (Megatron-LM {check.megatron_dir}; stubbed GPU-only modules: {len(check.stubbed)})")
    keys = check_job_model_keys(eff, run.job, miles_dir=backend.miles_dir, megatron_dir=backend.megatron_dir)
    if not keys.ok:
        raise MilesRejected(keys.summary())
    log(keys.summary())
    return {"accepted": True, "miles_dir": check.miles_dir, "argv": prepared.command.argv,
            "submit": prepared.submit_argv[:5]}


def check_sglang_update(preset: str, overrides: Mapping[str, Any], sglang_dir: str, *,
                        log: Callable[[str], None]) -> dict[str, Any]:
    """The SGLang the cluster will run, on CPU: one update in the job's setting must reproduce a fresh load
    (engines/checks/sglang_preflight.py); SGLangUpdateRejected (not retried) naming the parameter when not."""
    from engines.checks.sglang_preflight import SGLangUpdateRejected, check, summary

    result = check(preset, dict(overrides), sglang_dir)
    if not result.ok:
        raise SGLangUpdateRejected(summary(result))
    log(summary(result))
    return result.to_json()
