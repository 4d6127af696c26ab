"""GRPO runs on the embedded engines: the trainer and the rollout server (real HTTP) in this process, and
once on a loopback-only Ray cluster. A few small steps each: weights change, metrics are finite and named
as DESIGN.md lists, and a run that dies after logging a step it never checkpointed resumes at the step
after its last checkpoint, with one continuous metric series and the same final weights as a run that
never died.

    .venv/bin/python -m pytest tests/test_train_run.py -q
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from engines.runs.checkpointing import latest_step, load_training_checkpoint
from engines.train.run import TrainRunConfig, run_training
from rl.loop import LoopConfig

REQUIRED = ("rollout/raw_reward", "rollout/response_len/mean", "rollout/truncated_ratio",
            "train/train_rollout_logprob_abs_diff", "train/tis", "train/tis_clipfrac", "train/pg_loss",
            "train/pg_clipfrac", "train/grad_norm", "train/entropy", "perf/step_time", "perf/update_weights_time")


def _config(base, steps: int, **kw) -> TrainRunConfig:
    return TrainRunConfig(base=str(base), steps=steps, save_interval=2, n_eval=8, n_train=64, lr=1e-3,
                          loop=LoopConfig(prompts_per_step=4, n_samples=4, eval_interval=2, max_new_tokens=6,
                                          dynamic_sampling=False), **kw)


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_few_steps_change_weights_and_log_finite_metrics(tiny_base, tmp_path):
    from checkpoints.hf import load_hf_checkpoint

    run_dir = tmp_path / "run"
    summary = run_training(run_dir, _config(tiny_base, 2, use_ray=False), log=lambda m: None)
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for name in REQUIRED:
            assert row[name] is not None and math.isfinite(row[name]), name
    assert [e["step"] for e in summary["evals"]] == [0, 2]
    assert set(summary["evals"][0]) >= {"pass@1", "pass@2", "pass@4", "pass@8", "truncated_ratio", "n_problems",
                                        "n_samples"}
    cfg, base = load_hf_checkpoint(tiny_base)
    master = load_training_checkpoint(run_dir / "checkpoints", 2, cfg)["master"]
    changed = [k for k in base if base[k].is_floating_point() and not torch.equal(master[k], base[k])]
    assert any("experts" in k for k in changed) and any(".attn." in k for k in changed)


def test_rollout_expert_dtype_is_checked_and_kept_out_of_old_configs(tiny_base):
    with pytest.raises(ValueError, match="rollout_expert_dtype='bf16'.*choose one of fp8, fp4"):
        _config(tiny_base, 1, rollout_expert_dtype="bf16")
    assert "rollout_expert_dtype" not in _config(tiny_base, 1).to_dict()  # runs written before it resume unchanged
    assert _config(tiny_base, 1, rollout_expert_dtype="fp4").to_dict()["rollout_expert_dtype"] == "fp4"


def test_the_config_crosses_the_task_boundary_as_a_dict_and_back(tiny_base):
    """The train task gets the config as a dict (Prefect parameters, persisted results): from_dict inverts both
    dict forms, a field left out takes its default, and a bad value still fails on the type."""
    config = _config(tiny_base, 3, rollout_expert_dtype="fp4", metric_sinks=["tensorboard"])
    assert TrainRunConfig.from_dict(dataclasses.asdict(config)) == config
    assert TrainRunConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(ValueError, match="save_interval=0"):
        TrainRunConfig.from_dict({**config.to_dict(), "save_interval": 0})


def test_resume_after_a_crash_matches_an_uninterrupted_run(tiny_base, tmp_path):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    run_training(straight, _config(tiny_base, 4, use_ray=False), log=lambda m: None)

    def die_after_step_3(step, metrics):
        if step == 3:  # step 3 is logged but its checkpoint (every 2 steps) never happens
            raise KeyboardInterrupt("simulated kill")

    with pytest.raises(KeyboardInterrupt):
        run_training(crashed, _config(tiny_base, 4, use_ray=False), log=lambda m: None, on_step=die_after_step_3)
    assert latest_step(crashed / "checkpoints") == 2 and [r["step"] for r in _rows(crashed)] == [1, 2, 3]
    summary = run_training(crashed, _config(tiny_base, 4, use_ray=False), log=lambda m: None)
    assert summary["resumed_from"] == 2
    assert [r["step"] for r in _rows(crashed)] == [1, 2, 3, 4]
    assert _rows(crashed) == [dict(r, **{k: r2[k] for k in r2 if k.startswith("perf/")})
                              for r, r2 in zip(_rows(straight), _rows(crashed))]
    from checkpoints.hf import read_config

    cfg, _ = read_config(tiny_base)
    a = load_training_checkpoint(straight / "checkpoints", 4, cfg)["master"]
    b = load_training_checkpoint(crashed / "checkpoints", 4, cfg)["master"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_one_step_on_a_local_ray_cluster(tiny_checkpoint, tmp_path):
    rows_seen = []
    run_training(tmp_path / "ray", _config(tiny_checkpoint, 1, use_ray=True), log=lambda m: None,
                 on_step=lambda step, m: rows_seen.append((step, m["train/grad_norm"])))
    assert rows_seen and rows_seen[0][0] == 1 and math.isfinite(rows_seen[0][1])


def test_a_rollout_server_that_ignores_the_api_key_stops_the_run(tiny_base, tmp_path, monkeypatch):
    """V4RL_ROLLOUT_API_KEY set, but the server was started without it: fail before step 1, naming the fix."""
    import engines.rollout.server as rollout_server
    from engines.train.run import RolloutUnprotected

    monkeypatch.setenv("V4RL_ROLLOUT_API_KEY", "run-key")
    started = rollout_server.RolloutServer.__init__
    monkeypatch.setattr(rollout_server.RolloutServer, "__init__",
                        lambda self, engine, **kw: started(self, engine, **{**kw, "api_key": None}))
    with pytest.raises(RolloutUnprotected, match="answers requests without it.*--api-key"):
        run_training(tmp_path / "run", _config(tiny_base, 1, use_ray=False), log=lambda m: None)
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not _rows(tmp_path / "run")


def test_the_shipped_sample_data_trains_with_a_signal(tiny_base, tmp_path):
    """rl/sample_math.jsonl (package data) is in the wording the tiny base solves: `v4rl train --train-data` on it
    gets a non-zero reward (graded by math-verify, as for any data file), so its steps learn."""
    from rl.datasets import SAMPLE_DATA, load_prompt_dataset

    rows, report = load_prompt_dataset(SAMPLE_DATA)
    assert len(rows) == report.n_rows == 256 and report.n_dropped == 0
    logged: list[str] = []
    config = TrainRunConfig(base=str(tiny_base), steps=1, n_eval=8, train_data=str(SAMPLE_DATA),
                            loop=LoopConfig(prompts_per_step=8, n_samples=4, eval_interval=0, max_new_tokens=8,
                                            dynamic_sampling=False), use_ray=False)
    run_training(tmp_path / "run", config, log=logged.append)
    (row,) = _rows(tmp_path / "run")
    assert row["rollout/raw_reward"] > 0 and row["rollout/no_learning_signal"] == 0.0, row
    assert not [line for line in logged if "no learning signal" in line], logged


def test_a_step_without_a_learning_signal_says_so_and_skips_the_optimizer(tiny_base, tmp_path):
    """DAPO-style wording: the tiny base scores 0 on every sample, dynamic sampling filters every group. Each
    step logs one warning line naming the cause and the sample file, records rollout/no_learning_signal = 1,
    and skips the optimizer step (a step on no samples used to fail: 'GRPO step got no response tokens')."""
    from rl.datasets import SAMPLE_DATA

    dapo = tmp_path / "dapo.jsonl"
    wording = ("Solve the following math problem step by step. The last line of your response should be of the form "
               "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\nLet x = {a}/{b}. "
               "What is x?\n\nRemember to put your answer on its own line after \"Answer:\".")
    dapo.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": wording.format(a=a, b=a + 7)}],
                                        "label": f"\\frac{{{a}}}{{{a + 7}}}"}) + "\n" for a in range(1, 9)))
    logged: list[str] = []
    config = TrainRunConfig(base=str(tiny_base), steps=2, n_eval=8, train_data=str(dapo),
                            loop=LoopConfig(prompts_per_step=2, n_samples=2, eval_interval=0, max_new_tokens=4,
                                            dynamic_sampling=True, dynamic_sampling_max_rounds=1), use_ray=False)
    run_training(tmp_path / "run", config, log=logged.append)
    rows = _rows(tmp_path / "run")
    assert [(r["step"], r["rollout/raw_reward"], r["rollout/no_learning_signal"]) for r in rows] == \
        [(1, 0.0, 1.0), (2, 0.0, 1.0)]
    warned = [line for line in logged if "no learning signal" in line]
    assert [w.split(" has ")[0] for w in warned] == ["warning: step 1", "warning: step 2"], logged
    assert "the optimizer step was skipped" in warned[0] and str(SAMPLE_DATA) in warned[0]
    assert "solves only its own prompt wording" in warned[0] and "\n" not in warned[0]


def test_a_completed_run_restarted_with_the_same_command_starts_nothing(tiny_base, tmp_path, monkeypatch):
    """The rerun finds the final checkpoint first, says the run is complete and returns: no tokenizer, no data,
    no engines (which took 30 s to do nothing)."""
    import engines.train.run as run_module

    config = _config(tiny_base, 1, use_ray=False)
    run_training(tmp_path / "run", config, log=lambda m: None)
    before = _rows(tmp_path / "run")

    def started(*args, **kwargs):
        raise AssertionError("the rerun of a completed run started its engines")

    monkeypatch.setattr(run_module, "_workers", started)
    monkeypatch.setattr(run_module, "_task_data", started)
    logged: list[str] = []
    summary = run_training(tmp_path / "run", config, log=logged.append)
    assert summary["complete"] and summary["last_step"] == 1 and [e["step"] for e in summary["evals"]] == [0, 1]
    assert len(logged) == 1 and "is complete" in logged[0] and "--steps" in logged[0], logged
    assert _rows(tmp_path / "run") == before
    with pytest.raises(ValueError, match="different run configuration"):  # a changed run is still refused first
        run_training(tmp_path / "run", dataclasses.replace(config, lr=5e-4), log=logged.append)


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no-replay"])
def test_routing_replay_runs_end_to_end_with_the_rollouts_routes(tiny_base, tmp_path, replay):
    """--routing-replay in a real run: the rollout server returns its routed experts over HTTP, the trainer replays
    them and logs how often its own top-k differs from the rollout's (FP8 rollout vs BF16 trainer: rare flips);
    without replay the routes still come back and the mismatch is still logged (issue 29: either way)."""
    from rl.correction_setting import RolloutCorrection

    run_dir = tmp_path / "run"
    config = _config(tiny_base, 1, use_ray=False,
                     rollout_correction=RolloutCorrection(mode="tis", routing_replay=replay))
    run_training(run_dir, config, log=lambda m: None)
    (row,) = _rows(run_dir)
    mismatch = row["train/router_mismatch_frac"]
    assert 0.0 <= mismatch < 0.2, mismatch
    assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), row
