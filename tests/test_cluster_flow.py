"""The rl-pipeline flow on the cluster preset (dsv4-flash-mi355x), through a real Prefect server on 127.0.0.1,
against the file-level stand-in for `ray job submit` (tests/cluster_stand_in.py: it behaves as Miles' train.py
does), for 30 rollouts with evaluation every 10 and a save every 20 (the preset's --save-interval):

  - ONE training task run and ONE Miles job; evaluations 0, 10, 20 and 30 each arrive as one evaluate subflow
    run, those of 0, 10 and 20 started before the job ended;
  - a job killed after rollout 25 is resubmitted once by the task's retry, resuming at rollout 20 (iteration 19
    saved: tracker + 1), and the records hold each rollout and each evaluation once; the retry says why;
  - cancelling the flow run (`prefect flow-run cancel`, the run on a process worker as deployed) calls
    `ray job stop` and leaves no stand-in process; a later run of the same run key resumes.

Why a stand-in here: these runs are 30 rollouts, saves every 20 and evaluations every 10 (the resume drops records
of 5 rollouts past a checkpoint 20 apart), which real Miles would take about 20 minutes a run to produce on CPU; the
real job, kill, resume and cancel run through the same flow in tests/conformance/test_cluster_rehearsal.py. This
file tests the training task's records, retry and cancel on that grid, not the cluster path: preflight, convert,
verify and align are replaced (run for real in the cluster rehearsal). About 3 minutes on a loaded 2-core machine.

    .venv/bin/python -m pytest tests/test_cluster_flow.py -q
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from engines.miles.jobs import flag_values
from tests.cluster_stand_in import cluster_params, install_stand_in, read_calls, replace_cluster_only_steps
from tests.prefect_server import flow_run_children

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    import flows.rl_pipeline as pipeline

    for name, value in install_stand_in(tmp_path / "bin", tmp_path / "calls.jsonl").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("STAND_IN_ROLLOUT_S", "0.5")  # evaluations land while the job runs
    for name in ("preflight", "convert", "verify", "align"):
        monkeypatch.setattr(pipeline, name, getattr(pipeline, name))  # so that the originals come back afterwards
    replace_cluster_only_steps(pipeline)
    return tmp_path / "calls.jsonl"


def _evaluations(subflows) -> list[tuple[int, float]]:
    """(step, start time) of each evaluate subflow run, in step order."""
    runs = [f for f in subflows if f.name and f.parameters.get("step") is not None and "run_dir" in f.parameters]
    return sorted((f.parameters["step"], f.start_time.timestamp()) for f in runs)


def _trains(tasks) -> list:
    return [t for t in tasks if t.name.rsplit("-", 1)[0] == "train"]


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _evals(run_dir: Path) -> list[int]:
    return sorted(int(p.stem.split("_")[1]) for p in (run_dir / "eval").glob("step_*.json"))


def test_one_job_and_its_evaluations_published_while_it_runs(prefect_server, stand_in, tmp_path,  # noqa: F811
                                                            monkeypatch):
    from flows.rl_pipeline import rl_pipeline

    # 2 s per rollout: an evaluation every 20 s, above an evaluate subflow's few seconds on a loaded 2-core machine
    monkeypatch.setenv("STAND_IN_ROLLOUT_S", "2")
    state = rl_pipeline(cluster_params(tmp_path), return_state=True)
    assert state.is_completed(), state
    calls = read_calls(stand_in)
    submits, ended = [c for c in calls if "submit" in c], [c for c in calls if "ended" in c]
    assert len(submits) == 1 and len(ended) == 1, calls  # one Miles job trained the whole run
    assert flag_values(submits[0]["argv"], "--num-rollout") == ["30"]
    tasks, subflows = flow_run_children(state.state_details.flow_run_id, expect=("train",))
    assert len(_trains(tasks)) == 1, [t.name for t in tasks]
    evaluations = _evaluations(subflows)
    assert [step for step, _ in evaluations] == [0, 10, 20, 30], evaluations  # each once, as a subflow run
    started_before_end = [step for step, t in evaluations if t < ended[0]["time"]]
    assert {0, 10, 20} <= set(started_before_end), (evaluations, ended)
    run_dir = tmp_path / "runs" / "cluster-run"
    assert _steps(run_dir) == list(range(1, 31)) and _evals(run_dir) == [0, 10, 20, 30]
    assert (run_dir / "report.md").exists() and (run_dir / "plots" / "pass_at_k.png").exists()


def test_killed_job_is_resubmitted_once_and_records_hold_each_step_once(prefect_server, stand_in, tmp_path,  # noqa: F811
                                                                         monkeypatch):
    from flows.rl_pipeline import rl_pipeline

    monkeypatch.setenv("STAND_IN_DIE_AFTER", "25")
    monkeypatch.setenv("STAND_IN_DIE_ONCE", str(tmp_path / "died"))
    state = rl_pipeline(cluster_params(tmp_path, run_key="killed"), return_state=True)
    assert state.is_completed(), state
    calls = read_calls(stand_in)
    submits = [c for c in calls if "submit" in c]
    assert [c["died"] for c in calls if "died" in c] == [25]
    assert [s["start"] for s in submits] == [0, 20], submits  # one resubmission, at iteration 19 + 1
    assert flag_values(submits[1]["argv"], "--skip-eval-before-train") == []  # step 20 was evaluated already
    tasks, subflows = flow_run_children(state.state_details.flow_run_id, expect=("train",))
    trains = _trains(tasks)
    assert len(trains) == 1 and trains[0].run_count == 2, [(t.name, t.run_count) for t in trains]
    assert [step for step, _ in _evaluations(subflows)] == [0, 10, 20, 30]
    run_dir = tmp_path / "runs" / "killed"
    assert _steps(run_dir) == list(range(1, 31)) and _evals(run_dir) == [0, 10, 20, 30]
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["action"] for e in events] == ["retry"] and "exited with code 7" in events[0]["message"]
    assert "attempt 1 of 3" in events[0]["message"]


def _prefect(env: dict, *args: str, timeout: float = 300) -> str:
    proc = subprocess.run([sys.executable, "-m", "prefect", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"prefect {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _flow_run(flow_run_id: str):
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id)


def test_cancel_stops_the_ray_job_and_a_later_run_resumes(prefect_server, stand_in, tmp_path,  # noqa: F811
                                                          monkeypatch):
    monkeypatch.setenv("STAND_IN_ROLLOUT_S", "3")  # the job still runs (90 s) when the cancel arrives
    pool = f"v4rl-cancel-{uuid.uuid4().hex[:6]}"
    env = {**prefect_server["env"], **{k: os.environ[k] for k in ("PATH", "STAND_IN_CALLS", "STAND_IN_ROLLOUT_S")},
           "PREFECT_LOGGING_LEVEL": "INFO"}
    _prefect(env, "work-pool", "create", pool, "--type", "process", "--overwrite")
    _prefect(env, "--no-prompt", "deploy", "tests/cluster_flow_entry.py:rl_pipeline", "--name", "cluster-stand-in",
             "--pool", pool)
    params = cluster_params(tmp_path, run_key="cancelled")
    run_dir = params.run_dir
    out = _prefect(env, "deployment", "run", "rl-pipeline/cluster-stand-in", "--param",
                   "params=" + params.model_dump_json())
    flow_run_id = re.search(r"UUID:\s*([0-9a-f-]{36})", out).group(1)
    log = open(tmp_path / "worker.log", "w")
    worker = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", pool], cwd=REPO, env=env,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "eval" / "step_000010.json").exists():
            assert time.monotonic() < deadline and worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
            time.sleep(0.2)
        pid = [c for c in read_calls(stand_in) if "submit" in c][0]["pid"]
        assert _alive(pid)
        _prefect(env, "flow-run", "cancel", flow_run_id)
        cancelled_at = time.monotonic()
        while _alive(pid) or not _flow_run(flow_run_id).state.is_final():
            assert time.monotonic() - cancelled_at < 60, ((tmp_path / "worker.log").read_text()[-3000:],
                                                          _flow_run(flow_run_id).state)
            time.sleep(0.2)
        assert _flow_run(flow_run_id).state.is_cancelled()
        stops = [c["stop"] for c in read_calls(stand_in) if "stop" in c]
        assert stops and set(stops) == {f"raysubmit_{pid}"}, read_calls(stand_in)
        assert not any(_alive(c["pid"]) for c in read_calls(stand_in) if "submit" in c)
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(30)
        log.close()
    # A later run of the same run key resumes from the last checkpoint (none yet: the job was cancelled before
    # rollout 19's save, so it starts again at 0 and step 0's evaluation is kept, not redone).
    import flows.rl_pipeline as pipeline

    monkeypatch.setenv("STAND_IN_ROLLOUT_S", "0")
    state = pipeline.rl_pipeline(params, return_state=True)
    assert state.is_completed(), state
    submits = [c for c in read_calls(stand_in) if "submit" in c]
    assert len(submits) == 2 and flag_values(submits[1]["argv"], "--skip-eval-before-train") == []
    assert _steps(run_dir) == list(range(1, 31)) and _evals(run_dir) == [0, 10, 20, 30]
