"""The rl-pipeline flow, read top to bottom as DESIGN.md's data flow:

    preflight -> convert -> verify -> align -> evaluate(base)
    for each segment of eval_interval steps:  train (retryable, resumes) -> evaluate -> upload
    report -> upload

The same body for every preset: the preset picks the engines (engines/backends.py). tiny-cpu trains and
evaluates with the embedded engines here; a GPU preset runs each segment as a Miles job on the existing Ray
cluster (which evaluates at the segment's end), aligns with SGLang + Megatron there, and lands its metrics and
evaluations in the same run directory, report and nightly verdict.

Every step is a Prefect task or subflow: retried where a retry can help, cached across flow runs where the
work is deterministic (conversion by source identity, finished training segments by run key), so a new flow
run after a crash skips what is done and resumes training at the last checkpoint.

    prefect deployment run 'rl-pipeline/tiny-cpu'          # through deployments/prefect.yaml
    python -m flows.rl_pipeline                             # a local run with the tiny-cpu defaults
"""

from __future__ import annotations

import dataclasses

from prefect import flow, get_run_logger
from prefect.artifacts import create_progress_artifact

from flows.evaluate import evaluate
from flows.params import PipelineParams
from rl.loop import segment_ends
from tasks.align import align
from tasks.checkpoint import convert, verify
from tasks.preflight import preflight
from tasks.report import publish_report
from tasks.train import train_segment
from tasks.upload import upload_artifacts


def _train_config(p: PipelineParams) -> dict:
    """What one training segment runs: the embedded trainer's TrainRunConfig, or the Miles job's settings."""
    cluster = _miles(p)
    if cluster is not None:
        return {"engine": "miles", "cluster": cluster, "steps": p.steps}
    from engines.train.run import TrainRunConfig
    from rl.loop import LoopConfig

    loop = LoopConfig(prompts_per_step=p.prompts_per_step, n_samples=p.n_samples, eval_interval=0,
                      eval_samples=p.eval_samples, seed=p.seed, dynamic_sampling=False)
    cfg = TrainRunConfig(base=p.hf_checkpoint, steps=p.steps, save_interval=p.eval_interval, n_eval=p.n_eval,
                         lr=p.lr, loop=loop, use_ray=p.use_ray, metric_sinks=list(p.metric_sinks),
                         train_data=p.train_data, eval_data=p.eval_data,
                         max_grader_error_ratio=p.max_grader_error_ratio, reward=p.reward, eval_reward=p.eval_reward)
    return dataclasses.asdict(cfg)


@flow(name="rl-pipeline", log_prints=True)
def rl_pipeline(params: PipelineParams = PipelineParams()) -> dict:
    log = get_run_logger()
    key, run_dir = params.run_key, params.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    store = dict(store_url=params.store, prefix=f"runs/{key}", endpoint_url=params.s3_endpoint_url,
                 secret_block=params.s3_secret_block)
    artifact = key.lower().replace("_", "-").replace(".", "-")
    cluster = _miles(params)

    preflight(params.preset, params.seed, hf_checkpoint=params.hf_checkpoint, train_data=params.train_data,
              eval_data=params.eval_data, prompts_per_step=params.prompts_per_step, n_eval=params.n_eval,
              reward=params.reward, eval_reward=params.eval_reward, miles=cluster)
    converted = convert(params.hf_checkpoint, str(run_dir / "torch_dist"), megatron_names=params.megatron_names())
    verify(converted["dst"], params.hf_checkpoint)
    alignment = align(params.hf_checkpoint, converted["dst"], str(run_dir / "align.json"),
                      prompts=params.align_prompts, threshold=params.align_threshold, artifact_key=f"{artifact}-align",
                      cluster=cluster)
    evaluate(str(run_dir), params.hf_checkpoint, 0, params.n_eval, params.eval_samples, params.seed,
             artifact_key=f"{artifact}-eval", metric_sinks=list(params.metric_sinks), cluster=cluster,
             **_eval_data(params))
    progress = create_progress_artifact(0.0, key=f"{artifact}-training", description=f"GRPO steps of {key}")
    uploaded: dict = {}
    for until in segment_ends(params.steps, params.eval_interval):
        train_segment(str(run_dir), _train_config(params), until, params.training_fingerprint(), progress)
        evaluate(str(run_dir), str(run_dir / "weights" / "current"), until, params.n_eval, params.eval_samples,
                 params.seed, artifact_key=f"{artifact}-eval", metric_sinks=list(params.metric_sinks),
                 cluster=cluster, **_eval_data(params))
        uploaded = upload_artifacts(str(run_dir), **store)
    report = publish_report(str(run_dir), key=f"{artifact}-report", title=f"rl-pipeline {key}",
                            extra_markdown=_alignment_markdown(alignment), links=_links(uploaded))
    uploaded = upload_artifacts(str(run_dir), **store)
    log.info("report: %s; artifacts: %s", report["report"], uploaded.get("manifest"))
    return {"run_dir": str(run_dir), "summary": report["summary"], "alignment": alignment,
            "manifest": uploaded.get("manifest")}


def _miles(p: PipelineParams) -> dict | None:
    """The Miles job of a cluster preset (site, paths, preset overrides, where results go), as plain dicts for
    the tasks (engines/train/miles/pipeline.py ClusterRun.from_miles); None: the embedded engines."""
    from engines.backends import pipeline_backend

    if not pipeline_backend(p.preset).on_cluster:
        return None
    site, job = p.site(), p.miles_job()
    return {"preset": p.preset, "site": dataclasses.asdict(site), "job": dataclasses.asdict(job),
            "overrides": p.miles_overrides(), "miles_dir": p.miles_check_dir, "megatron_dir": p.megatron_check_dir,
            "run_dir": str(p.run_dir), "eval_interval": p.eval_interval, "align_sglang_url": p.align_sglang_url}


def _eval_data(p: PipelineParams) -> dict:
    return {"eval_data": p.eval_data, "max_grader_error_ratio": p.max_grader_error_ratio, "eval_reward": p.eval_reward}


def _alignment_markdown(alignment: dict | None) -> str:
    if not alignment:
        return ""
    diff = alignment.get("token_abs_diff", {})
    return ("## Alignment (rollout vs trainer, same tokens)\n\n"
            f"passed: {alignment.get('passed')}, mean |Δlogprob| {diff.get('mean', float('nan')):.4f}, "
            f"p99 {diff.get('p99', float('nan')):.4f}, first divergence: {alignment.get('first_divergence')}\n\n")


def _links(uploaded: dict) -> dict[str, str]:
    urls = uploaded.get("urls") or {}
    wanted = ("report.md", "metrics.jsonl", "manifest.json")
    return {name: url for name, url in urls.items() if name in wanted or name.startswith("plots/")}


if __name__ == "__main__":
    rl_pipeline(PipelineParams.preset_defaults("tiny-cpu", steps=4, eval_interval=2, prompts_per_step=16,
                                               n_eval=32))
