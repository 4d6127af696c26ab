"""The rl-pipeline flow, read top to bottom as DESIGN.md's data flow:

    preflight -> [rehearse: cluster presets with `rehearse` set] -> convert -> verify -> align
    train: ONE long-running task (retryable, resumes), the engine evaluating itself every eval_interval steps
           and checkpointing every save_interval; meanwhile, for each evaluation as it lands:
           evaluate (subflow: artifact row, pass@k plot) -> upload
    report -> upload

The same body for every preset: the preset picks the engines, built once into the run's backend (engines/backends)
that every task calls without asking which it is. tiny-cpu trains and evaluates with the embedded engines here; a
GPU preset runs ONE Miles job for the whole run on the existing Ray cluster (Miles evaluates before training and
every eval_interval rollouts, saves every --save-interval), aligns with SGLang + Megatron there, and lands its
metrics and evaluations in the same run directory, report and nightly verdict. The training task runs in the
flow's thread pool (`.submit`), so the flow's own thread starts an evaluate subflow per evaluation as soon as its
eval/step_XXXXXX.json lands (engines/runs/landed.py): the UI shows step 10's pass@k while step 11 trains.

Every step is a Prefect task or subflow: retried where a retry can help, cached across flow runs where the
work is deterministic (conversion by source identity, a finished training by run key), so a new flow run after
a crash skips what is done and resumes training at the last checkpoint. Cancelling the flow run stops the
training: the flow asks it to stop (engines/runs/stopping.py), which stops the Miles Ray job (`ray job stop`)
or kills the embedded trainer's Ray actors, and waits for it; the `on_cancellation` hook stops a Miles job the
flow process could not (it was killed first). A later run with the same run key resumes.

    prefect deployment run 'rl-pipeline/tiny-cpu'          # through deployments/prefect.yaml
    python -m flows.rl_pipeline                             # a local run with the tiny-cpu defaults
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import create_progress_artifact

from engines.runs.landed import landed_evaluations
from engines.runs.run_lock import hold_run_dir
from engines.runs.stopping import clear_stop, request_stop

from flows.evaluate import evaluate
from flows.params import PipelineParams
from tasks.align import align
from tasks.checkpoint import convert, verify
from tasks.preflight import preflight
from tasks.rehearse import rehearse
from tasks.report import publish_report
from tasks.train import train
from tasks.upload import upload_artifacts

EVAL_POLL_S = 1.0
"""How often the flow looks for evaluations that landed while training runs."""
STOP_WAIT_S = 20.0
"""How long a cancelled flow waits for the training to stop (Prefect's runner SIGKILLs it 30 s after SIGTERM)."""


def _stop_what_the_run_started(flow, flow_run, state) -> None:
    """on_cancellation hook (run by Prefect's runner after it killed the flow process): `ray job stop` the Miles
    job the run's training task left running, and end the local cluster a cluster-rehearsal run started, if the
    flow process did not get to stop them."""
    from engines.miles.pipeline import stop_live_job
    from engines.upstream.rehearsal.cluster_run import stop_local_cluster

    params = PipelineParams.model_validate((flow_run.parameters or {}).get("params") or {})
    stopped = stop_live_job(params.run_dir)
    if stopped:
        print(f"cancelled: stopped Ray job {stopped} of run {params.run_key}")
    for what in stop_local_cluster(params.run_dir / "local-cluster"):
        print(f"cancelled: stopped the local cluster's {what} of run {params.run_key}")


@flow(name="rl-pipeline", log_prints=True, on_cancellation=[_stop_what_the_run_started])
def rl_pipeline(params: PipelineParams = PipelineParams()) -> dict:
    log = get_run_logger()
    # One flow run (or `v4rl train`) per run directory: a second one is refused here, naming the holder
    # The preset's engines, called by every task below (engines/backends); cluster-rehearsal starts its local Ray
    # head and engine here and stops them when the run ends
    with hold_run_dir(params.run_dir, log=log.warning), params.engines() as backend:
        return _pipeline(params, backend, log)


def _pipeline(params: PipelineParams, backend, log) -> dict:
    key, run_dir = params.run_key, params.run_dir
    store = dict(store_url=params.store, prefix=f"runs/{key}", endpoint_url=params.s3_endpoint_url,
                 secret_block=params.s3_secret_block)
    artifact = key.lower().replace("_", "-").replace(".", "-")

    preflight(params.preset, params.seed, backend=backend, hf_checkpoint=params.hf_checkpoint,
              train_data=params.train_data, eval_data=params.eval_data, prompts_per_step=params.prompts_per_step,
              n_eval=params.n_eval, reward=params.reward, eval_reward=params.eval_reward, input_key=params.input_key,
              label_key=params.label_key, store_url=store["store_url"], store_prefix=store["prefix"],
              endpoint_url=store["endpoint_url"], secret_block=store["secret_block"])
    if params.rehearse:  # a cluster preset's Miles job on this host's CPU (tasks/rehearse.py); fails before any GPU
        rehearse(params.preset, params.rehearse, backend, str(run_dir), artifact_key=f"{artifact}-rehearsal")
    converted = convert(params.hf_checkpoint, str(run_dir / "torch_dist"), megatron_names=backend.megatron_names)
    verify(converted["dst"], params.hf_checkpoint)
    alignment = align(params.hf_checkpoint, converted["dst"], str(run_dir / "align.json"), backend=backend,
                      prompts=params.align_prompts, threshold=params.align_threshold, artifact_key=f"{artifact}-align")
    progress = create_progress_artifact(0.0, key=f"{artifact}-training", description=f"GRPO steps of {key}")
    uploaded: dict = {}
    clear_stop(run_dir)
    training = train.submit(backend, params.training_fingerprint(), progress)
    try:
        for step in landed_evaluations(run_dir, done=lambda timeout: _finished(training, timeout), poll_s=EVAL_POLL_S):
            evaluate(str(run_dir), str(run_dir / "weights" / "current"), step, backend, artifact_key=f"{artifact}-eval")
            uploaded = upload_artifacts(str(run_dir), **store)
    except Exception:  # publishing failed: the training is not thrown away for it; the flow fails once it ends
        log.exception("publishing an evaluation failed; the training goes on to its end, then this flow run fails")
        training.wait()
        raise
    except BaseException as exc:  # cancelled (Prefect's TerminationSignal: a BaseException) or interrupted
        request_stop(run_dir, f"the flow run was cancelled or interrupted ({type(exc).__name__}) while training ran")
        training.wait(STOP_WAIT_S)
        raise
    training.result()  # a failed training (after its retries) fails the flow here
    report = publish_report(str(run_dir), key=f"{artifact}-report", title=f"rl-pipeline {key}",
                            extra_markdown=_alignment_markdown(alignment), links=_links(uploaded))
    uploaded = upload_artifacts(str(run_dir), **store)
    log.info("report: %s; artifacts: %s", report["report"], uploaded.get("manifest"))
    return {"run_dir": str(run_dir), "summary": report["summary"], "alignment": alignment,
            "manifest": uploaded.get("manifest")}


def _finished(training, timeout: float) -> bool:
    """Wait up to `timeout` s for the training task; True once it has ended (in any state)."""
    training.wait(timeout)
    return training.wrapped_future.done()


def _alignment_markdown(alignment: dict | None) -> str:
    if not alignment:
        return ""
    from engines.align.report import markdown

    return f"## Alignment (rollout vs trainer, same tokens)\n\n{markdown(alignment)}\n"


def _links(uploaded: dict) -> dict[str, str]:
    urls = uploaded.get("urls") or {}
    wanted = ("report.md", "metrics.jsonl", "manifest.json")
    return {name: url for name, url in urls.items() if name in wanted or name.startswith("plots/")}


if __name__ == "__main__":
    from engines.presets.runs import SHORT_RUNS

    rl_pipeline(PipelineParams.preset_defaults("tiny-cpu", **SHORT_RUNS["nightly"]))
