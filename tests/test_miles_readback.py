"""Reading Miles back on CPU: its metric lines (in the format its logging prints them, numpy values included),
a save directory laid out as Megatron and Miles write it, a killed run and its resume simulated at the file
level, and the run directory the recorder writes (the same metrics.jsonl, eval/step_XXXXXX.json, report and
nightly verdict as tiny-cpu). The on-cluster run is `gpu`-marked at the end. NUM_GPUS = 0; a few seconds.

The lines below are what Miles main (31f1ca961) logs: `configure_logger_raw`'s format
`[%(asctime)s.%(msecs)03d <process>] %(filename)s:%(lineno)d - %(message)s`, messages
`f"step {accumulated_step_id}: {log_dict}"` (log_utils.py:542, printed again by megatron_utils/model.py:854),
`f"rollout {rollout_id}: {reduced}"` (log_utils.py:123), `f"perf {rollout_id}: {log_dict}"` (ray/rollout/
metrics.py:89 and train_metric_utils.py:56) and `f"eval {rollout_id}: {log_dict}"` (ray/rollout/metrics.py:53),
with pass@k as `compute_pass_rate`'s np.float64. tests/conformance/test_miles_log_and_gate.py makes Miles' own
functions print them.

    .venv/bin/python -m pytest tests/test_miles_readback.py -q
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from engines.miles import (TRACKER, MilesCheckpointError, MilesRecorder, MilesResultsError, data_cursor_path,
                                 eval_datasets, eval_result, find_resume, parse_metric_line, prepare_resume,
                                 read_tracker, record_lines, record_log)

MILES_FORMAT = "[%(asctime)s.%(msecs)03d {name}] %(filename)s:%(lineno)d - %(message)s"


def miles_line(message: str, *, process: str = "RolloutManager", filename: str = "metrics.py", lineno: int = 53,
               ray_prefix: str | None = "(RolloutManager pid=4242, ip=10.1.0.3) ") -> str:
    """One log line as Miles' logging formats it (and as Ray forwards a worker's stdout to the driver)."""
    formatter = logging.Formatter(MILES_FORMAT.format(name=process), datefmt="%Y-%m-%d %H:%M:%S")
    record = logging.LogRecord("miles", logging.INFO, filename, lineno, message, None, None)
    record.filename = filename
    return (ray_prefix or "") + formatter.format(record)


def pass_rate(rewards: list[float], group: int) -> dict[str, np.float64]:
    """What compute_pass_rate returns (np.float64 values): the unbiased estimator, averaged with numpy."""
    r = np.array(rewards).reshape(-1, group)
    out = {}
    for k in (2 ** i for i in range(int(math.log2(group)) + 1)):
        est = [1.0 if group - c < k else 1.0 - np.prod(1.0 - k / np.arange(group - c + 1, group + 1))
               for c in np.sum(r == 1, axis=1)]
        out[f"pass@{k}"] = np.mean(est)
    return out


# -------------------------------------------------------------------------------------------- log lines
def eval_line(rollout_id: int, dataset_rewards: dict[str, list[float]], *, group: int = 4) -> str:
    log_dict: dict = {}
    for name, rewards in dataset_rewards.items():
        log_dict[f"eval/{name}-none_reward_ratio"] = 0.0
        log_dict[f"eval/{name}"] = sum(rewards) / len(rewards)
        log_dict[f"eval/{name}-truncated_ratio"] = 0.25
        log_dict |= {f"eval/{name}-{k}": v for k, v in pass_rate(rewards, group).items()}
    return miles_line(f"eval {rollout_id}: {log_dict}")


def rollout_side_perf(rollout_id: int, reward: float) -> str:
    log_dict = {"rollout/response_len/mean": 100.0 + rollout_id, "rollout/response_len/median": 99.0,
                "rollout/truncated_ratio": 0.5, "rollout/repetition_frac": 0.0, "perf/rollout_time": 81.5,
                "passrate/pass@1": np.float64(reward)}
    return miles_line(f"perf {rollout_id}: {log_dict}", lineno=89)


def trainer_lines(rollout_id: int, reward: float, diff: float) -> list[str]:
    trainer = dict(process="MegatronTrainRayActor", filename="log_utils.py",
                   ray_prefix="(MegatronTrainRayActor pid=2211, ip=10.1.0.4) ")
    rollout = {"rollout/raw_reward": reward, "rollout/rewards": 0.0, "rollout/log_probs": -0.31,
               "rollout/rollout_log_probs": -0.3}
    step = {"train/loss": -0.01, "train/pg_loss": -0.012, "train/entropy_loss": 0.55, "train/pg_clipfrac": 0.003,
            "train/train_rollout_logprob_abs_diff": diff, "train/tis": 0.98, "train/tis_clipfrac": 0.01,
            "train/grad_norm": 0.42, "train/lr-pg_0": 1e-6, "train/step": rollout_id}
    return [miles_line(f"rollout {rollout_id}: {rollout}", lineno=123, **trainer),
            miles_line(f"step {rollout_id}: {step}", lineno=542, **trainer),
            miles_line(f"step {rollout_id}: {step}", lineno=854, **{**trainer, "filename": "model.py"}),  # twice
            miles_line(f"perf {rollout_id}: {{'perf/actor_train_time': 40.5, 'perf/train_time': 41.0}}", lineno=56,
                       **{**trainer, "filename": "train_metric_utils.py"})]


def test_miles_lines_parse_with_numpy_values_and_names_as_emitted():
    ev = parse_metric_line(eval_line(9, {"aime-2024": [1, 0, 0, 1, 0, 0, 0, 0]}))
    assert (ev.kind, ev.index) == ("eval", 9)
    assert ev.metrics["eval/aime-2024-pass@1"] == pytest.approx(0.25)  # np.float64(0.25) read, never dropped (A14)
    assert ev.metrics["eval/aime-2024-pass@4"] == pytest.approx(0.5)
    assert "eval/aime-2024/pass@4" not in ev.metrics  # names exactly as Miles emits them (A13)
    perf = parse_metric_line(rollout_side_perf(3, 0.5) + " [repeated 2x across cluster]")
    assert perf.metrics["passrate/pass@1"] == 0.5 and perf.metrics["rollout/truncated_ratio"] == 0.5
    step = parse_metric_line(trainer_lines(3, 0.5, 0.01)[1])
    assert (step.kind, step.index, step.step) == ("step", 3, 3) and "train/step" not in step.metrics
    odd = parse_metric_line(miles_line("perf 1: {'a': np.int64(3), 'b': np.True_, 'c': np.float64(nan), "
                                       "'d': tensor(0.5, device='cuda:0'), 'e': -np.float32(1.5)}"))
    assert odd.metrics["a"] == 3 and "b" not in odd.metrics and math.isnan(odd.metrics["c"])
    assert odd.metrics["d"] == 0.5 and odd.metrics["e"] == -1.5
    for hostile in ("perf 1: {'a': np.load('x')}", "perf 1: {'a': os.system('x')}", "eval 1: {'a': np.float64(1, 2)}"):
        assert parse_metric_line(miles_line(hostile)) is None


def test_eval_datasets_by_miles_rules():
    metrics = parse_metric_line(eval_line(19, {"aime": [1, 0, 0, 0], "aime-2024": [1, 1, 1, 0]})).metrics
    metrics |= {"eval/lag_steps": 0.0, "eval/duration_seconds": 12.0, "eval/aime/response_len/mean": 3012.0}
    ds = eval_datasets(metrics)
    assert sorted(ds) == ["aime", "aime-2024"]  # lag_steps / duration_seconds are not datasets
    assert ds["aime-2024"]["pass@1"] == pytest.approx(0.75) and ds["aime"]["pass@1"] == pytest.approx(0.25)
    assert ds["aime"]["response_len/mean"] == 3012.0 and ds["aime"]["truncated_ratio"] == 0.25
    res = eval_result(metrics, primary="aime-2024", eval_problems={"aime-2024": 30}, n_samples=4)
    assert (res["pass@1"], res["n_problems"], res["n_samples"], res["dataset"]) == (pytest.approx(0.75), 30, 4,
                                                                                    "aime-2024")
    with pytest.raises(MilesResultsError, match="--log-passrate"):
        eval_result({"eval/aime-none_reward_ratio": 0.0, "eval/aime": 0.3})
    with pytest.raises(MilesResultsError, match="no eval dataset 'math'"):
        eval_result(metrics, primary="math")


# ------------------------------------------------------------------------------- a save dir as Miles writes
def save_rollout(save: Path, rollout_id: int, *, ranks: int = 4, killed_after: str | None = None) -> None:
    """What one Miles save of rollout `rollout_id` leaves, in the order it is written (checkpoints.py doc);
    `killed_after` stops it after "shards" (no metadata.json), "model" (no tracker) or "tracker" (no cursor)."""
    it = save / f"iter_{rollout_id:07d}"
    it.mkdir(parents=True)
    torch.save({"iteration": rollout_id, "checkpoint_version": 3.0}, it / "common.pt")
    for rank in range(ranks):
        (it / f"__{rank}_0.distcp").write_bytes(os.urandom(64))
    (it / ".metadata").write_bytes(b"\x80\x04N.")
    if killed_after == "shards":
        return
    (it / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    if killed_after == "model":
        return
    (save / TRACKER).write_text(str(rollout_id))  # Megatron writes the bare number
    if killed_after == "tracker":
        return
    cursor = data_cursor_path(save, rollout_id)
    cursor.parent.mkdir(exist_ok=True)
    torch.save({"sample_offset": 32 * (rollout_id + 1), "epoch_id": 0, "sample_group_index": 32 * (rollout_id + 1),
                "sample_index": 256 * (rollout_id + 1), "metadata": {}}, cursor)


def test_resume_follows_miles_rules_on_a_killed_save(tmp_path):
    save = tmp_path / "save"
    assert find_resume(save).start_rollout_id == 0  # nothing yet: --ref-load, rollout 0
    save_rollout(save, 1)
    save_rollout(save, 3)
    save_rollout(save, 5, killed_after="shards")  # killed while writing shards: tracker still says 3
    resume = prepare_resume(save)
    assert (resume.iteration, resume.start_rollout_id, resume.repair_tracker) == (3, 4, False)
    assert any("iter_0000005 is incomplete" in n for n in resume.notes)

    save_rollout(save, 7, killed_after="tracker")  # model and tracker saved, data cursor not: prompts would restart
    resume = prepare_resume(save)
    assert (resume.iteration, resume.start_rollout_id, read_tracker(save)) == (3, 4, 3)
    assert any("rollouts 4..7 are trained again" in n for n in resume.notes)


def test_lost_tracker_would_retrain_everything_and_is_rewritten(tmp_path):
    save = tmp_path / "save"
    save_rollout(save, 9)
    (save / TRACKER).unlink()  # Miles would load --ref-load and start at rollout 0 (arguments.py:3047-3058)
    resume = prepare_resume(save)
    assert (resume.start_rollout_id, read_tracker(save)) == (10, 9)
    save_rollout(save, 11, killed_after="model")  # a complete save whose tracker write was lost
    assert prepare_resume(save).start_rollout_id == 10  # its data cursor is missing: keep the consistent pair
    (save / TRACKER).write_text("release")
    with pytest.raises(MilesCheckpointError, match="point save_dir at an empty directory"):
        find_resume(save)


# ------------------------------------------------------------------------------- run directory from records
def run_lines(rollouts: range, *, eval_every: int, eval_before: bool, reward0: float = 0.2) -> list[str]:
    """The lines of one Miles run over `rollouts` in train.py's order (eval before training at the start)."""
    lines = ["Job 'raysubmit_%d' submitted successfully" % rollouts.start]
    if eval_before:
        lines.append(eval_line(rollouts.start, {"aime": [0, 0, 0, 1] * 2}))
    for r in rollouts:
        reward = reward0 + 0.01 * r
        lines += [rollout_side_perf(r, reward), *trainer_lines(r, reward, 0.005 + 1e-4 * r)]
        if (r + 1) % eval_every == 0:
            lines.append(eval_line(r, {"aime": [1, 0, 0, 1] * 2}))
    return lines


def test_recorder_writes_the_tiny_cpu_run_directory(tmp_path):
    from engines.runs.report import write_report

    rec = record_lines(run_lines(range(0, 4), eval_every=2, eval_before=True), tmp_path,
                       eval_problems={"aime": 2}, n_samples_per_eval_prompt=4)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] == rec.committed
    assert rows[0]["rollout/raw_reward"] == pytest.approx(0.2) and rows[3]["rollout/raw_reward"] == pytest.approx(0.23)
    assert rows[2]["train/train_rollout_logprob_abs_diff"] == pytest.approx(0.0052)
    assert rows[0]["rollout/response_len/mean"] == 100.0 and rows[0]["perf/actor_train_time"] == 40.5
    assert sorted(p.name for p in (tmp_path / "eval").iterdir()) == ["step_000000.json", "step_000002.json",
                                                                     "step_000004.json"]
    first = json.loads((tmp_path / "eval" / "step_000000.json").read_text())
    assert (first["pass@1"], first["n_problems"], first["n_samples"]) == (pytest.approx(0.25), 2, 4)
    assert first["source"] == "miles eval 0" and first["datasets"]["aime"]["pass@4"] == 1.0
    report = write_report(tmp_path, title="miles run")
    assert report["summary"]["pass@1_first"] == pytest.approx(0.25) and report["summary"]["pass@1_last"] == \
        pytest.approx(0.5)
    assert {"reward", "logprob_diff", "pass_at_k"} <= set(report["plots"]) and "| 4 |" in report["markdown"]


def test_killed_run_resumes_at_the_right_rollout_and_no_step_is_trained_twice(tmp_path):
    """Run 1 saves rollouts 1 and 3 and is killed after training rollout 5 while saving it; run 2 resumes.
    One log file holds both runs (run_miles appends); the run directory holds each step once, from the run
    whose weights training continued from."""
    save, run_dir, log = tmp_path / "save", tmp_path / "run", tmp_path / "miles.log"
    first = run_lines(range(0, 6), eval_every=2, eval_before=True, reward0=0.2)
    for r in (1, 3):
        save_rollout(save, r)
    save_rollout(save, 5, killed_after="shards")
    log.write_text("\n".join(first) + "\n")

    resume = prepare_resume(save)
    assert resume.start_rollout_id == 4  # Miles starts at the loaded iteration + 1
    # the live path: the task begins the recorder at the resume point before the resumed job's first line
    live = MilesRecorder(run_dir, eval_problems={"aime": 2}, n_samples_per_eval_prompt=4)
    for line in first:
        if (rec := parse_metric_line(line)) is not None:
            live.feed(rec)
    live.finish()
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    second = run_lines(range(resume.start_rollout_id, 8), eval_every=2, eval_before=False, reward0=0.5)
    resumed = MilesRecorder(run_dir, eval_problems={"aime": 2}, n_samples_per_eval_prompt=4)
    resumed.begin(resume.start_rollout_id)
    for line in second:
        if (rec := parse_metric_line(line)) is not None:
            resumed.feed(rec)
    resumed.finish()
    with log.open("a") as f:
        f.write("\n".join(second) + "\n")

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))  # continuous, each step once
    assert [round(r["rollout/raw_reward"], 2) for r in rows] == [0.2, 0.21, 0.22, 0.23, 0.54, 0.55, 0.56, 0.57]
    assert [json.loads(p.read_text())["step"] for p in sorted((run_dir / "eval").iterdir())] == [0, 2, 4, 6, 8]

    # the same directory rebuilt from the one appended log file
    again = tmp_path / "again"
    record_log(log, again, eval_problems={"aime": 2}, n_samples_per_eval_prompt=4)
    assert (again / "metrics.jsonl").read_text() == (run_dir / "metrics.jsonl").read_text()
    assert sorted(p.name for p in (again / "eval").iterdir()) == sorted(p.name for p in (run_dir / "eval").iterdir())
    # without the submission lines, the rollout side generating a trained rollout again marks the new run
    bare = tmp_path / "bare"
    record_lines([x for x in first + second if "submitted" not in x], bare)
    assert (bare / "metrics.jsonl").read_text() == (run_dir / "metrics.jsonl").read_text()


def test_eval_only_job_and_nightly_verdict_read_the_cluster_run(tmp_path):
    from rl.verdict import nightly_verdict

    rec = MilesRecorder(tmp_path, eval_only_step=0, eval_problems={"aime": 30}, n_samples_per_eval_prompt=8)
    rec.feed(parse_metric_line(eval_line(0, {"aime": [1, 0, 0, 0, 0, 0, 0, 0] * 30}, group=8)))
    rec.finish()
    assert rec.evaluated == [0] and not (tmp_path / "metrics.jsonl").exists()
    result = json.loads((tmp_path / "eval" / "step_000000.json").read_text())
    verdict = nightly_verdict({"align_mean": 0.02, "pass@1": result["pass@1"], "n_problems": result["n_problems"],
                               "n_samples": result["n_samples"]}, [{"pass@1": 0.12}, {"pass@1": 0.13}, {"pass@1": 0.125}])
    assert verdict.passed and verdict.checks["pass@1"]["graded_samples"] == 240


def test_bad_input_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="run_miles writes it"):
        record_log(tmp_path / "absent.log", tmp_path)
    with pytest.raises(ValueError, match="--num-steps-per-rollout"):
        MilesRecorder(tmp_path, num_steps_per_rollout=0)
    no_passk = miles_line("eval 0: {'eval/aime-none_reward_ratio': 0.0, 'eval/aime': 0.25}")
    with pytest.raises(MilesResultsError, match="--log-passrate"):
        record_lines([no_passk], tmp_path)


def test_records_the_stream_missed_are_read_from_the_heads_whole_log(tmp_path):
    """`ray job submit` stops streaming when its job dies: the last rollout's lines, printed by the driver before
    it died, come from `ray job logs` (the head's copy), so the run directory holds what Miles trained. Found by the
    cluster-rehearsal flow: rollout 2 trained and saved, its lines unread, the retry found nothing to train."""
    import sys

    from engines.miles.runner import MilesJobFailed, run_miles

    lines = run_lines(range(0, 3), eval_every=1, eval_before=True)
    streamed = lines[:next(i for i, line in enumerate(lines) if " perf 2: " in line)]  # ends before rollout 2
    script = tmp_path / "submit.py"
    script.write_text("import sys\n" + "".join(f"print({line!r}, flush=True)\n" for line in streamed)
                      + "sys.exit(1)\n")  # the job failed (its driver killed)
    recorder = MilesRecorder(tmp_path / "run", eval_problems={"aime": 2}, n_samples_per_eval_prompt=4)
    driver_log = "\n".join(lines[1:]) + "\n"  # what the head kept: the driver's lines, not the client's
    asked = []
    with pytest.raises(MilesJobFailed):
        run_miles([sys.executable, str(script)], log_path=tmp_path / "miles.log", on_record=recorder.feed,
                  job_logs=lambda job_id, env: asked.append(job_id) or driver_log,
                  job_actors=lambda job_id, env: f"the actors of job {job_id} have ended")
    recorder.finish()
    assert asked == ["raysubmit_0"]
    rows = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows == [1, 2, 3]  # rollout 2 trained before the driver died: its row is there
    assert sorted(p.name for p in (tmp_path / "run" / "eval").iterdir()) == [f"step_{s:06d}.json" for s in range(4)]
    log = (tmp_path / "miles.log").read_text()
    assert log.count(" perf 2: ") == driver_log.count(" perf 2: ") == 2 and "unread by the stream" in log

    # a head that cannot be asked: said in the log, nothing guessed
    recorder = MilesRecorder(tmp_path / "run2")
    with pytest.raises(MilesJobFailed):
        run_miles([sys.executable, str(script)], log_path=tmp_path / "miles2.log", on_record=recorder.feed,
                  job_logs=lambda job_id, env: None, job_actors=lambda job_id, env: "")
    assert "could not read the whole log of Ray job raysubmit_0" in (tmp_path / "miles2.log").read_text()
