"""Prefect task: the preflight rehearsal. On a cluster preset with `rehearse` set (engines/presets/spec.py
MilesSettings.rehearse, the flow's `rehearse` parameter), the rl-pipeline runs `v4rl rehearse --stage S` on its own
host before anything touches the cluster: Miles' own train.py, unmodified, on a local Ray head with v4rl's engine
as its SGLang, for the job v4rl builds for this run (the preset with the run's overrides), changed only where a
CPU must differ (engines/upstream/rehearsal/run.py `rehearse`, docs/rehearsal.md).

Its report is the run's markdown artifact `<run>-rehearsal` (verdict, stages with seconds and errors, Miles'
metrics per rollout, evaluations, the substitution table) and <run_dir>/rehearsal.json; Miles' logs of the last
attempt stay in <run_dir>/rehearsal/. A failed rehearsal fails this task with one line naming the stage and
Miles' own message, and the flow stops there: before the conversion, the alignment gate's engine and the Ray job.

Retries: RETRIES more attempts, each in a fresh work dir, for a rehearsal that ran and failed or could not start
(a stage past its timeout, a port taken between check and bind, a Ray head that did not come up); none for what a
retry cannot fix (RehearsalRefused: a directory that is not a Miles tree, a Megatron-LM that does not fit that
Miles, a Miles of another generation than the run's, a stage this v4rl has not built).

    .venv/bin/python -m pytest tests/test_rehearse_task.py -q
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import task_run

if TYPE_CHECKING:
    from engines.backends.miles import MilesBackend

RETRIES = 1
"""Resubmissions of a rehearsal that failed or could not start (2 attempts in all)."""
METRICS = ("rollout/raw_reward", "train/train_rollout_logprob_abs_diff", "train/tis", "train/tis_clipfrac",
           "train/grad_norm", "perf/rollout_time")
"""Miles' logged metrics the artifact shows per rollout (names as Miles logs them), where the stage logged them;
rehearsal.json has every one."""


class RehearsalFailed(RuntimeError):
    """The rehearsal ran (or tried to start) and a stage failed; the message is one line."""


class RehearsalRefused(RuntimeError):
    """The rehearsal cannot run with these inputs; a retry cannot fix it."""

    retryable = False


def _transient(task, task_run, state) -> bool:
    try:
        state.result()
    except Exception as exc:  # noqa: BLE001 - classified here, re-raised by Prefect when not retried
        return bool(getattr(exc, "retryable", True))
    return False


@task(name="rehearse", cache_policy=NO_CACHE, retries=RETRIES, retry_delay_seconds=5, retry_condition_fn=_transient)
def rehearse(preset: str, stage: str, backend: MilesBackend, run_dir: str, *, artifact_key: str | None = None) -> dict:
    """Rehearse `stage` of this run's Miles job. `backend`: the run's Miles backend (flows/params.py
    PipelineParams.backend; `rehearse` is refused on other presets): its overrides, and miles_dir/megatron_dir, the
    checkouts on this host (None: $V4RL_*_DIR or the vendored pins).
    Every wait inside has its own timeout (engines/upstream/rehearsal/run.py), and every process it starts is stopped."""
    from engines.presets.runs import resolve
    from engines.upstream.rehearsal.run import STAGES, RehearsalError, RehearsalRequest, resolve_trees
    from engines.upstream.rehearsal.run import rehearse as run_rehearsal

    log = get_run_logger()
    work, report_json = Path(run_dir) / "rehearsal", Path(run_dir) / "rehearsal.json"
    report_json.unlink(missing_ok=True)  # what is there is this attempt's report, or nothing
    overrides = dict(backend.overrides)
    effective, _ = resolve(preset, overrides)
    req = RehearsalRequest(stage=stage, miles_dir=backend.miles_dir, megatron_dir=backend.megatron_dir,
                           work_dir=str(work), dsv4_impl=overrides.get("dsv4_impl"))
    try:
        if stage not in STAGES:
            raise RehearsalError(f"rehearse={stage!r}: this v4rl's rehearsal has the stages {', '.join(STAGES)}; "
                                 "pick one of them or leave rehearse empty")
        miles_here, _, generation = resolve_trees(req)  # the trees as the rehearsal will resolve them
        if generation != effective.miles.generation:  # rehearsing another Miles than the cluster's proves nothing
            raise RehearsalError(f"the run's Miles is generation {effective.miles.generation} but the Miles on this "
                                 f"host ({miles_here}) is generation {generation}; point miles_check_dir at a checkout "
                                 "of the cluster's Miles (or set miles_generation to the cluster's)")
    except RehearsalError as exc:
        line = f"rehearsal refused: {exc}"
        _publish(artifact_key, stage, None, line)
        raise RehearsalRefused(line) from None
    if task_run.run_count > 1:
        log.info("rehearsal attempt %d of %d, in a fresh work dir (why: the failure above)", task_run.run_count,
                 RETRIES + 1)
    shutil.rmtree(work, ignore_errors=True)  # a fresh work dir: a retry must not --load an attempt's save
    try:
        report = run_rehearsal(req, preset=effective, log=log.info)
    except RehearsalError as exc:  # it could not start: Ray's head, the engine, a port
        line = f"rehearsal (stage {stage}) could not run: {exc}"
        _publish(artifact_key, stage, None, line)
        raise RehearsalFailed(line) from None
    out = report.to_json()
    _write_json(report_json, out)
    line = failure_line(out["stages"])
    _publish(artifact_key, stage, out, line)
    if line:
        raise RehearsalFailed(f"{line} (logs: {work})")
    log.info("rehearsal passed: %s", ", ".join(f"{name} {s['seconds']} s" for name, s in out["stages"].items()))
    return {"ok": True, "stages": out["stages"], "report": str(report_json)}


def failure_line(stages: dict[str, dict]) -> str | None:
    """`rehearsal stage S failed: <Miles' or the engine's message>` for the first failed stage; None when all passed.

    >>> failure_line({"rollout": {"ok": False, "seconds": 3.0, "error": "stage rollout: Miles' train.py exited with 1"}})
    "rehearsal stage rollout failed: Miles' train.py exited with 1"
    """
    for name, stage in stages.items():
        if not stage["ok"]:
            error = str(stage.get("error") or "no error recorded")
            prefix = f"stage {name}: "
            return f"rehearsal stage {name} failed: {error[len(prefix):] if error.startswith(prefix) else error}"
    if not stages:
        return "rehearsal failed: no stage ran"
    return None


def markdown(stage: str, report: dict | None, failure: str | None) -> str:
    """The artifact: the verdict line, then (when it ran) stages, Miles' metrics, evaluations, the weight checks and
    the resume (stage full), substitutions."""
    parts = [f"# Rehearsal (stage {stage}): {'FAILED' if failure else 'passed'}", ""]
    if failure:
        parts += [f"**{_cell(failure)}**", ""]
    if report is None:
        return "\n".join(parts)
    parts += [f"Miles `{report['miles_dir']}` (generation {report['generation']}), on this host's CPU; work dir "
              f"`{report['work_dir']}`.", "", "## Stages", "", "| stage | ok | seconds | error |", "|---|---|---|---|"]
    parts += [f"| {name} | {'yes' if s['ok'] else 'no'} | {s['seconds']} | {_cell(s.get('error') or '')} |"
              for name, s in report["stages"].items()]
    shown = [m for m in METRICS if any(m in values for values in report["rollouts"].values())]
    if shown:
        parts += ["", "## Miles' metrics per rollout", "", "| rollout | " + " | ".join(shown) + " |",
                  "|---" * (len(shown) + 1) + "|"]
        parts += [f"| {rollout} | " + " | ".join(_number(values.get(m)) for m in shown) + " |"
                  for rollout, values in sorted(report["rollouts"].items(), key=lambda kv: int(kv[0]))]
    bound = report.get("logprob_bound")  # stages train and full: the bf16 noise the |Δlogprob| bound comes from
    if bound:
        parts += ["", f"Bounds on `train/train_rollout_logprob_abs_diff`, from noise measured on this model "
                      f"({bound['tokens']} tokens at temperature {bound['temperature']:g}): {bound['factor']:g} x "
                      f"bf16 {_number(bound['bf16_noise'])} = {_number(bound['bound'])} (stage train); "
                      f"{bound['factor']:g} x (bf16 + FP8 re-quantization {_number(bound['fp8_requant_noise'])}) = "
                      f"{_number(bound['broadcast_bound'])} (stage full)."]
    if report["evals"]:
        parts += ["", "## Miles' evaluations", "", "In Miles' log order, under the rollout id Miles logs them with.", "",
                  "| rollout | dataset | pass@k |", "|---|---|---|"]
        for ev in report["evals"]:
            for dataset, values in ev["datasets"].items():
                passes = ", ".join(f"{k} {_number(v)}" for k, v in values.items() if k.startswith("pass@"))
                parts.append(f"| {ev['rollout']} | {_cell(dataset)} | {passes} |")
    checks = report.get("weight_checks") or []  # stage full: the engine's weights after each broadcast
    if checks:
        parts += ["", "## Weight checks (v4rl's engine after each broadcast vs the actor's export)", "",
                  "| run | version | tensors sent | ok | first differing tensor |", "|---|---|---|---|---|"]
        parts += [f"| {_cell(c.get('run', ''))} | {c.get('version', '')} | {c.get('tensors_sent', '')} | "
                  f"{'yes' if c.get('ok') else 'no'} | {_cell(c.get('first_differing') or '')} |" for c in checks]
    if report.get("resumed_from"):
        parts += ["", "Resumed from: " + ", ".join(f"{k} {_cell(v)}" for k, v in report["resumed_from"].items())]
    parts += ["", "## Substitutions (the cluster job, changed where a CPU must differ)", "",
              "| flag or variable | cluster | rehearsal | why |", "|---|---|---|---|"]
    parts += [f"| {_cell(s['name'])} | {_cell(s['cluster'])} | {_cell(s['rehearsal'])} | {_cell(s['why'])} |"
              for s in report["substitutions"]]
    return "\n".join(parts) + "\n"


def _publish(key: str | None, stage: str, report: dict | None, failure: str | None) -> None:
    create_markdown_artifact(markdown(stage, report, failure), key=key,
                             description=f"preflight rehearsal (v4rl rehearse --stage {stage}) on this host's CPU")


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _number(value) -> str:
    return "" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)
