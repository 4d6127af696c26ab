"""Run guards: the mismatch budget (alert | stop | rollback, said in events.jsonl and the report) and the hang
watchdog (a step whose remote call times out fails with the stuck processes' thread stacks, and the run
resumes from its checkpoint afterwards).

    .venv/bin/python -m pytest tests/test_guards.py -q
"""

from __future__ import annotations

import json

import pytest

from engines.runs.guards import MismatchBudget, MismatchBudgetExceeded, StepHung
from engines.train.run import TrainRunConfig, run_training
from rl.loop import LoopConfig


def _config(base, steps: int, **kw) -> TrainRunConfig:
    return TrainRunConfig(base=str(base), steps=steps, save_interval=3, n_eval=8, n_train=64, use_ray=False,
                          loop=LoopConfig(prompts_per_step=4, n_samples=4, eval_interval=0, max_new_tokens=6,
                                          dynamic_sampling=False), **kw)


def test_budget_counts_consecutive_steps_and_escalates_rollback_to_stop():
    budget = MismatchBudget(threshold=0.1, steps=2, action="rollback")
    assert [budget.observe(s, d) for s, d in [(1, 0.2), (2, 0.05), (3, 0.2)]] == [None, None, None]
    assert budget.observe(4, 0.3)["action"] == "rollback"
    assert budget.observe(5, 0.3) is None and budget.observe(6, 0.3)["action"] == "stop"
    with pytest.raises(ValueError, match="not one of alert, stop, rollback"):
        MismatchBudget(action="ignore")


def test_stop_action_fails_the_run_and_records_the_event(tiny_base, tmp_path):
    with pytest.raises(MismatchBudgetExceeded, match="2 consecutive steps"):
        run_training(tmp_path, _config(tiny_base, 4, mismatch_threshold=1e-9, mismatch_steps=2,
                                       mismatch_action="stop"), log=lambda m: None)
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["step"], e["action"]) for e in events] == [(2, "stop")]
    from engines.runs.report import write_report

    assert "step 2: train/rollout" in write_report(tmp_path)["markdown"]


def test_rollback_replays_from_the_checkpoint_then_stops(tiny_base, tmp_path):
    with pytest.raises(MismatchBudgetExceeded):
        run_training(tmp_path, _config(tiny_base, 4, mismatch_threshold=1e-9, mismatch_steps=2,
                                       mismatch_action="rollback"), log=lambda m: None)
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["step"], e["action"]) for e in events] == [(2, "rollback"), (2, "stop")]
    rows = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [1, 2]  # steps 1-2 were rolled back (no checkpoint yet) and replayed: one series


def test_hung_rollout_fails_the_step_with_thread_stacks_and_the_run_resumes(tiny_base, tmp_path, monkeypatch):
    import engines.train.actors as actors

    workers = []
    original = actors.RolloutWorker.__init__

    def remember(self, *a, **kw):
        original(self, *a, **kw)
        workers.append(self)

    monkeypatch.setattr(actors.RolloutWorker, "__init__", remember)

    def hang_after_step_3(step, metrics):
        if step == 3:  # requests of step 4 now wait forever inside the server: a hung rollout
            workers[-1].engine.pause("in_place")

    with pytest.raises(StepHung, match="step 4 made no progress") as info:
        run_training(tmp_path, _config(tiny_base, 4, call_timeout_s=5), log=lambda m: None, on_step=hang_after_step_3)
    stacks = (tmp_path / "hangs" / "step_000004.txt").read_text()
    assert "step 4 hung" in stacks and "rollout" in stacks.lower() and str(tmp_path / "hangs") in str(info.value)
    summary = run_training(tmp_path, _config(tiny_base, 4), log=lambda m: None)
    assert summary["resumed_from"] == 3
    rows = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [1, 2, 3, 4]
