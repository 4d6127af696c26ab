"""The Miles backend (`Backend`): the rl-pipeline's steps as Miles jobs on the existing Ray cluster
(engines/miles/pipeline.py), nothing of the model loaded on this host but the conversion and its check. An
adapter: each step is one call into engines/miles/.

    check      the job exactly as it will be submitted, through Miles' own parse_args on CPU
               (upstream/miles_preflight.py), the model keys Miles builds against the checkpoint
               (upstream/miles_model_check.py) and, given `sglang_dir`, the SGLang the cluster runs taking one weight
               update as a fresh load (upstream/sglang_preflight.py)
    align      `align_gate` (here: engines/align sits above engines/train, so the gate's wiring to a ClusterRun
               lives in the adapter): SGLang generates, Megatron rescores through Miles' train-only debug run
    train      miles/pipeline.py `train_run`: ONE Miles job trains the run, evaluating and saving itself
    evaluate   miles/pipeline.py `evaluate_step`: Miles' record of the step, else its eval-only job

flows/params.py `PipelineParams.backend` builds it for a GPU preset from the deployment's parameters (Site,
MilesJob paths, preset overrides); it crosses the Prefect task boundary as this typed object.

    backend = PipelineParams.preset_defaults("dsv4-flash-mi355x", ...).backend()
    backend.check(log=print)        # MilesRejected / SiteError before anything is submitted
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.miles.jobs import align_argv, flag_values
from engines.miles.pipeline import ClusterRun, evaluate_step, train_run
from engines.runs.stopping import StopRequest


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


def align_gate(run: ClusterRun, config: Any, *, on_line: Callable[[str], None] | None = None) -> dict:
    """The cluster alignment gate (engines/align/cluster.py) on this run's job: `config.n_prompts` held-out
    prompts x the job's --n-samples-per-prompt on SGLang, then Megatron through Miles' train-only debug run."""
    from transformers import AutoTokenizer

    from engines.align.cluster import gate_batch, score_batch
    from engines.align.inputs import held_out_prompts
    from engines.rollout.sglang import SGLangClient

    t0 = time.perf_counter()
    prepared = run.prepare()
    n = int((flag_values(prepared.command.argv, "--n-samples-per-prompt") or ["1"])[0])
    config = gate_config(config, prepared.command.argv)
    tokenizer = AutoTokenizer.from_pretrained(run.job.hf_checkpoint)  # tokenizer files only, no weights
    prompts = held_out_prompts(tokenizer, config.n_prompts, config.seed, tokenizer.bos_token_id)
    shared = Path(f"{run.job.save_dir}-align-gate")  # beside --save: on storage every node of the job reads
    with _sglang_server(run) as url, SGLangClient(url, timeout=3600) as client:
        samples = gate_batch(client, prompts, config, shared_dir=shared, n_samples_per_prompt=n,
                             decode=tokenizer.decode)
    generated = round(time.perf_counter() - t0, 3)

    def run_align_job(rollout_data: str, train_dump: str) -> None:
        run.submit(prepared, align_argv(prepared.command.argv, rollout_data=rollout_data, train_dump=train_dump,
                                        n_prompts=config.n_prompts), on_line=on_line)

    return score_batch(samples, config, shared_dir=shared, run_align_job=run_align_job, seconds={"generate": generated},
                       inputs={"model": run.job.hf_checkpoint, "torch_dist": run.job.ref_load, "sglang": url})


def gate_config(config: Any, argv: list[str]) -> Any:
    """The gate's AlignConfig at the job's --rollout-temperature: Miles' trainer divides the logits by it before
    its log-softmax (miles/backends/training_utils/loss_hub/logit_processors.py), and SGLang returns the logprobs of
    the temperature it sampled at, so both sides are scored at that one temperature (found by the cluster-rehearsal:
    sampled at 1.0 against the seed's 0.8, the tiny model's |dlogprob| was 0.103, 20x the bf16 noise)."""
    temperature = flag_values(argv, "--rollout-temperature")
    return dataclasses.replace(config, temperature=float(temperature[0])) if temperature else config


class _sglang_server:
    """The given SGLang URL, or one engine launched on the Ray cluster this host belongs to (ray.init("auto"),
    the preset's engine size) for the gate's generation; stopped when the block ends, before Megatron runs."""

    def __init__(self, run: ClusterRun) -> None:
        self.run, self.fleet, self.connected = run, None, False

    def __enter__(self) -> str:
        if self.run.align_sglang_url:
            return self.run.align_sglang_url
        import ray

        from engines.profiles import get_profile
        from engines.rollout.launcher import SGLangServerSpec, launch_sglang_servers
        from engines.presets.runs import resolve

        preset, _ = resolve(self.run.preset, self.run.overrides)
        if not ray.is_initialized():
            ray.init(address="auto")
            self.connected = True
        spec = SGLangServerSpec.from_preset(self.run.job.hf_checkpoint, preset, get_profile(preset.profile))
        self.fleet = launch_sglang_servers(spec, 1)
        return self.fleet.urls[0]

    def __exit__(self, *exc: object) -> None:
        try:
            if self.fleet is not None:
                self.fleet.stop()
        finally:
            if self.connected:
                import ray

                ray.shutdown()  # this host's connection only; the user's cluster keeps running


def check_miles_job(backend: MilesBackend, *, log: Callable[[str], None]) -> dict[str, Any]:
    """Build the job as run_job will and run Miles' parse_args on it, then check the model keys Miles builds
    against the checkpoint; MilesRejected (not retried) when refused, SiteError naming a missing site parameter."""
    from engines.presets.runs import resolve
    from engines.profiles import get_profile
    from engines.upstream.miles_model_check import check_job_model_keys
    from engines.upstream.miles_preflight import MilesRejected, check_command

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
    (engines/upstream/sglang_preflight.py); SGLangUpdateRejected (not retried) naming the parameter when not."""
    from engines.upstream.sglang_preflight import SGLangUpdateRejected, check, summary

    result = check(preset, dict(overrides), sglang_dir)
    if not result.ok:
        raise SGLangUpdateRejected(summary(result))
    log(summary(result))
    return result.to_json()
