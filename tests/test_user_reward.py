"""The user's data and reward (issue 15): the grader is chosen per dataset, and a reward function can be plugged in
by import path with TRL's contract, its failures counted as grader errors.

  - `auto` grades the synthetic task exactly as before (literal-only, the same function object the 100-step run
    used) and a user's data file with math-verify equivalence; both built-ins pass their golden cases;
  - a bad reward setting (unknown name, module not on sys.path, missing attribute, a class, a function with another
    signature) fails at config validation in TrainRunConfig, `v4rl train` and the flow parameters, naming the
    setting and the fix; preflight calls a user's function on one sample before anything runs;
  - a plugged-in reward, through rl.loop's real reward path inline, in a thread pool and in a spawned process pool
    (picklable: imported by path in each worker), gets the prompt text, scores each sample, and a sample it fails on
    (raise, NaN, None, a bare float, the wrong count, a string) scores 0 and is counted; over the cap, GraderFailed;
  - a few GRPO steps on a DAPO-format file (message-list prompts, integer labels): once graded by math-verify, once
    by a plugged-in reward (process pool), with its failures in metrics.jsonl and events.jsonl; the Prefect form
    offers both settings, and an rl-pipeline run (real Prefect server on 127.0.0.1) trains with a plugged-in reward.

    .venv/bin/python -m pytest tests/test_user_reward.py -q
"""

from __future__ import annotations

import doctest
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import rl.reward_spec
import rl.rewards
from rl.grading import GraderFailed
from rl.loop import Completion, LoopConfig, rollout_step
from rl.math_task import make_prompt
from rl.reward_spec import RewardCheckFailed, RewardSpecError, check_reward, check_reward_spec, resolve_reward
from engines import TINY_BASE

REPO = Path(__file__).resolve().parent.parent
MODULE = "v4rl_test_user_rewards"
REWARDS = textwrap.dedent('''
    """Reward functions a user would write (TRL's contract), and ones that break it."""
    import asyncio
    import math

    import numpy


    def score(prompts, completions, label, **kwargs):
        """0.5 when the completion contains the label, else 0.25; no reference answer for 77 (a failure)."""
        out = []
        for prompt, completion, gold in zip(prompts, completions, label):
            if gold == "77":
                raise KeyError("no reference for 77")
            if "Compute" not in prompt:
                raise ValueError(f"expected the prompt text, got {prompt!r}")
            out.append(0.5 if gold in completion else 0.25)
        return out


    def nan(prompts, completions, label, **kwargs):
        return [math.nan for _ in completions]


    def none(prompts, completions, label, **kwargs):
        return [None for _ in completions]


    def bare(prompts, completions, label, **kwargs):
        return 1.0


    def two(prompts, completions, label, **kwargs):
        return [1.0, 1.0]


    def text(prompts, completions, label, **kwargs):
        return ["1" for _ in completions]


    def float32(prompts, completions, label, **kwargs):
        return [numpy.float32(0.5) for _ in completions]


    async def later(prompts, completions, label, **kwargs):
        await asyncio.sleep(0)
        return [1.0 for _ in completions]


    def per_sample(completion, label):
        return 1.0


    def trl_accuracy(completions, solution, **kwargs):
        return [1.0 for _ in completions]


    def accuracy(prompts, completions, label, **kwargs):
        """TRL's own accuracy_reward (conversational completions, a solution column) through the README's wrapper."""
        from trl.rewards import accuracy_reward

        return accuracy_reward([[{"role": "assistant", "content": c}] for c in completions], solution=label)


    class Scorer:
        pass
''')


@pytest.fixture(scope="module", autouse=True)
def user_module(tmp_path_factory):
    """The user's reward module, importable by name (spawned grader processes inherit sys.path)."""
    folder = tmp_path_factory.mktemp("user-code")
    (folder / f"{MODULE}.py").write_text(REWARDS)
    (folder / "v4rl_test_broken_rewards.py").write_text("raise RuntimeError('module-level bug')\n")
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(folder))
        yield folder
    sys.modules.pop(MODULE, None)


def test_module_doctest_shows_the_contract():
    result = doctest.testmod(rl.reward_spec, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 5 and result.failed == 0


# ============================================================================================== built-ins


def test_auto_grades_the_synthetic_task_as_before_and_a_data_file_with_math_verify():
    synthetic = resolve_reward("auto")
    assert synthetic.name == "literal" and not synthetic.takes_prompt
    assert synthetic.fn.func is rl.rewards.strict_math_reward and synthetic.fn.keywords == {"literal_only": True}
    user_data = resolve_reward("auto", "dapo.jsonl")
    assert user_data.name == "math-verify" and user_data.fn.keywords == {"literal_only": False}
    for response, label, literal, equivalent in (("\\boxed{47+38}", "85", 0.0, 1.0),
                                                 ("\\boxed{\\frac{1}{2}}", "0.5", 0.0, 1.0),
                                                 ("\\boxed{85}", "85", 1.0, 1.0), ("\\boxed{84}", "85", 0.0, 0.0)):
        assert (synthetic.fn(response, label), user_data.fn(response, label)) == (literal, equivalent), response
    assert resolve_reward("literal", "dapo.jsonl").name == "literal"  # an explicit choice wins over the dataset


def test_built_in_graders_pass_their_golden_cases_and_a_misgrading_one_is_refused(monkeypatch):
    assert [check_reward(resolve_reward(name), "Compute 1+1.", "2") for name in ("literal", "math-verify")] == [6, 6]
    monkeypatch.setattr(rl.rewards, "strict_math_reward", lambda response, label, literal_only: 1.0)
    with pytest.raises(RewardCheckFailed, match=r"reward=literal misgrades its golden cases .*'\\\\boxed\{84\}'"):
        check_reward(resolve_reward("literal"), "Compute 1+1.", "2")


# ============================================================================================== bad settings


@pytest.mark.parametrize("spec, message", [
    ("nope", r"reward='nope' is neither a grader nor an import path; use auto .*package\.module:function"),
    ("v4rl_no_such_module:f", r"no module named 'v4rl_no_such_module' on sys\.path; put the folder holding it on "
                              r"PYTHONPATH"),
    (f"{MODULE}:absent", rf"'{MODULE}' has no attribute 'absent'; check the function name after the colon"),
    (f"{MODULE}:Scorer", r"is a type, not a function; point it at a function"),
    (f"{MODULE}:per_sample", r"per_sample\(completion, label\) cannot be called with the keywords v4rl passes .*"
                             r"accept prompts, completions and label"),
    (f"{MODULE}:trl_accuracy", r"missing a required argument: 'solution'.*wrap a function that reads other columns"),
    (f"{MODULE}:", r"must look like package\.module:function"),
    ("v4rl_test_broken_rewards:f", r"importing 'v4rl_test_broken_rewards' raised RuntimeError: module-level bug"),
])
def test_a_bad_reward_setting_names_the_setting_and_the_fix(spec, message):
    with pytest.raises(RewardSpecError, match=message):
        check_reward_spec(spec)


def test_bad_reward_settings_fail_in_the_config_the_cli_and_the_flow_form(tmp_path):
    from pydantic import ValidationError
    from typer.testing import CliRunner

    from engines.train.run import TrainRunConfig
    from flows.params import PipelineParams
    from v4rl.cli import app

    with pytest.raises(RewardSpecError, match=rf"eval_reward='{MODULE}:absent': .*has no attribute 'absent'"):
        TrainRunConfig(eval_reward=f"{MODULE}:absent")
    result = CliRunner().invoke(app, ["train", "--out", str(tmp_path / "run"), "--reward", "math"])
    assert result.exit_code == 1 and "reward='math' is neither a grader nor an import path" in result.output
    assert not (tmp_path / "run").exists()  # nothing ran
    with pytest.raises(ValidationError, match=r"reward='v4rl_no_such_module:f': no module named"):
        PipelineParams(reward="v4rl_no_such_module:f")
    with pytest.raises(ValidationError, match=r"applies to the embedded tiny-cpu run only; on dsv4-flash-mi355x"):
        PipelineParams.preset_defaults("dsv4-flash-mi355x", reward=f"{MODULE}:score")
    params = PipelineParams(reward=f" {MODULE}:score ", eval_reward="math-verify")
    assert (params.reward, params.eval_reward) == (f"{MODULE}:score", "math-verify")
    assert params.training_fingerprint() != PipelineParams().training_fingerprint()
    assert PipelineParams(eval_reward="math-verify").training_fingerprint() == PipelineParams().training_fingerprint()


def test_cli_reward_flags_reach_the_training_config(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import engines.train.run as run_module
    from v4rl.cli import app

    seen = []
    monkeypatch.setattr(run_module, "run_training", lambda out, config, **kw: seen.append(config) or {"evals": []})
    result = CliRunner().invoke(app, ["train", "--out", str(tmp_path / "run"), "--reward", f"{MODULE}:score",
                                      "--eval-reward", "math-verify", "--max-grader-error-ratio", "0.5"])
    assert result.exit_code == 0, result.output
    assert (seen[0].reward, seen[0].eval_reward, seen[0].max_grader_error_ratio) == (f"{MODULE}:score",
                                                                                     "math-verify", 0.5)
    assert seen[0].to_dict()["reward"] == f"{MODULE}:score"
    assert "reward" not in run_module.TrainRunConfig().to_dict()  # runs written before the field resume unchanged


def test_preflight_calls_a_user_reward_on_one_sample(tmp_path):
    from prefect.logging import disable_run_logger

    from flows.params import PipelineParams
    from tasks.preflight import preflight

    backend = PipelineParams.preset_defaults("tiny-cpu", runs_root=str(tmp_path)).backend()
    with disable_run_logger():
        out = preflight.fn("tiny-cpu", backend=backend, reward=f"{MODULE}:score")
    assert (out["reward_cases_checked"], out["eval_reward_cases_checked"]) == (1, 6)
    with pytest.raises(RewardCheckFailed, match=rf"eval_reward={MODULE}:nan failed on a well-formed sample "
                                                r"\(completion '\\\\boxed\{\d+\}'.*: the reward function "
                                                r"returned nan, expected a finite number; fix the function"), \
            disable_run_logger():
        preflight.fn("tiny-cpu", backend=backend, eval_reward=f"{MODULE}:nan")
    data = tmp_path / "seventy-seven.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "Compute 40+37."}], "label": 77}) + "\n")
    with pytest.raises(RewardCheckFailed, match=r"KeyError: 'no reference for 77'"), disable_run_logger():
        preflight.fn("tiny-cpu", backend=backend, train_data=str(data), hf_checkpoint=str(TINY_BASE),
                     reward=f"{MODULE}:score")


# ============================================================================================== through rl.loop


class _EchoRollout:
    """Prompt [100 + i] answers [i] for every sample."""

    def generate(self, prompts, *, n, temperature, max_new_tokens, seed):
        return [[Completion([p[0] - 100], [0.0], "stop") for _ in range(n)] for p in prompts]


def _decode(ids: list[int]) -> str:
    value = ids[0]
    return f"Compute {value - 100}+0. Answer in \\boxed{{}}." if value >= 100 else f"so \\boxed{{{value}}}"


LABELS = ["0", "77", "2", "9"]  # row 1 has no reference answer (the reward raises): 4 samples of 16 fail
LOOP = LoopConfig(prompts_per_step=4, n_samples=4, dynamic_sampling=False)


@pytest.mark.parametrize("workers, pool", [(0, "thread"), (2, "thread"), (2, "process")])
def test_a_plugged_in_reward_scores_each_sample_and_its_failures_are_counted(workers, pool):
    choice = resolve_reward(f"{MODULE}:score")
    with choice.grader(workers=workers, pool=pool) as grader:
        groups, metrics = rollout_step(1, rollout=_EchoRollout(), prompts=[[100 + i] for i in range(4)],
                                       labels=LABELS, config=LOOP, decode=_decode, grader=grader)
    rewards = {g.label: g.rewards for g in groups}
    assert rewards == {"0": [0.5] * 4, "77": [0.0] * 4, "2": [0.5] * 4, "9": [0.25] * 4}
    assert metrics["rollout/grader_errors"] == 4 and metrics["rollout/grader_error_ratio"] == 0.25
    assert metrics["rollout/raw_reward"] == pytest.approx((4 * 0.5 + 4 * 0.5 + 4 * 0.25) / 16)
    assert grader.first_error_by_type == {"KeyError": "the reward function raised KeyError: 'no reference for 77'"}
    with pytest.raises(GraderFailed, match=r"step 2 \(rollout\): the reward function failed on 4 of 16 samples"), \
            choice.grader(max_error_ratio=0.2, workers=workers, pool=pool) as strict:
        rollout_step(2, rollout=_EchoRollout(), prompts=[[100 + i] for i in range(4)], labels=LABELS, config=LOOP,
                     decode=_decode, grader=strict)


@pytest.mark.parametrize("name, reward, error", [
    ("nan", 0.0, "the reward function returned nan, expected a finite number"),
    ("none", 0.0, "the reward function returned None, expected a number"),
    ("bare", 0.0, "the reward function returned float 1.0, expected a list with one number per completion"),
    ("two", 0.0, "the reward function returned 2 rewards for 1 completion, expected 1"),
    ("text", 0.0, "the reward function returned str '1', expected a number"),
    ("float32", 0.5, None),
    ("later", 1.0, None),
])
def test_what_a_plugged_in_reward_returns_is_one_finite_number_or_a_counted_failure(name, reward, error, caplog):
    with caplog.at_level("WARNING", logger="rl.grading"), \
            resolve_reward(f"{MODULE}:{name}").grader(max_error_ratio=1.0) as grader:
        result = grader.grade(["\\boxed{2}"], ["2"], where="test", prompts=["Compute 1+1."])
    # a value that came back is reported as returned, never as "raised" (it raised nothing)
    assert [r.getMessage().startswith(f"test: {error}") for r in caplog.records] == ([True] if error else [])
    assert "raised" not in caplog.text
    assert result.rewards == [reward] and result.errors == (error is not None)
    assert (result.first_error or "").startswith(error or "") and (result.first_error is None) == (error is None)


def test_trl_accuracy_reward_plugs_in_through_a_wrapper_in_a_process_pool():
    pytest.importorskip("trl", reason="TRL comes with the bench extra (part of the test install)")
    with resolve_reward(f"{MODULE}:accuracy").grader(workers=2, pool="process") as grader:
        result = grader.grade(["so \\boxed{\\frac{1}{2}}", "so \\boxed{3}", "so \\boxed{0.5}"], ["0.5", "0.5", "1/2"],
                              where="test", prompts=["Half of one?"] * 3)
    assert (result.rewards, result.errors) == ([1.0, 0.0, 1.0], 0)


def test_a_grader_that_takes_prompts_refuses_a_call_without_them():
    with pytest.raises(ValueError, match=r"the reward function takes prompts; pass one prompt per response"):
        resolve_reward(f"{MODULE}:score").grader().grade(["\\boxed{2}"], ["2"], where="test")


# ============================================================================================== training


def _dapo_file(path: Path, pairs: list[tuple[int, int]]) -> Path:
    """DAPO-Math-17k's row shape: a message-list prompt, an integer label (one row with a system message)."""
    rows = []
    for i, (a, b) in enumerate(pairs):
        messages = [{"role": "user", "content": make_prompt(a, b)}]  # the synthetic task's wording, as a chat
        if i == 0:
            messages.insert(0, {"role": "system", "content": "Answer briefly."})
        rows.append({"prompt": messages, "label": a + b, "metadata": {"source": "test"}})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _train(tiny_base, run_dir: Path, **config) -> tuple[list[dict], list[str]]:
    from engines.train.run import TrainRunConfig, run_training

    logged: list[str] = []
    cfg = TrainRunConfig(base=str(tiny_base), steps=2, save_interval=2, n_eval=4, lr=1e-3, use_ray=False,
                         loop=LoopConfig(prompts_per_step=4, n_samples=4, eval_interval=2, eval_samples=4,
                                         max_new_tokens=8, dynamic_sampling=False), **config)
    run_training(run_dir, cfg, log=logged.append)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, logged


def test_training_on_dapo_format_data_with_math_verify(tiny_base, tmp_path):
    train = _dapo_file(tmp_path / "train.jsonl", [(12, 30), (25, 17), (40, 41), (33, 11)])
    held_out = _dapo_file(tmp_path / "eval.jsonl", [(21, 21), (15, 16), (30, 14), (27, 13)])
    rows, logged = _train(tiny_base, tmp_path / "run", train_data=str(train), eval_data=str(held_out))
    assert [r["step"] for r in rows] == [1, 2]
    assert "reward: math-verify (training, reward=auto), math-verify (held-out pass@k, eval_reward=auto)" in logged
    for row in rows:
        assert 0.0 <= row["rollout/raw_reward"] <= 1.0 and row["rollout/grader_errors"] == 0
        assert (16 * row["rollout/raw_reward"]) == pytest.approx(round(16 * row["rollout/raw_reward"]))  # 0/1 each
        assert math.isfinite(row["train/train_rollout_logprob_abs_diff"])
    evals = [json.loads((tmp_path / "run" / "eval" / f"step_00000{s}.json").read_text()) for s in (0, 2)]
    assert all(e["n_problems"] == 4 and e["grader_errors"] == 0 and 0 <= e["pass@1"] <= 1 for e in evals)
    # the grader credits the model's answers to these prompts (the base solves about a third of such problems)
    assert sum(r["rollout/raw_reward"] for r in rows) + sum(e["pass@1"] for e in evals) > 0


def test_training_on_dapo_format_data_with_a_plugged_in_reward(tiny_base, tmp_path):
    train = _dapo_file(tmp_path / "train.jsonl", [(12, 30), (25, 17), (40, 37), (33, 11)])  # 40+37: no reference
    rows, logged = _train(tiny_base, tmp_path / "run", train_data=str(train), reward=f"{MODULE}:score",
                          grader_workers=2, grader_pool="process")
    assert f"reward: {MODULE}:score (training, reward={MODULE}:score), literal (held-out pass@k, eval_reward=auto)" \
        in logged
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:  # every step holds each of the 4 rows once: the 77 group's 4 samples fail, the rest score
        assert row["rollout/grader_errors"] == 4 and row["rollout/grader_error_ratio"] == 0.25
        quarters = 16 * row["rollout/raw_reward"] / 0.25  # 12 samples of 0.25 or 0.5, 4 of 0
        assert quarters == pytest.approx(round(quarters)) and 12 <= round(quarters) <= 24
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    (failure,) = [e for e in events if e["action"] == "grader_error"]
    assert failure["step"] == 1 and "KeyError: 'no reference for 77'" in failure["message"]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["reward"] == f"{MODULE}:score"


# ============================================================================================== the flow


def test_the_flow_form_offers_the_reward_and_a_pipeline_run_trains_with_it(prefect_server, tiny_base, tmp_path,  # noqa: F811
                                                                           user_module):
    from prefect.utilities.callables import parameter_schema

    from flows.params import PipelineParams
    from flows.rl_pipeline import rl_pipeline

    form = parameter_schema(rl_pipeline).model_dump()["definitions"]["PipelineParams"]["properties"]
    assert form["reward"]["default"] == "auto" and "module:function" in form["reward"]["description"]
    assert form["eval_reward"]["default"] == "auto" and "pass@k" in form["eval_reward"]["description"]

    train = _dapo_file(tmp_path / "train.jsonl", [(12, 30), (25, 17), (40, 37), (33, 11)])
    held_out = _dapo_file(tmp_path / "eval.jsonl", [(21, 21), (15, 16), (30, 14), (27, 13)])
    params = PipelineParams.preset_defaults(
        "tiny-cpu", run_key="user-reward", runs_root=str(tmp_path / "runs"), hf_checkpoint=str(tiny_base), steps=2,
        eval_interval=2, prompts_per_step=4, n_samples=4, n_eval=4, eval_samples=4, align_prompts=2, use_ray=False,
        train_data=str(train), eval_data=str(held_out), reward=f"{MODULE}:score", eval_reward="math-verify")
    # A process of its own, as a Prefect worker runs a flow: the reward module is found through PYTHONPATH there
    # (and this process's Prefect event worker never sees a second test server's flows).
    run = ("import json, sys; from flows.params import PipelineParams; from flows.rl_pipeline import rl_pipeline; "
           "state = rl_pipeline(PipelineParams.model_validate_json(sys.argv[1]), return_state=True); "
           "print(state.type.value); sys.exit(0 if state.is_completed() else 1)")
    env = {**prefect_server["env"], "PYTHONPATH": os.pathsep.join([str(user_module), str(REPO)])}
    done = subprocess.run([sys.executable, "-c", run, params.model_dump_json()], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    run_dir = tmp_path / "runs" / "user-reward"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["rollout/grader_errors"]) for r in rows] == [(1, 4), (2, 4)]  # the 40+37 group each step
    assert json.loads((run_dir / "config.json").read_text())["reward"] == f"{MODULE}:score"
    evals = [json.loads((run_dir / "eval" / f"step_00000{s}.json").read_text()) for s in (0, 2)]
    assert [(e["n_problems"], e["grader_errors"]) for e in evals] == [(4, 0), (4, 0)]
