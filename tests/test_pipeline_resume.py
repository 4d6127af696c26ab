"""A new rl-pipeline flow run for the same run key skips what is done: the conversion is a cache hit (keyed by
the source checkpoint's identity, not the run id), and training resumes at the right step. The run has ONE
training task, and each evaluation it makes is published once, by an evaluate subflow, while it runs: the test
holds the training after each evaluation until that subflow has completed (so a fast machine cannot end the
training first and turn the check into a race), and a flow that only published at the end would leave the
training waiting in vain. Flows run in this process against a real Prefect server on 127.0.0.1.

    .venv/bin/python -m pytest tests/test_pipeline_resume.py -q
"""

from __future__ import annotations

import json
import time

import pytest

from tests.prefect_server import flow_run_children


def _task_states(flow_run_id) -> dict[str, str]:
    tasks, _ = flow_run_children(flow_run_id, expect=("convert", "train"))
    return {r.name: r.state.name for r in tasks}


PUBLISH_WAIT_S = 60.0
"""How long the held training waits for an evaluation's subflow; the flow polls eval/ every second."""


def _published(flow_run_id, step: int) -> bool:
    """Whether the evaluate subflow of `step` under flow run `flow_run_id` has completed."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])))
    return any((r.parameters or {}).get("step") == step and r.state and r.state.is_completed() for r in runs)


def _training_held_until_published(monkeypatch) -> list[int]:
    """Make every evaluation the training writes wait until the flow has published it; returns the steps whose
    wait ran out (the flow did not publish them while training ran)."""
    from prefect.context import TaskRunContext

    from engines.runs.runlog import RunLog

    unpublished: list[int] = []
    write_eval = RunLog.write_eval

    def held(self, step: int, result: dict):
        path = write_eval(self, step, result)
        flow_run_id = TaskRunContext.get().task_run.flow_run_id  # the training task's flow run
        deadline = time.monotonic() + PUBLISH_WAIT_S
        while not _published(flow_run_id, step):
            if time.monotonic() > deadline:
                unpublished.append(step)
                break
            time.sleep(0.5)
        return path

    monkeypatch.setattr(RunLog, "write_eval", held)
    return unpublished


def test_second_flow_run_hits_the_conversion_cache_and_resumes_training(prefect_server, tiny_base, tmp_path,  # noqa: F811
                                                                        monkeypatch):
    from flows.params import PipelineParams
    from flows.rl_pipeline import rl_pipeline

    small = dict(run_key="resume", runs_root=str(tmp_path / "runs"), hf_checkpoint=str(tiny_base), steps=2,
                 eval_interval=1, prompts_per_step=4, n_samples=4, n_eval=8, eval_samples=4, align_prompts=2,
                 use_ray=False)
    with monkeypatch.context() as held:
        unpublished = _training_held_until_published(held)
        first = rl_pipeline(PipelineParams.preset_defaults("tiny-cpu", **small), return_state=True)
    assert first.is_completed(), first
    assert unpublished == [], f"evaluations of steps {unpublished} were not published while the training ran"
    states = _task_states(first.state_details.flow_run_id)
    assert any(n.startswith("convert") and s == "Completed" for n, s in states.items()), states
    tasks, subflows = flow_run_children(first.state_details.flow_run_id, expect=("convert", "train"))
    trains = [t for t in tasks if t.name.rsplit("-", 1)[0] == "train"]
    assert len(trains) == 1, [t.name for t in tasks]  # one training task for the run
    evaluations = sorted((f.parameters["step"], f.start_time) for f in subflows if "step" in (f.parameters or {}))
    assert [step for step, _ in evaluations] == [0, 1, 2], evaluations  # the trainer's evaluations, each once
    assert all(start < trains[0].end_time for _, start in evaluations), (evaluations, trains[0])  # as each landed

    # Crash-like restart with more steps: a brand-new flow run, same run key.
    converted = {p: p.stat().st_mtime_ns for p in (tmp_path / "runs" / "resume" / "torch_dist").rglob("*")}
    second = rl_pipeline(PipelineParams.preset_defaults("tiny-cpu", **{**small, "steps": 3}), return_state=True)
    assert second.is_completed(), second
    states = _task_states(second.state_details.flow_run_id)
    # the conversion is not redone: no file of it rewritten (the task runs as a no-op, or from the cache once its
    # output existed when a run started: tasks/checkpoint.py _convert_key)
    assert any(n.startswith("convert") and s in ("Cached", "Completed") for n, s in states.items()), states
    assert {p: p.stat().st_mtime_ns for p in converted} == converted
    rows = [json.loads(line) for line in (tmp_path / "runs" / "resume" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]  # step 3 trained once, after resuming from checkpoint 2


def test_zombie_automation_is_created_and_replaced(prefect_server):  # noqa: F811
    from prefect.automations import Automation

    from flows.automations import NAME, ensure_zombie_automation

    from flows.automations import ZOMBIE_WINDOW_S

    assert ensure_zombie_automation().trigger.within.total_seconds() == ZOMBIE_WINDOW_S == 600  # production's
    ensure_zombie_automation(900)  # idempotent: replaced, not duplicated
    found = Automation.read(name=NAME)
    assert found.trigger.within.total_seconds() == 900
    assert found.actions[0].state.value == "CRASHED"
    Automation.read(name=NAME).delete()  # no window left for later tests' flow runs


def test_a_zombie_window_that_is_not_positive_is_refused():
    from flows.automations import zombie_automation

    with pytest.raises(ValueError, match="within_seconds must be a positive number of seconds, not 0"):
        zombie_automation(0)
