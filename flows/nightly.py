"""nightly-validation: a short rl-pipeline run (convert, verify, align, a few GRPO steps, eval), judged against
the history of earlier nights of the same preset kept in the artifact store (rl/verdict.py). Ends Failed with
the reasons on a regression, Completed otherwise; the verdict is a markdown artifact and `nightly.json` in the
run. tiny-cpu by default; a GPU preset validates the cluster path (Miles' metrics and evaluations, read back
into the same run directory, are judged the same way), and cluster-rehearsal validates it on this host: the
user's Miles checkout running the seed's job every night, every step real (docs/cluster.md).

    prefect deployment run 'nightly-validation/nightly'
    prefect deployment run 'nightly-validation/cluster-rehearsal'
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.states import Failed
from pydantic import Field, field_validator

from engines.presets.runs import REHEARSAL_RUN, SHORT_RUNS
from flows.params import FlowParams, PipelineParams
from flows.rl_pipeline import rl_pipeline

NIGHTLY_RUN = SHORT_RUNS["nightly"]
"""The validation run: the preset with a few steps (engines/presets/runs.py SHORT_RUNS, an override of tiny-cpu)."""
OWN_NUMBERS = (REHEARSAL_RUN.name,)
"""Presets already the size of a validation run, validated with their own numbers (cluster-rehearsal: 3 rollouts of
Miles' job on this host's CPU; NIGHTLY_RUN's 32 prompts a step would take it an hour)."""
HISTORY_PREFIX = "runs/"
RECORD = "nightly.json"


class NightlyParams(FlowParams):
    """Bad values fail before anything runs, naming the parameter; an unknown one names the closest (FlowParams)."""

    preset: str = Field("tiny-cpu", description="Run preset of the validation run; history is compared per preset.")
    steps: int | None = Field(None, ge=1, description="GRPO steps of the validation run; empty: the preset's "
                                                      "validation run (NIGHTLY_RUN, or its own numbers: OWN_NUMBERS).")
    eval_interval: int | None = Field(None, ge=1)
    prompts_per_step: int | None = Field(None, ge=1)
    n_eval: int | None = Field(None, ge=1)
    runs_root: str | None = Field(None, description="Default: the repo's runs/ directory.")
    store_url: str = Field("", description="Artifact store holding the history (file:// or s3://).")
    s3_endpoint_url: str | None = None
    s3_secret_block: str | None = None
    min_history: int = Field(3, ge=1, description="Earlier nights needed before pass@1 is judged.")
    date: str | None = Field(None, description="Night to record (YYYY-MM-DD); default: today (UTC).")

    def numbers(self) -> dict:
        """The validation run's numbers: those given over the preset's validation run (NIGHTLY_RUN; the preset's own
        for OWN_NUMBERS)."""
        given = {k: getattr(self, k) for k in NIGHTLY_RUN if getattr(self, k) is not None}
        return {**({} if self.preset in OWN_NUMBERS else NIGHTLY_RUN), **given}

    @field_validator("preset")
    @classmethod
    def _preset(cls, v: str) -> str:
        from engines.presets.runs import get_run_preset

        return get_run_preset(v).name  # any spelling of a known preset; ValueError naming the closest otherwise

    @field_validator("date")
    @classmethod
    def _date(cls, v: str | None) -> str | None:
        if v:
            try:
                dt.date.fromisoformat(v)
            except ValueError:
                raise ValueError(f"date {v!r} is not a calendar date; give YYYY-MM-DD (e.g. 2025-01-31) or leave "
                                 "it empty for today (UTC)") from None
            if len(v) != 10:
                raise ValueError(f"date {v!r}: give it as YYYY-MM-DD (e.g. 2025-01-31)")
        return v


@task(name="load-history", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def load_history(store_url: str, endpoint_url: str | None, secret_block: str | None, exclude_run: str) -> list[dict]:
    from engines.artifact_store import list_objects, read_json
    from tasks.upload import resolve_credentials

    creds = resolve_credentials(secret_block)
    keys = [k for k in list_objects(store_url, HISTORY_PREFIX, endpoint_url=endpoint_url, **creds)
            if k.endswith("/" + RECORD) and f"/{exclude_run}/" not in f"/{k}"]
    return [read_json(store_url, k, endpoint_url=endpoint_url, **creds) for k in sorted(keys)]


@flow(name="nightly-validation", log_prints=True)
def nightly_validation(params: NightlyParams = NightlyParams()):
    from engines.runs.runlog import RunLog
    from rl.verdict import nightly_verdict, same_preset
    from tasks.upload import upload_artifacts

    night = params.date or dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    overrides = {k: v for k, v in dict(**params.numbers(), runs_root=params.runs_root, store_url=params.store_url,
                                      s3_endpoint_url=params.s3_endpoint_url,
                                      s3_secret_block=params.s3_secret_block).items() if v is not None}
    pipeline = PipelineParams.preset_defaults(params.preset, run_key=f"nightly-{night}", **overrides)
    result = rl_pipeline(pipeline)
    run_dir = Path(result["run_dir"])
    log = RunLog(run_dir)
    rows, evals = log.metrics(), log.evals()
    last = evals[-1] if evals else {}
    diff = [(r["step"], r["train/train_rollout_logprob_abs_diff"]) for r in rows
            if r.get("train/train_rollout_logprob_abs_diff") is not None]
    tonight = {"night": night, "run_key": pipeline.run_key, "preset": pipeline.preset, "pass@1": last.get("pass@1"),
               "pass@8": last.get("pass@8"), "n_problems": last.get("n_problems", 0),
               "n_samples": last.get("n_samples", 0),
               "align_mean": ((result.get("alignment") or {}).get("token_abs_diff") or {}).get("mean"),
               "diff_steps": [s for s, _ in diff], "diff_values": [v for _, v in diff]}
    history = same_preset(load_history(pipeline.store, pipeline.s3_endpoint_url, pipeline.s3_secret_block,
                                       pipeline.run_key), pipeline.preset)
    verdict = nightly_verdict(tonight, history, min_history=params.min_history,
                              align_threshold=pipeline.align_threshold)
    record = {**tonight, "verdict": verdict.to_dict()}
    (run_dir / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    upload_artifacts(str(run_dir), store_url=pipeline.store, prefix=f"runs/{pipeline.run_key}",
                     endpoint_url=pipeline.s3_endpoint_url, secret_block=pipeline.s3_secret_block)
    lines = [f"# Nightly validation {night}: {'PASSED' if verdict.passed else 'FAILED'}", "",
             f"History: {len(history)} earlier nights.", ""]
    lines += [f"- {r}" for r in verdict.reasons] or ["- no regression"]
    lines += ["", "```json", json.dumps(verdict.checks, indent=2), "```"]
    create_markdown_artifact("\n".join(lines), key="nightly-verdict", description=f"nightly verdict {night}")
    get_run_logger().info("verdict: %s", "passed" if verdict.passed else "; ".join(verdict.reasons))
    if not verdict.passed:
        return Failed(message="nightly regression: " + "; ".join(verdict.reasons))
    return record
