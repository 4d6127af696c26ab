"""The Miles backend on CPU: checkpoint discovery and resume, metric-line parsing, and the log-streaming runner
(timeouts, Ray job stop, silent-restart detection) against tiny scripts that print Miles-format lines.
The Miles run itself is `gpu`-marked. NUM_GPUS = 0 for the rest; about 5 s.

    .venv/bin/python -m pytest tests/test_miles.py -q
"""

from __future__ import annotations

import math
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engines.miles import (TRACKER, MilesJob, MilesRunError, MilesTimeout, find_resume, launcher_argv,
                                 list_checkpoints, parse_metric_line, prepare_resume, read_tracker, run_job,
                                 run_miles, to_v4rl_metrics)


# -------------------------------------------------------------------------------------- checkpoint layouts
def _save(root: Path, iteration: int, *, complete: bool = True, data_state: bool = True) -> None:
    it = root / f"iter_{iteration:07d}"
    it.mkdir(parents=True)
    (it / "common.pt").write_bytes(b"")
    (it / "__0_0.distcp").write_bytes(b"")
    if complete:  # torch_dist: rank 0 writes metadata.json last
        (it / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    if data_state:
        (root / "rollout").mkdir(exist_ok=True)
        (root / "rollout" / f"global_dataset_state_dict_{iteration}.pt").write_bytes(b"")


def test_resume_from_the_latest_complete_iteration(tmp_path):
    for it in (9, 19):
        _save(tmp_path, it)
    (tmp_path / TRACKER).write_text("19\n")
    assert [c.iteration for c in list_checkpoints(tmp_path)] == [9, 19]
    resume = find_resume(tmp_path)
    assert (resume.iteration, resume.start_rollout_id, resume.repair_tracker, resume.notes) == (19, 20, False, ())


def test_tracker_pointing_at_an_unfinished_save_is_repaired(tmp_path):
    _save(tmp_path, 9)
    _save(tmp_path, 19, complete=False)  # crashed mid-save after the tracker moved on
    (tmp_path / TRACKER).write_text("19")
    resume = prepare_resume(tmp_path)
    assert (resume.iteration, resume.start_rollout_id, resume.repair_tracker) == (9, 10, True)
    assert "iter_0000009" in resume.notes[0]
    assert read_tracker(tmp_path) == 9 and not (tmp_path / (TRACKER + ".tmp")).exists()


def test_missing_tracker_and_missing_data_cursor(tmp_path):
    _save(tmp_path, 29, data_state=False)
    resume = prepare_resume(tmp_path)
    assert resume.iteration == 29 and read_tracker(tmp_path) == 29
    assert any("data cursor" in n for n in resume.notes)


def test_fresh_start_and_converted_release_checkpoint(tmp_path):
    from engines.miles import MilesCheckpointError

    assert find_resume(tmp_path / "absent").iteration is None
    (tmp_path / TRACKER).write_text("release")
    (tmp_path / "release").mkdir()
    with pytest.raises(MilesCheckpointError, match="start at rollout 1, skipping rollout 0"):
        find_resume(tmp_path)  # Megatron would load it as iteration 0 and Miles start at rollout 1
    (tmp_path / TRACKER).write_text("40")  # names a save that never finished: Megatron would crash on --load
    assert prepare_resume(tmp_path).repair_tracker and read_tracker(tmp_path) is None


def test_resume_flags_reach_the_job_and_the_seed_launcher_command():
    from engines.miles.launch import SEED_RUN
    from engines.profiles import get_profile
    from engines.miles import Resume, build_command

    job = MilesJob(run_id="r", hf_checkpoint="/hf", ref_load="/td", save_dir="/s", extra_args=("--lr", "2e-6"))
    resume = Resume(19, 20, extra_args=("--no-load-optim",))
    argv = build_command(SEED_RUN, job, resume=resume).argv
    assert argv[-3:] == ["--no-load-optim", "--lr", "2e-6"] and argv[argv.index("--load") + 1] == "/s"
    seed = launcher_argv(SEED_RUN, get_profile("mi355x"), job, resume)
    extra = seed[seed.index("--extra-args") + 1].split()
    assert extra[-3:] == ["--no-load-optim", "--lr", "2e-6"] and "--load" in extra


# ----------------------------------------------------------------------------------------- metric lines
STEP = ("[2026-06-01 10:00:00] log_utils.py:541 - step 12: {'train/loss': -0.011, 'train/pg_loss': -0.012, "
        "'train/pg_clipfrac': 0.003, 'train/train_rollout_logprob_abs_diff': 0.091, 'train/tis': 0.98, "
        "'train/tis_clipfrac': 0.01, 'train/grad_norm': 0.42, 'train/entropy_loss': 0.55, 'train/step': 12}")
ROLLOUT = ("(MegatronTrainRayActor pid=2211, ip=10.1.0.3) [2026-06-01 10:00:00] log_utils.py:102 - rollout 12: "
           "{'rollout/raw_reward': 0.5625, 'rollout/response_lengths': 3012.5, 'rollout/log_probs': nan, "
           "'rollout/step': 12}")
PERF = ("[2026-06-01 10:00:00] metrics.py:88 - perf 12: {'rollout/response_len/mean': 3012.5, "
        "'rollout/truncated_ratio': 0.55, 'perf/rollout_time': 812.4, 'perf/tokens_per_gpu_per_sec': 1650.0}")
EVAL = ("[2026-06-01 10:00:00] metrics.py:53 - eval 10: {'eval/aime-none_reward_ratio': 0.0, 'eval/aime': 0.49, "
        "'eval/aime-truncated_ratio': 0.55, 'eval/aime-pass@8': np.float64(0.67), 'eval/step': 10}")


def test_parse_miles_metric_lines():
    step = parse_metric_line(STEP)
    assert (step.kind, step.index, step.step) == ("step", 12, 12)
    assert step.metrics["train/train_rollout_logprob_abs_diff"] == 0.091 and "train/step" not in step.metrics
    rollout = parse_metric_line(ROLLOUT)
    assert rollout.kind == "rollout" and rollout.metrics["rollout/raw_reward"] == 0.5625
    assert math.isnan(rollout.metrics["rollout/log_probs"])
    perf = parse_metric_line(PERF)
    assert perf.metrics["rollout/truncated_ratio"] == 0.55 and perf.metrics["perf/rollout_time"] == 812.4
    ev = parse_metric_line(EVAL)
    assert ev.metrics == {"eval/aime-none_reward_ratio": 0.0, "eval/aime": 0.49, "eval/aime-truncated_ratio": 0.55,
                          "eval/aime-pass@8": 0.67}  # Miles' own names (A13), np.float64 read (A14)
    for noise in ("[INFO] step 3 done", "perf 3: not a dict", "rollout 1: {'a': __import__('os')}", "",
                  "Training step 3: {'x': 1"):
        assert parse_metric_line(noise) is None


def test_metric_names_are_ours_by_design():
    same = {"rollout/raw_reward": 1.0, "train/pg_loss": 0.1, "train/grad_norm": 2.0, "perf/train_time": 3.0}
    assert to_v4rl_metrics({**same, "train/step": 4, "flag": True, "name": "x"}) == same


# ------------------------------------------------------------------------------------------- the runner
def _script(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "fake_miles.py"
    path.write_text("import sys, time\n" + textwrap.dedent(body))
    return [sys.executable, "-u", str(path)]


def test_run_streams_lines_metrics_and_log(tmp_path):
    argv = _script(tmp_path, f"""
        print("Job 'raysubmit_AbC123' submitted successfully")
        print({PERF!r})
        print("something on stderr", file=sys.stderr)
        print({STEP!r})
    """)
    seen, records = [], []
    driver_log = f"{PERF}\n{STEP}\n"  # what the head kept: the stream had all of it
    out = run_miles(argv, log_path=tmp_path / "logs" / "run.log", on_line=seen.append, on_record=records.append,
                    env={"V4RL_TEST": "1"}, job_logs=lambda job_id, env: driver_log)
    assert out.returncode == 0 and out.ray_job_id == "raysubmit_AbC123"
    assert [r.kind for r in out.records] == ["perf", "step"] == [r.kind for r in records]
    assert out.last("step").metrics["train/grad_norm"] == 0.42
    assert "something on stderr" in seen and (tmp_path / "logs" / "run.log").read_text().count("\n") == 4


def test_idle_timeout_kills_the_run_and_stops_the_ray_job(tmp_path):
    argv = _script(tmp_path, """
        print("Job 'raysubmit_hang' submitted successfully", flush=True)
        time.sleep(60)
    """)
    stopped = []
    t0 = time.monotonic()
    with pytest.raises(MilesTimeout, match="printed nothing for 1s") as err:
        run_miles(argv, log_path=tmp_path / "run.log", idle_timeout_s=1.0, kill_grace_s=2.0,
                  stop_job=lambda job, env: stopped.append(job) or True)
    assert time.monotonic() - t0 < 10 and stopped == ["raysubmit_hang"]
    assert err.value.outcome.returncode != 0 and "raysubmit_hang" in str(err.value)


def test_total_timeout_and_nonzero_exit(tmp_path):
    chatty = _script(tmp_path, """
        while True:
            print("still rolling out", flush=True)
            time.sleep(0.1)
    """)
    with pytest.raises(MilesTimeout, match="timeout_s=1"):
        run_miles(chatty, log_path=tmp_path / "a.log", timeout_s=1.0, kill_grace_s=2.0)
    failing = _script(tmp_path, """
        print("RuntimeError: RCCL watchdog caught collective operation timeout")
        sys.exit(3)
    """)
    with pytest.raises(MilesRunError, match="exited with code 3") as err:
        run_miles(failing, log_path=tmp_path / "b.log")
    assert "RCCL watchdog" in str(err.value)


def test_a_resume_that_starts_from_rollout_zero_fails_loudly(tmp_path):
    argv = _script(tmp_path, f"""
        print({PERF.replace("perf 12", "perf 0")!r}, flush=True)
        time.sleep(30)
    """)
    with pytest.raises(MilesRunError, match="started at rollout 0, not at 20"):
        run_miles(argv, log_path=tmp_path / "c.log", expect_start_rollout=20, kill_grace_s=2.0)


# --------------------------------------------------------------------------------------- the real thing
@pytest.mark.gpu
def test_miles_run_on_the_cluster(tmp_path):
    """Runs the seed preset through Miles on a live Ray cluster. Needs MILES_DIR, HF_CHECKPOINT, REF_LOAD,
    RAY_ADDRESS (and the cluster the preset names); a few steps: V4RL_MILES_EXTRA='--num-rollout 2'."""
    from engines.profiles.site import Site

    needed = ("MILES_DIR", "HF_CHECKPOINT", "REF_LOAD", "RAY_ADDRESS", "MASTER_ADDR", "NCCL_SOCKET_IFNAME",
              "NCCL_IB_HCA")
    if any(k not in os.environ for k in needed):
        pytest.skip(f"set {', '.join(needed)} to run Miles on a cluster")
    site = Site(ray_address=os.environ["RAY_ADDRESS"], master_addr=os.environ["MASTER_ADDR"],
                socket_ifname=os.environ["NCCL_SOCKET_IFNAME"], ib_hca=os.environ["NCCL_IB_HCA"])
    job = MilesJob(run_id=f"v4rl-gpu-test-{int(time.time())}", hf_checkpoint=os.environ["HF_CHECKPOINT"],
                   ref_load=os.environ["REF_LOAD"], save_dir=str(tmp_path / "ckpt"), miles_dir=os.environ["MILES_DIR"],
                   log_dir=str(tmp_path), extra_args=tuple(os.environ.get("V4RL_MILES_EXTRA", "").split()))
    outcome = run_job("dsv4-flash-mi355x", job, site=site, idle_timeout_s=3600)
    assert outcome.last("step") is not None
    assert outcome.last("step").metrics["train/train_rollout_logprob_abs_diff"] < 0.5
