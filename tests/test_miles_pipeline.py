"""The cluster path's training (engines/miles/pipeline.py `train_run`) wired end to end on CPU from the flow's
parameters (flows/rl_pipeline.py `_miles`): the real job builder (prepare_job, submit_argv), the derived job, the
runner and the recorder, against the file-level stand-in for `ray job submit` (tests/cluster_stand_in.py: it
behaves as Miles' train.py does: start at the tracker + 1, evaluate before training and every --eval-interval,
save every --save-interval and at the end with the data cursor) printing Miles' own log lines. It checks v4rl's
side: ONE job trains the run and evaluates itself, a killed job is resubmitted from its last complete checkpoint
with the records past it dropped, a load that skips a parameter fails at once naming it, a silent job is killed
and its Ray job stopped, a stop request stops the Ray job. Miles itself is checked by tests/conformance/ and the
`gpu` test. Why a stand-in: it produces in seconds what real Miles cannot cheaply (a job silent for idle_timeout_s,
a load printing `will skip`, long save/eval grids); Miles' own job through this code runs in
tests/conformance/test_cluster_rehearsal.py. NUM_GPUS = 0; about 60 s on a loaded 2-core machine (each stand-in job
imports torch).

    .venv/bin/python -m pytest tests/test_miles_pipeline.py -q
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from pathlib import Path

import pytest

from engines.profiles.site import Site
from engines.miles import MilesRunError
from engines.miles.checkpoints import list_checkpoints
from engines.miles.jobs import flag_values
from engines.miles.pipeline import LIVE_JOB, ClusterRun, evaluate_step, train_run
from tests.cluster_stand_in import cluster_params, install_stand_in, read_calls


@pytest.fixture
def cluster(tmp_path, monkeypatch) -> ClusterRun:
    for name, value in install_stand_in(tmp_path / "bin", tmp_path / "calls.jsonl").items():
        monkeypatch.setenv(name, value)
    return cluster_params(tmp_path).backend().run  # the Miles job of the backend the flow hands its tasks


def _submits(tmp_path: Path) -> list[dict]:
    return [c for c in read_calls(tmp_path / "calls.jsonl") if "submit" in c]


def _rows(run: ClusterRun) -> list[dict]:
    return [json.loads(x) for x in (Path(run.run_dir) / "metrics.jsonl").read_text().splitlines()]


def _evals(run: ClusterRun) -> list[int]:
    return sorted(int(p.stem.split("_")[1]) for p in (Path(run.run_dir) / "eval").glob("step_*.json"))


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_one_job_trains_the_run_evaluating_and_saving_itself(cluster, tmp_path):
    summary = train_run(cluster, 30)
    submits = _submits(tmp_path)
    assert len(submits) == 1, submits  # one job for 30 rollouts, step 0's evaluation included
    argv = submits[0]["argv"]
    assert submits[0]["submit"][:2] == ["job", "submit"] and "--runtime-env-json" in submits[0]["submit"]
    assert (flag_values(argv, "--num-rollout"), flag_values(argv, "--eval-interval"),
            flag_values(argv, "--save-interval")) == (["30"], ["10"], ["20"])  # the preset's save grid, not eval's
    assert flag_values(argv, "--skip-eval-before-train") is None and flag_values(argv, "--log-passrate") == []
    assert summary["evaluated"] == [0, 10, 20, 30] and summary["steps"] == list(range(1, 31))
    assert [c.iteration for c in list_checkpoints(cluster.job.save_dir) if c.complete] == [19, 29]
    assert [r["step"] for r in _rows(cluster)] == list(range(1, 31))
    assert not (Path(cluster.run_dir) / LIVE_JOB).exists()  # the live-job record goes when the job ends
    assert train_run(cluster, 30)["skipped"] and len(_submits(tmp_path)) == 1  # a finished run is not resubmitted


def test_killed_job_is_resubmitted_from_the_last_checkpoint_records_once(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("STAND_IN_DIE_AFTER", "25")
    with pytest.raises(MilesRunError, match="exited with code 7") as failed:
        train_run(cluster, 30)  # killed after training rollout 25; the last save was rollout 19
    assert failed.value.retryable
    assert [r["step"] for r in _rows(cluster)] == list(range(1, 27)) and _evals(cluster) == [0, 10, 20]
    monkeypatch.delenv("STAND_IN_DIE_AFTER")
    retried = train_run(cluster, 30)  # the task's retry
    first, second = _submits(tmp_path)
    assert second["start"] == 20 and retried["resumed_from"] == 20  # iteration 19 saved: tracker + 1
    assert flag_values(second["argv"], "--skip-eval-before-train") == []  # step 20 was evaluated before the kill
    assert retried["steps"] == list(range(21, 31)) and retried["evaluated"] == [30]
    rows = _rows(cluster)
    assert [r["step"] for r in rows] == list(range(1, 31))  # each rollout once: 21..26 of the dead job dropped
    assert [round(r["rollout/raw_reward"], 2) for r in rows] == [round(0.01 * r, 2) for r in range(30)]
    assert _evals(cluster) == [0, 10, 20, 30]
    evals = [json.loads(p.read_text()) for p in sorted((Path(cluster.run_dir) / "eval").iterdir())]
    assert [(e["step"], round(e["pass@1"], 6), e["n_problems"], e["n_samples"]) for e in evals] == [
        (0, 1 / 8, 3, 8), (10, 2 / 8, 3, 8), (20, 3 / 8, 3, 8), (30, 4 / 8, 3, 8)]


def test_load_that_skips_a_parameter_fails_at_once_naming_it(cluster, tmp_path, monkeypatch):
    from engines.miles.runner import MilesLoadSkipped

    monkeypatch.setenv("STAND_IN_SKIP_KEY", "decoder.layers.3.self_attention.wq_a.weight")
    monkeypatch.setenv("STAND_IN_ROLLOUT_S", "5")  # the job would run for minutes
    t0 = time.monotonic()
    with pytest.raises(MilesLoadSkipped, match=r"skipped 'decoder\.layers\.3\.self_attention\.wq_a\.weight'") as e:
        train_run(cluster, 30)
    assert time.monotonic() - t0 < 60 and not e.value.retryable
    calls = read_calls(tmp_path / "calls.jsonl")
    assert [c["stop"] for c in calls if "stop" in c] == [f"raysubmit_{_submits(tmp_path)[0]['pid']}"]
    assert not _alive(_submits(tmp_path)[0]["pid"])


def test_silent_job_is_killed_after_the_idle_timeout_and_its_ray_job_stopped(cluster, tmp_path, monkeypatch):
    from engines.miles.runner import MilesTimeout

    monkeypatch.setenv("STAND_IN_HANG_AT", "3")
    with pytest.raises(MilesTimeout, match="printed nothing for 40s") as e:  # above the stand-in's imports, loaded
        train_run(dataclasses.replace(cluster, idle_timeout_s=40.0), 30)
    assert e.value.retryable  # a stalled collective: the retry resubmits from the last checkpoint
    pid = _submits(tmp_path)[0]["pid"]
    assert [c["stop"] for c in read_calls(tmp_path / "calls.jsonl") if "stop" in c] == [f"raysubmit_{pid}"]
    assert not _alive(pid)


def test_stop_request_stops_the_ray_job(cluster, tmp_path, monkeypatch):
    from engines.miles.runner import MilesStopped
    from engines.runs.stopping import StopRequest

    monkeypatch.setenv("STAND_IN_ROLLOUT_S", "0.5")
    stop, raised = StopRequest(), []

    def training() -> None:
        try:
            train_run(cluster, 30, stop=stop)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            raised.append(exc)

    thread = threading.Thread(target=training)
    thread.start()
    deadline = time.monotonic() + 120
    while 10 not in (_evals(cluster) if (Path(cluster.run_dir) / "eval").exists() else []):
        assert time.monotonic() < deadline and thread.is_alive(), "evaluation 10 never landed"
        time.sleep(0.2)
    assert (Path(cluster.run_dir) / LIVE_JOB).exists()  # the cancel hook's record of the live job
    stop.request("the flow run was cancelled")
    thread.join(60)
    assert not thread.is_alive() and isinstance(raised[0], MilesStopped) and not raised[0].retryable
    pid = _submits(tmp_path)[0]["pid"]
    assert [c["stop"] for c in read_calls(tmp_path / "calls.jsonl") if "stop" in c] == [f"raysubmit_{pid}"]
    assert not _alive(pid) and not (Path(cluster.run_dir) / LIVE_JOB).exists()


def test_step_zero_by_miles_eval_only_job_and_what_cannot_run(cluster, tmp_path):
    from engines.profiles.site import SiteError
    from engines.miles import MilesResultsError

    assert evaluate_step(cluster, 0)["pass@1"] == pytest.approx(1 / 8)  # a user's evaluation outside a run
    first = _submits(tmp_path)[0]["argv"]
    assert flag_values(first, "--num-rollout") == ["0"] and flag_values(first, "--load") is None
    assert flag_values(first, "--ref-load") == [str(tmp_path / "runs" / "cluster-run" / "torch_dist")]
    with pytest.raises(MilesResultsError, match="iter_0000005 is not in"):
        evaluate_step(cluster, 6)  # no evaluation, no checkpoint: nothing to evaluate
    with pytest.raises(SiteError, match="ray_address"):
        train_run(dataclasses.replace(cluster, site=Site()), 2)
    assert len(_submits(tmp_path)) == 1  # nothing more was submitted
    assert os.environ["STAND_IN_CALLS"] == str(tmp_path / "calls.jsonl")
