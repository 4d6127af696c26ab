"""Bad inputs (issue 8): malformed dataset rows, reward-function failures, invalid flow parameters and corrupted
checkpoints are counted and reported, and where the run cannot go on it stops with an error naming the file /
field / step and the fix -- never a crash without context.

  - a JSONL with each kind of malformed row loads through the run's loader with exact per-reason counts, a
    warning per dropped row (the first few of each reason) and, in a real training run, an event and a report
    line; too few usable rows is a DatasetError naming the file and the setting to change;
  - a reward function that fails on some samples, through rl.loop's real reward path (inline, thread pool,
    process pool): those samples score 0, rollout/grader_errors counts them, the type and first message are
    logged once, and over max_grader_error_ratio the step stops with GraderFailed;
  - invalid parameters through the real flow calls (rl-pipeline, nightly-validation) fail before anything
    runs, naming the parameter and the fix, without echoing secret-looking values; a data file with a malformed
    line counts it as a dropped row, and too few usable rows fail preflight once, not retried, in one line
    (every `v4rl` command's mistakes: tests/test_bad_inputs_cli.py);
  - corrupted training checkpoints (truncated or garbage shard, missing shard / metadata / common.pt /
    trainer state, a tensor missing from the metadata or the master weights) fail naming the file (and the
    tensor) and how to resume.

    .venv/bin/python -m pytest tests/test_bad_inputs.py -q
"""

from __future__ import annotations

import functools
import json
import logging
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch

from rl.grading import Grader, GraderFailed
from rl.loop import Completion, LoopConfig, evaluate, rollout_step
from rl.rewards import strict_math_reward
from tests.prefect_server import flow_run_children

PROMPT = "Compute {a}+{b}. Answer in \\boxed{{}}."
BAD_LABEL = "9" * 300  # longer than rl.rewards.MAX_ANSWER_CHARS: math-verify refuses it (a grader error, not "wrong")


# ============================================================================================== datasets


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


MALFORMED = [
    {"prompt": PROMPT.format(a=1, b=1), "label": "2"},  # 0 kept
    {"prompt": PROMPT.format(a=2, b=2), "answer": "4"},  # 1 missing_label (the label field is absent)
    {"prompt": 7, "label": "7"},  # 2 prompt_type (not a string)
    {"prompt": {"text": "hi"}, "label": "1"},  # 3 prompt_type
    {"prompt": "x" * 5000, "label": "1"},  # 4 over_context (5001 tokens + 8 new > 4096)
    {"prompt": PROMPT.format(a=3, b=4), "label": None},  # 5 missing_label (null)
    {"prompt": PROMPT.format(a=5, b=4), "label": 9},  # 6 kept, label "9"
] + [{"prompt": PROMPT.format(a=i, b=i)} for i in range(10, 15)]  # 7-11 missing_label


@pytest.fixture(scope="module")
def encode():
    from transformers import AutoTokenizer

    from engines.train.run import prompt_encoder
    from tests.conftest import TINY_BASE

    return prompt_encoder(AutoTokenizer.from_pretrained(TINY_BASE))


def test_malformed_rows_are_dropped_with_exact_counts_and_named_in_warnings(tmp_path, encode, caplog):
    from engines.train.run import load_data_file
    from tests.conftest import TINY_BASE

    path = _write_jsonl(tmp_path / "train.jsonl", MALFORMED)
    with caplog.at_level(logging.WARNING, logger="rl.datasets"):
        data = load_data_file(str(path), encode, base=str(TINY_BASE), max_new_tokens=8, min_rows=2)
    assert data.labels == ["2", "9"] and data.source_indices == [0, 6]
    report = data.report
    assert (report.n_rows, report.n_kept, report.n_dropped) == (12, 2, 10)
    assert report.dropped == {"missing_label": 7, "prompt_type": 2, "over_context": 1}
    assert report.examples["missing_label"] == [1, 5, 7, 8, 9]  # the first five only
    warned = [r.getMessage() for r in caplog.records if r.name == "rl.datasets"]
    assert len(warned) == 5 + 2 + 1  # at most five warnings per reason
    assert all(str(path) in m for m in warned)
    assert any("row 4 (0-based) dropped [over_context]: 5001 prompt tokens" in m for m in warned)
    assert any("row 2 (0-based) dropped [prompt_type]" in m and "'prompt'" in m for m in warned)
    assert not any("row 10 " in m for m in warned)


def test_too_few_usable_rows_fail_naming_the_file_and_the_fix(tmp_path, encode):
    from engines.train.run import load_data_file
    from rl.datasets import DatasetError
    from tests.conftest import TINY_BASE

    path = _write_jsonl(tmp_path / "small.jsonl", MALFORMED)
    with pytest.raises(DatasetError) as info:
        load_data_file(str(path), encode, base=str(TINY_BASE), max_new_tokens=8, min_rows=4, what="train_data",
                       needed_by="prompts_per_step=4")
    message = str(info.value)
    assert message.startswith(f"{path}: train_data has only 2 usable rows of 12")
    assert "needs at least 4 (prompts_per_step=4)" in message and "missing_label=7" in message
    assert "lower prompts_per_step" in message
    all_bad = _write_jsonl(tmp_path / "all_bad.jsonl", MALFORMED[1:6])
    with pytest.raises(DatasetError, match=r"all_bad\.jsonl: eval_data has no usable row: all 5 were dropped"):
        load_data_file(str(all_bad), encode, base=str(TINY_BASE), max_new_tokens=8, min_rows=1, what="eval_data")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DatasetError, match=r"empty\.jsonl: dataset has no rows"):
        load_data_file(str(empty), encode, base=str(TINY_BASE), max_new_tokens=8, min_rows=1)


# ============================================================================================== grader


class _EchoRollout:
    """Prompt [i] answers with token [i] for every sample; decode turns it into "\\boxed{i}"."""

    def generate(self, prompts, *, n, temperature, max_new_tokens, seed):
        return [[Completion([p[0]], [0.0], "stop") for _ in range(n)] for p in prompts]


def _boxed(ids: list[int]) -> str:
    return f"the answer is \\boxed{{{ids[0]}}}"


LABELS = ["0", BAD_LABEL, "2", "3"]  # row 1's label breaks the grader: its 4 samples of 16 fail
LOOP = LoopConfig(prompts_per_step=4, n_samples=4, dynamic_sampling=False)
STRICT = functools.partial(strict_math_reward, literal_only=True)  # the reward the training run uses


def _step(grader: Grader, step: int = 1):
    return rollout_step(step, rollout=_EchoRollout(), prompts=[[i] for i in range(4)], labels=LABELS, config=LOOP,
                        decode=_boxed, grader=grader)


@pytest.mark.parametrize("workers,pool", [(0, "thread"), (2, "thread"), (2, "process")])
def test_grader_failures_score_zero_are_counted_and_identical_in_every_pool(workers, pool, caplog):
    with caplog.at_level(logging.WARNING, logger="rl.grading"), Grader(STRICT, workers=workers, pool=pool) as grader:
        groups, metrics = _step(grader)
        _step(grader, step=2)
    assert metrics["rollout/grader_errors"] == 4 and metrics["rollout/grader_error_ratio"] == 0.25
    assert metrics["rollout/raw_reward"] == 12 / 16  # the other three prompts are answered correctly
    assert {g.label: g.rewards for g in groups}[BAD_LABEL] == [0.0] * 4
    assert (grader.total, grader.total_errors) == (32, 8)
    logged = [r.getMessage() for r in caplog.records if r.name == "rl.grading"]
    assert len(logged) == 1, logged  # type and first message once, not once per sample or step
    assert "step 1 (rollout): the reward function raised GraderError: [bad_label]" in logged[0]
    assert "4 of 16 samples" in logged[0]


def test_a_broken_grader_stops_the_step_over_the_cap(caplog):
    with pytest.raises(GraderFailed) as info:
        _step(Grader(STRICT, max_error_ratio=0.2))
    message = str(info.value)
    assert message.startswith("step 1 (rollout): the reward function failed on 4 of 16 samples (25%, over "
                              "max_grader_error_ratio 20%)")
    assert "GraderError: [bad_label]" in message and "raise max_grader_error_ratio" in message

    def crashing(text: str, label: str) -> float:
        raise ZeroDivisionError("division by zero in the grader")

    with pytest.raises(GraderFailed, match=r"failed on 16 of 16 samples .*ZeroDivisionError: division by zero"), \
            Grader(crashing, workers=2) as threaded:
        _step(threaded)
    with pytest.raises(ValueError, match=r"max_grader_error_ratio=1\.5 must lie in \[0, 1\]"):
        Grader(STRICT, max_error_ratio=1.5)


def test_non_numeric_rewards_and_evaluation_count_as_grader_errors():
    def odd(text: str, label: str):
        return {"0": float("nan"), "2": "1.0"}.get(label, 1.0)

    with Grader(odd, max_error_ratio=1.0) as grader:
        groups, metrics = _step(grader)
    assert metrics["rollout/grader_errors"] == 8  # NaN for label 0, a string for label 2
    assert grader.first_error_by_type == {"returned a non-finite number": "the reward function returned nan, expected "
                                                                          "a finite number",
                                          "returned str": "the reward function returned str '1.0', expected a number"}
    result = evaluate(_EchoRollout(), [[i] for i in range(4)], LABELS, n=4, max_new_tokens=4, decode=_boxed,
                      seed=0, grader=Grader(STRICT))
    assert result["grader_errors"] == 4 and result["pass@1"] == 0.75


# ============================================================================================== a real run


def test_training_run_reports_dropped_rows_and_grader_errors(tiny_base, tmp_path, monkeypatch):
    """run_training end to end (in-process engines, one step): the data file's drop counts and the grader's
    failures reach metrics.jsonl, events.jsonl and report.md."""
    import rl.rewards
    from engines.runs.report import write_report
    from engines.train.run import TrainRunConfig, run_training

    rows = [{"prompt": PROMPT.format(a=a, b=b), "label": str(a + b)} for a, b in ((12, 30), (25, 17), (40, 41))]
    rows += [{"prompt": PROMPT.format(a=33, b=44), "label": "GRADER-BREAKS"}]
    path = _write_jsonl(tmp_path / "train.jsonl", rows + MALFORMED[1:6])

    def flaky(text: str, label: str, *, literal_only: bool = False) -> float:
        if label == "GRADER-BREAKS":
            raise KeyError("grader lookup failed")
        return strict_math_reward(text, label, literal_only=literal_only)

    monkeypatch.setattr(rl.rewards, "strict_math_reward", flaky)
    run_dir = tmp_path / "run"
    config = TrainRunConfig(base=str(tiny_base), steps=1, save_interval=1, n_eval=8, use_ray=False,
                            train_data=str(path),
                            loop=LoopConfig(prompts_per_step=4, n_samples=4, eval_interval=0, max_new_tokens=6,
                                            dynamic_sampling=False))
    run_training(run_dir, config, log=lambda m: None)
    (row,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert row["rollout/grader_errors"] == 4 and row["rollout/grader_error_ratio"] == 0.25
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    data = [e for e in events if e["action"] == "data"]
    assert len(data) == 1 and data[0]["what"] == "train_data" and data[0]["path"] == str(path)
    assert data[0]["dropped"] == {"missing_label": 2, "over_context": 1, "prompt_type": 2}
    assert data[0]["n_kept"] == 4 and data[0]["n_rows"] == 9
    (grader_event,) = [e for e in events if e["action"] == "grader_error"]
    assert grader_event["step"] == 1 and "KeyError: 'grader lookup failed'" in grader_event["message"]
    markdown = write_report(run_dir)["markdown"]
    assert "train_data: " in markdown and "missing_label=2 (rows 4, 8)" in markdown
    assert "KeyError: 'grader lookup failed'" in markdown

    run_training(run_dir, config, log=lambda m: None)  # a new segment of the same run (nothing left to train)
    again = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert sum(e["action"] == "data" for e in again) == 1  # recorded once per run, not once per segment


# ============================================================================================== flow parameters


def _failed_flow_message(flow, **params) -> str:
    state = flow(params=params, return_state=True)
    assert state.is_failed(), state
    return f"{state.message}\n{state.result(raise_on_failure=False)}"


def test_invalid_pipeline_parameters_fail_before_anything_runs(prefect_server, tmp_path):  # noqa: F811
    from flows.nightly import nightly_validation
    from flows.rl_pipeline import rl_pipeline

    runs = str(tmp_path / "runs")
    (tmp_path / "afile").write_text("a file where a folder belongs")
    small = dict(runs_root=runs, steps=1, eval_interval=1, prompts_per_step=1, n_eval=1, eval_samples=1,
                 align_prompts=1, use_ray=False)  # cheap, should a case ever pass validation by mistake
    cases = [
        (dict(steps=0, eval_interval=0), "params.steps: Input should be greater than or equal to 1"),
        (dict(steps=2, eval_interval=5), "eval_interval (5) exceeds steps (2); lower it"),
        (dict(train_data=str(tmp_path / "nope.jsonl")), f"train_data {tmp_path / 'nope.jsonl'} does not exist"),
        (dict(eval_data=str(tmp_path / "data.csv")), "unsupported file type '.csv'; give a .jsonl, .json or .parquet"),
        (dict(max_grader_error_ratio=2.0), "params.max_grader_error_ratio: Input should be less than or equal to 1"),
        (dict(hf_checkpoint=str(tmp_path)), "config.json is missing; a HF checkpoint directory needs its config.json"),
        (dict(hf_checkpoint=str(tmp_path / "nope")), "nope: no such directory; give the directory of a HF"),
        (dict(preset="tiny_gpu"), "unknown preset 'tiny_gpu'; did you mean 'tiny-cpu'?"),
        (dict(input_key=""), "params.input_key: String should have at least 1 character"),
        (dict(preset="dsv4-flash-mi355x", miles_check_dir=str(tmp_path / "miles")),
         "miles_check_dir " + str(tmp_path / "miles") + ": no such directory on this host"),
        (dict(preset="dsv4-flash-mi355x", miles_check_dir=str(tmp_path)),  # a directory, but not a Miles tree
         f"miles_check_dir: {tmp_path} has no miles_plugins/models/deepseek_v4/deepseek_v4.py: not a Miles checkout"),
        (dict(runs_root=str(tmp_path / "afile")), "runs_root " + str(tmp_path / "afile") + " is a file"),
        (dict(store_url="ftp://host/x"), "params.store_url: Value error, store_url:"),
    ]
    for bad, expected in cases:
        message = _failed_flow_message(rl_pipeline, **{**small, **bad})
        assert "Flow run received invalid parameters" in message and expected in message, (bad, message)
    assert not Path(runs).exists()  # nothing ran: no run directory

    secret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
    message = _failed_flow_message(rl_pipeline, **small, s3_endpoint_url=f"http://AKIDEXAMPLE:{secret}@127.0.0.1:9")
    assert "s3_endpoint_url embeds credentials" in message and secret not in message
    message = _failed_flow_message(rl_pipeline, **small, s3_endpoint_url="http://127.0.0.1:port")
    assert "s3_endpoint_url must look like http://127.0.0.1:9000" in message
    message = _failed_flow_message(rl_pipeline, **small, s3_secret_block=secret)
    assert "s3_secret_block must be the name of a Prefect Secret block" in message and secret not in message

    message = _failed_flow_message(nightly_validation, date="2025-02-30", runs_root=runs)
    assert "params.date: Value error, date '2025-02-30' is not a calendar date; give YYYY-MM-DD" in message


def test_a_broken_data_file_fails_the_flow_once_with_its_one_line(prefect_server, tmp_path, capfd):  # noqa: F811
    """A JSONL with one malformed line in 101 rows: the line is a dropped row (counted, named), and where the usable
    rows fall short preflight fails once, not retried, with the DatasetError's line; no datasets/Arrow traceback."""
    from flows.rl_pipeline import rl_pipeline

    rows = [json.dumps({"prompt": PROMPT.format(a=i, b=i), "label": str(2 * i)}) for i in range(101)]
    rows[50] = '{"prompt": "Compute 50+50.", "label": '
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(rows) + "\n")
    state = rl_pipeline(params=dict(runs_root=str(tmp_path / "runs"), train_data=str(data), prompts_per_step=128,
                                    steps=1, eval_interval=1, n_eval=1, eval_samples=1, align_prompts=1,
                                    use_ray=False), return_state=True)
    assert state.is_failed(), state
    message = str(state.result(raise_on_failure=False))
    assert f"{data}: train_data has only 100 usable rows of 101, and the run needs at least 128 " \
           "(prompts_per_step=128)" in message, message
    assert "malformed_json=1 (rows 50)" in message and "lower prompts_per_step" in message
    output = capfd.readouterr()
    assert "ArrowInvalid" not in output.out + output.err and "DatasetGenerationError" not in output.out + output.err
    runs, _ = flow_run_children(state.state_details.flow_run_id, expect=("preflight",))
    preflight = [r for r in runs if r.name.startswith("preflight")]
    assert len(preflight) == 1 and preflight[0].run_count == 1, [(r.name, r.run_count) for r in runs]
    assert [r.name for r in runs if not r.name.startswith("preflight")] == []  # nothing after it ran


# ============================================================================================== checkpoints


@pytest.fixture(scope="module")
def training_checkpoint(tmp_path_factory, tiny_checkpoint):
    """A training checkpoint root with iterations 1 and 2 of the random tiny model; read-only."""
    from checkpoints.hf import load_hf_checkpoint
    from engines.runs.checkpointing import save_training_checkpoint

    cfg, native = load_hf_checkpoint(tiny_checkpoint)
    root = tmp_path_factory.mktemp("train_ckpt") / "checkpoints"
    for step in (1, 2):
        save_training_checkpoint(root, step, cfg, native, trainer_state={"adam": torch.ones(3)},
                                 rng=torch.get_rng_state(), extra={"step": step})
    return root, cfg


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _drop_tensor_from_metadata(path: Path, key: str) -> None:
    with open(path, "rb") as f:
        md = pickle.load(f)
    del md.state_dict_metadata[key]
    md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != key}
    with open(path, "wb") as f:
        pickle.dump(md, f)


def _drop_master_tensor(path: Path, name: str) -> None:
    state = torch.load(path, weights_only=True)
    del state["master"][name]
    torch.save(state, path)


HEAD = "output_layer.weight"  # a Megatron key of the tiny model
CORRUPTIONS = {
    "truncated shard": (lambda d: _truncate(d / "__0_0.distcp"), r"__0_0\.distcp is truncated: '[\w.]+' chunk"),
    "garbage shard": (lambda d: (d / "__0_0.distcp").write_bytes(bytes((d / "__0_0.distcp").stat().st_size)),
                      r"__0_0\.distcp: chunk \(0, 0\) of '[\w.]+' is corrupt"),
    "missing shard": (lambda d: (d / "__0_0.distcp").unlink(), r"__0_0\.distcp is missing; it holds '[\w.]+'"),
    "truncated metadata": (lambda d: _truncate(d / ".metadata"), r"\.metadata: cannot read the DCP metadata"),
    "missing metadata": (lambda d: (d / ".metadata").unlink(), r"\.metadata is missing"),
    "tensor missing": (lambda d: _drop_tensor_from_metadata(d / ".metadata", HEAD),
                       rf"\.metadata has no tensor '{HEAD}' \(1 requested tensors missing in all\)"),
    "bad metadata.json": (lambda d: (d / "metadata.json").write_text("{"), r"metadata\.json: not valid JSON"),
    "missing common.pt": (lambda d: (d / "common.pt").unlink(), r"common\.pt is missing"),
    "truncated trainer state": (lambda d: _truncate(d / "trainer_state.pt"),
                                r"trainer_state\.pt: cannot read the trainer state \(RuntimeError: .*truncated or "
                                r"corrupt"),
    "garbage trainer state": (lambda d: (d / "trainer_state.pt").write_bytes(b"not a checkpoint"),
                              r"trainer_state\.pt: cannot read the trainer state"),
    "missing trainer state": (lambda d: (d / "trainer_state.pt").unlink(),
                              r"trainer_state\.pt is missing: iteration 2 is incomplete"),
    "master tensor missing": (lambda d: _drop_master_tensor(d / "trainer_state.pt", "head.weight"),
                              r"trainer_state\.pt: master weight 'head\.weight' is missing"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupted_training_checkpoint_names_the_file_and_how_to_resume(case, training_checkpoint, tmp_path):
    from checkpoints.torch_dist import TorchDistError
    from engines.runs.checkpointing import latest_step, load_training_checkpoint

    source, cfg = training_checkpoint
    root = tmp_path / "checkpoints"
    shutil.copytree(source, root)
    corrupt, expected = CORRUPTIONS[case]
    corrupt(root / "iter_0000002")
    with pytest.raises(TorchDistError) as info:  # a ValueError: the task is not retried, nothing hangs
        load_training_checkpoint(root, latest_step(root), cfg)
    message = str(info.value)
    assert str(root / "iter_0000002") in message, message
    assert re.search(expected, message), message
    assert f"write 1 into {root / 'latest_checkpointed_iteration.txt'}" in message  # the way out
    (root / "latest_checkpointed_iteration.txt").write_text("1")  # ... which works
    assert load_training_checkpoint(root, latest_step(root), cfg)["step"] == 1


def test_cli_data_flags_reach_the_training_config(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import engines.train.run as run_module
    from v4rl.cli import app

    seen = []
    monkeypatch.setattr(run_module, "run_training", lambda out, config, **kw: seen.append(config) or {"evals": []})
    train, held_out = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    for path in (train, held_out):
        _write_jsonl(path, [{"question": "Compute 1+1.", "answer": 2}])
    result = CliRunner().invoke(app, ["train", "--out", str(tmp_path / "run"), "--train-data", str(train),
                                      "--eval-data", str(held_out), "--input-key", "question", "--label-key",
                                      "answer", "--preset", "TINY_CPU"])
    assert result.exit_code == 0, result.output
    assert (seen[0].train_data, seen[0].eval_data) == (str(train), str(held_out))
    assert (seen[0].input_key, seen[0].label_key) == ("question", "answer")
