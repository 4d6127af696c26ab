"""`v4rl bench e2e`: both sides train on the same data with the same settings, and a two-step smoke run of
`v4rl train` against TRL's GRPOTrainer writes the JSON and the plot the README quotes (~1-2 min on 2 cores).
Speeds are not asserted here: they live in the bench output, both sides measured in the same run. Needs TRL
(the `bench` extra, part of `.[test]`); skipped with the install line when it is missing.

    .venv/bin/python -m pytest tests/test_e2e_bench.py -q
"""

from __future__ import annotations

import json
import statistics

import pytest
from typer.testing import CliRunner

from bench.e2e_settings import E2ESettings, held_out_rows, step_prompts, v4rl_config

trl = pytest.importorskip("trl", reason="TRL is not installed; .venv/bin/pip install -e '.[bench]'")

SMOKE = dict(steps=2, prompts_per_step=4, n_samples=4, eval_interval=1, n_eval=8)


def test_trl_config_expresses_the_shared_settings(tmp_path):
    from bench.e2e_trl import trl_config
    from engines.train.trainer import TrainerConfig
    from rl.grpo import GRPOConfig

    settings = E2ESettings(steps=7, prompts_per_step=16, n_samples=4, max_new_tokens=6, lr=3e-4, temperature=0.9)
    args = trl_config(settings, str(tmp_path), longest_prompt=40)
    ours, optimizer = GRPOConfig(), TrainerConfig()
    # one generation of prompts x samples, one optimizer step over all of them per GRPO step
    assert args.num_generations == 4 and args.generation_batch_size == 64
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 64
    assert args.steps_per_generation == args.gradient_accumulation_steps and args.num_iterations == 1
    assert args.per_device_train_batch_size * (40 + 6) <= settings.max_tokens_per_gpu
    assert (args.max_steps, args.max_completion_length, args.temperature) == (7, 6, 0.9)
    assert (args.top_p, args.top_k) == (1.0, 0)
    assert (args.learning_rate, args.lr_scheduler_type, args.warmup_steps) == (3e-4, "constant", 0)
    assert (args.adam_beta1, args.adam_beta2) == optimizer.betas and args.weight_decay == optimizer.weight_decay
    assert args.max_grad_norm == ours.max_grad_norm
    assert (args.loss_type, args.epsilon, args.epsilon_high, args.beta) == ("dapo", ours.clip_low, ours.clip_high, 0.0)
    assert args.scale_rewards == "group" and not args.activation_checkpointing and not args.gradient_checkpointing and args.router_aux_loss_coef == 0.0
    assert not args.shuffle_dataset


def test_step_prompts_are_the_prompts_v4rl_train_draws():
    from rl.grading import Grader
    from rl.loop import Completion, rollout_step
    from rl.math_task import make_splits

    settings = E2ESettings(steps=3, prompts_per_step=5, n_samples=2, n_train=40)
    config = v4rl_config(settings)
    assert (config.loop.prompts_per_step, config.loop.n_samples, config.loop.max_new_tokens, config.lr) == (5, 2, 8, 1e-4)
    assert not config.loop.dynamic_sampling and config.loop.eval_interval == 0
    train_rows, _ = make_splits(config.n_train, config.n_eval, config.loop.seed)

    class Recording:  # a Rollout that answers nothing and remembers which prompts it was asked for
        def __init__(self) -> None:
            self.asked: list[int] = []

        def generate(self, prompts, *, n, temperature, max_new_tokens, seed):
            self.asked.extend(p[0] for p in prompts)
            return [[Completion([], [], "stop") for _ in range(n)] for _ in prompts]

    rollout = Recording()
    for step in range(1, settings.steps + 1):
        rollout_step(step, rollout=rollout, prompts=[[i] for i in range(len(train_rows))],
                     labels=[r["label"] for r in train_rows], config=config.loop, decode=lambda ids: "",
                     grader=Grader(lambda response, label: 0.0))
    assert [train_rows[i] for i in rollout.asked] == step_prompts(settings)
    assert {r["prompt"] for r in held_out_rows(settings)}.isdisjoint({r["prompt"] for r in train_rows})


def test_reward_function_grades_like_v4rl_train():
    from bench.e2e_trl import reward_function

    assert reward_function(["\\boxed{85}", "so \\boxed{84}", "\\boxed{47+38}", "85"], label=["85"] * 4) == [1.0, 0, 0, 0]


def test_settings_and_cli_reject_bad_input(tmp_path):
    from bench.e2e import main
    from v4rl.cli import app

    with pytest.raises(ValueError, match="n_samples"):
        E2ESettings(n_samples=1)
    with pytest.raises(ValueError, match="base"):
        E2ESettings(base=str(tmp_path))
    (tmp_path / "leftover").mkdir()
    with pytest.raises(ValueError, match="not empty"):
        main(tmp_path / "e2e.json", work_dir=tmp_path)
    result = CliRunner().invoke(app, ["bench", "train", "--json", str(tmp_path / "x.json"), "--steps", "3"])
    assert result.exit_code != 0 and "--steps applies to e2e, learning only" in result.output


def test_bench_e2e_smoke_run_writes_json_and_plot(tmp_path):
    from bench.e2e import main

    out = tmp_path / "bench" / "e2e.json"
    result = main(out, settings=E2ESettings(**SMOKE), work_dir=tmp_path / "work", arms="trl-like")
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["steps"] == 2 and result["trl_version"] == trl.__version__
    assert set(result["seconds_per_step"]) == {"v4rl", "trl"}
    assert all(isinstance(v, float) and v > 0 for v in result["seconds_per_step"].values())
    pairs = result["pairs"]
    assert [p["step"] for p in pairs] == [1, 2]
    assert result["speedup"] == pytest.approx(statistics.median(p["trl_s"] / p["v4rl_s"] for p in pairs))
    trainer = result["phases_median_s"]["v4rl"]  # how the trainer computed, so a slower path shows as a number
    assert trainer["train_threads"] >= 1 and trainer["train_tokens_per_s"] > 0
    assert 0 < trainer["train_forwarded_per_token"] < 1  # each GRPO group's prompt forwarded once
    assert (tmp_path / "bench" / "e2e.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for side in ("v4rl", "trl"):
        evals = result["evals"][side]
        assert [e["step"] for e in evals] == [0, 1, 2]
        assert all(0 <= e["pass@1"] <= e["pass@8"] <= 1 and e["n_problems"] == 8 for e in evals)
        assert [e["train_seconds"] for e in evals] == sorted(e["train_seconds"] for e in evals)
        assert len(result["reward"][side]) == 2
    # both sides start from the same base, evaluated by the same evaluator: step 0 agrees within its noise
    start = result["learning"]["pass@1"][0]
    assert start["step"] == 0 and abs(start["diff"]) <= 2 * start["diff_se"] + 1e-9
    assert set(result["goals"]) == {"steps_per_second_vs_trl", "learning_per_step_no_worse"}
    arm = result["arms"]["trl-like"]  # v4rl with TRL's choices, run alone on the same seed, evaluated alike
    assert [e["step"] for e in arm["evals"]] == [0, 1, 2] and arm["seconds_per_step"] > 0
    assert [p["step"] for p in arm["learning"]["pass@1"]] == [0, 1, 2]
    config = json.loads((tmp_path / "work" / "seed-0" / "trl-like" / "config.json").read_text())
    assert (config["rollout_weights"], config["share_prompt_prefix"], config["loop"]["advantage_eps"]) == \
        ("bf16", False, 1e-4)
    # each side trained: its weights at step 2 differ from its step-0 weights
    from checkpoints.hf import load_hf_checkpoint

    for root in (tmp_path / "work" / "seed-0" / "snapshots" / "v4rl",
                 tmp_path / "work" / "seed-0" / "trl" / "snapshots" / "trl"):
        before, after = load_hf_checkpoint(root / "step_000000")[1], load_hf_checkpoint(root / "step_000002")[1]
        assert before.keys() == after.keys()
        assert any(not before[k].equal(after[k]) for k in before), f"{root}: no weight changed in two steps"


def test_learning_over_seeds_averages_and_takes_the_larger_noise():
    """bench e2e over seeds: pass@1 per step is the mean over seeds; the difference's standard error is the larger of
    the evaluations' sampling noise and the spread of the per-seed differences; one seed is the sampling noise."""
    from bench.e2e import _learning, _mean_evals

    def evals(*values):
        return [{"step": 5 * i, "pass@1": v, "pass@1_se": 0.01, "pass@8": 0.9} for i, v in enumerate(values)]

    seeds = [{"v4rl": evals(0.3, 0.40), "trl": evals(0.3, 0.44)}, {"v4rl": evals(0.3, 0.42), "trl": evals(0.3, 0.40)},
             {"v4rl": evals(0.3, 0.38), "trl": evals(0.3, 0.46)}]
    point = _learning(seeds)["pass@1"][1]
    assert point["diff"] == pytest.approx((-0.04 + 0.02 - 0.08) / 3)
    assert point["diff_se_sampling"] == pytest.approx(statistics.sqrt(6 * 0.01 ** 2) / 3)
    assert point["diff_se_seeds"] == pytest.approx(statistics.stdev([-0.04, 0.02, -0.08]) / statistics.sqrt(3))
    assert point["diff_se"] == max(point["diff_se_sampling"], point["diff_se_seeds"])
    assert point["no_worse"] == (point["diff"] >= -2 * point["diff_se"])
    one = _learning(seeds[:1])["pass@1"][1]
    assert one["diff_se"] == pytest.approx(statistics.sqrt(2) * 0.01) and one["diff_se_seeds"] is None
    assert [e["pass@1"] for e in _mean_evals([s["trl"] for s in seeds])] == pytest.approx([0.3, 1.3 / 3])


def test_e2e_arms_change_one_setting_each_and_unknown_ones_are_refused():
    from bench.e2e_arms import ARMS, arm_config, parse_arms

    base = v4rl_config(E2ESettings(steps=2, prompts_per_step=4, n_samples=2))
    assert arm_config("v4rl", base) is base
    changed = {arm: {k for k, v in arm_config(arm, base).to_dict().items() if base.to_dict().get(k) != v}
               for arm in ARMS if arm not in ("v4rl", "trl-like")}
    assert changed == {"bf16-rollout": {"rollout_weights", "quantization_aware"},
                       "no-fake-quant": {"quantization_aware"},
                       "no-correction": {"rollout_correction"}, "full-sequences": {"share_prompt_prefix"},
                       "one-micro-batch": {"max_tokens_per_gpu"}, "trl-eps": {"loop"}}
    assert parse_arms("trl-like, no-correction") == ["v4rl", "no-correction", "trl-like"]
    with pytest.raises(ValueError, match=r"unknown arm\(s\) \['tis'\]; choose from v4rl"):
        parse_arms("tis")
