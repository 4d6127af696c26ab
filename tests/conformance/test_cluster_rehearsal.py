"""`prefect deployment run 'rl-pipeline/cluster-rehearsal'`: the cluster path as deployed, every step real, on a Ray
head the flow starts on this host (engines/upstream/rehearsal/cluster_run.py), through a real Prefect server, the
deployments of deployments/prefect.yaml and a process worker; artifacts to the S3-compatible test server.

The default run holds one flow run (it replaced stage full's own run in the default run: the same Miles loop,
kill and resume, here through the cluster path's code): Miles' parse_args on the submitted argv (preflight), the
conversion Miles' model checks and loads, the alignment gate (v4rl's engine generating, Miles' Megatron rescoring
through its train-only job), then ONE `ray job submit` of Miles' train.py whose driver this test SIGKILLs after
rollout 1: the training task's retry resumes at rollout 2, each rollout trained once, each evaluation published
once as a subflow while the job ran, every broadcast equal to what the engine holds, the run uploaded. About 4 min
on the idle 2 cores; also in the default run, a Megatron-LM that does not fit the Miles (one line, nothing started).
Slow: the cancel and its resume, generation 2 with both --dsv4-impl values, a Miles whose broadcast zeroes the
hash-routing table (the run fails at its first broadcast, naming the tensor), and the nightly validation of it.

    .venv/bin/python -m pytest tests/conformance/test_cluster_rehearsal.py -q
    .venv/bin/python -m pytest tests/conformance/test_cluster_rehearsal.py -m slow -q
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.prefect_server import flow_run_children
from tests.s3_server import TEST_CREDENTIALS

REPO = Path(__file__).resolve().parents[2]
DEPLOYMENT = "rl-pipeline/cluster-rehearsal"


def _prefect(env: dict, *args: str, timeout: float = 600) -> str:
    proc = subprocess.run([sys.executable, "-m", "prefect", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"prefect {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture
def deployed(prefect_server, s3_bucket, tmp_path):
    """The deployments of deployments/prefect.yaml on the session's server; (worker env, S3 bucket)."""
    env = {**prefect_server["env"], **TEST_CREDENTIALS, "PROJECT_ROOT": str(REPO),
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    _prefect(env, "work-pool", "create", "v4rl-process", "--type", "process", "--overwrite")
    _prefect(env, "--no-prompt", "deploy", "--prefect-file", "deployments/prefect.yaml", "--name", "cluster-rehearsal")
    return env, s3_bucket


def _start(env: dict, params: dict) -> tuple[str, subprocess.Popen]:
    """`prefect deployment run` and one worker pass (running until the flow run ends); (flow run id, worker). The
    worker's output (the flow run's, Miles' log included) goes to a file: a pipe nobody reads would fill and stall
    the run."""
    out = _prefect(env, "deployment", "run", DEPLOYMENT, "--param", "params=" + json.dumps(params))
    flow_run_id = re.search(r"UUID:\s*([0-9a-f-]{36})", out).group(1)
    log_path = Path(params["runs_root"]) / f"worker-{flow_run_id}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        worker = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", "v4rl-process",
                                   "--run-once"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    worker.log_path = log_path
    return flow_run_id, worker


def _finish(worker: subprocess.Popen, timeout: float = 1500) -> str:
    """The worker's output once its one flow run ended; a worker still running at the timeout is killed."""
    try:
        worker.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        worker.kill()
        raise
    return worker.log_path.read_text(errors="replace")


def _flow_run(flow_run_id: str):
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id)


def _params(tmp_path: Path, bucket, run_key: str, **more) -> dict:
    return {"preset": "cluster-rehearsal", "run_key": run_key, "runs_root": str(tmp_path / "runs"),
            "store_url": bucket.store_url("v4rl"), "s3_endpoint_url": bucket.endpoint_url, **more}


def _training_job(run_dir: Path) -> list:
    """The processes of the run's Miles training job: its driver (train.py with the run's --save) and the job's
    Ray actor workers with their children, found by the job's runtime env (the run's broadcast folder)."""
    import psutil

    save, folder = str(run_dir / "miles-checkpoints"), str(run_dir / "local-cluster" / "broadcasts")
    driver, actors = None, []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        try:
            if any(part.endswith("train.py") for part in cmd) and save in cmd and "--debug-train-only" not in cmd:
                driver = proc
            elif cmd and cmd[0].startswith("ray::") and not cmd[0].startswith(("ray::JobSupervisor", "ray::IDLE")) \
                    and proc.environ().get("V4RL_REHEARSAL_BROADCASTS") == folder:
                actors += [proc, *proc.children(recursive=True)]
        except psutil.Error:
            continue
    return [driver, *actors] if driver else []


def _kill_after_rollout_1(run_dir: Path, stop: threading.Event, killed: list) -> None:
    """Once rollout 1 is saved and the broadcast after it recorded, SIGKILL the whole training job, its driver and
    its actors (a crash of the machine they run on: nothing of the job writes again; a driver killed alone leaves
    its actors running for seconds, which the runner waits out before a retry: engines/miles/runner.py
    wait_job_actors)."""
    import psutil

    tracker = run_dir / "miles-checkpoints" / "latest_checkpointed_iteration.txt"
    broadcast = run_dir / "local-cluster" / "broadcasts" / "broadcast-v3.json"
    while not stop.wait(0.2):
        saved = tracker.read_text().strip() if tracker.is_file() else ""
        if saved.isdigit() and int(saved) >= 1 and broadcast.is_file() and (job := _training_job(run_dir)):
            names = []
            for proc in job:
                try:
                    names.append(" ".join(proc.cmdline())[:60])
                    proc.kill()
                except psutil.Error:  # gone already
                    pass
            killed.append((time.time(), names))
            return


def _leftovers(run_dir: Path) -> list[str]:
    """Processes still running that belong to the run: its Miles job, Ray head or engine."""
    import psutil

    mine = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if str(run_dir) in cmd and proc.pid != os.getpid():
            mine.append(cmd[:160])
    return mine


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _evals(run_dir: Path) -> list[int]:
    return sorted(int(p.stem.split("_")[1]) for p in (run_dir / "eval").glob("step_*.json"))


def test_the_deployment_runs_miles_job_for_real_and_a_killed_job_resumes(deployed, miles_tree, sglang_paths,
                                                                          tmp_path):
    from engines.upstream.rehearsal.weight_check import check_broadcasts

    env, bucket = deployed
    run_dir = tmp_path / "runs" / "rehearsed"
    t0 = time.monotonic()
    flow_run_id, worker = _start(env, _params(tmp_path, bucket, "rehearsed", miles_check_dir=str(miles_tree)))
    stop, killed = threading.Event(), []
    killer = threading.Thread(target=_kill_after_rollout_1, args=(run_dir, stop, killed), daemon=True)
    killer.start()
    try:
        output = _finish(worker)
    finally:
        stop.set()
    print(f"flow run {time.monotonic() - t0:.0f} s")
    run = _flow_run(flow_run_id)
    assert run.state.is_completed(), f"{run.state}\n{output[-4000:]}"
    assert killed, "the training job was never killed"

    names = ("preflight", "convert", "verify", "align", "train", "report", "upload-artifacts")
    tasks, subflows = flow_run_children(flow_run_id, expect=names)
    assert set(names) <= {t.name.rsplit("-", 1)[0] for t in tasks}, [t.name for t in tasks]
    (train,) = [t for t in tasks if t.name.rsplit("-", 1)[0] == "train"]
    assert train.run_count == 2, train  # the killed job, then the retry that resumed it
    evaluations = sorted((f.parameters["step"], f.start_time.timestamp()) for f in subflows
                         if f.parameters.get("step") is not None)
    assert [step for step, _ in evaluations] == [0, 1, 2, 3], evaluations  # each published once
    assert sum(start < train.end_time.timestamp() for _, start in evaluations) >= 2, (evaluations, train.end_time)

    assert _steps(run_dir) == [1, 2, 3] and _evals(run_dir) == [0, 1, 2, 3]  # each rollout trained once
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["action"] for e in events] == ["retry"], events
    log = (run_dir / "rehearsed.log").read_text()
    assert log.count("submitted successfully") == 3  # the gate's train-only job, the killed job, its retry
    assert (run_dir / "miles-checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    alignment = json.loads((run_dir / "align.json").read_text())
    assert alignment["passed"] and alignment["token_abs_diff"]["mean"] < 0.02, alignment["token_abs_diff"]
    assert alignment["config"]["temperature"] == 0.8  # the job's --rollout-temperature, as Miles' trainer scores
    checks = check_broadcasts(run_dir / "local-cluster" / "broadcasts", run_dir / "local-cluster" / "hf-fp8-experts")
    assert len(checks) >= 3 and all(c["ok"] and c["tensors_sent"] > 0 for c in checks), checks
    uploaded = set(bucket.keys("v4rl/runs/rehearsed/"))
    for rel in ("metrics.jsonl", "align.json", "report.md", "eval/step_000003.json", "manifest.json"):
        assert f"v4rl/runs/rehearsed/{rel}" in uploaded, rel
    assert not _leftovers(run_dir)


def _ray_dirs() -> set[str]:
    return {str(p) for p in Path("/tmp").glob("v4rl-ray-*")}


@pytest.mark.slow
def test_cancel_stops_the_job_and_everything_the_flow_started_and_a_later_run_resumes(deployed, miles_tree,
                                                                                      sglang_paths, tmp_path):
    env, bucket = deployed
    run_dir, before = tmp_path / "runs" / "cancelled", _ray_dirs()
    params = _params(tmp_path, bucket, "cancelled", miles_check_dir=str(miles_tree))
    flow_run_id, worker = _start(env, params)
    deadline = time.monotonic() + 900
    while not ((run_dir / "miles-job.json").is_file() and (run_dir / "metrics.jsonl").is_file()):
        assert worker.poll() is None and time.monotonic() < deadline, _finish(worker, 60)[-3000:]
        time.sleep(0.5)  # the Miles job runs and has trained rollout 0
    _prefect(env, "flow-run", "cancel", flow_run_id)
    output = _finish(worker, 300)
    run = _flow_run(flow_run_id)
    assert run.state.is_cancelled(), f"{run.state}\n{output[-3000:]}"
    assert not (run_dir / "miles-job.json").exists()  # the Ray job was stopped, its record removed
    assert not _leftovers(run_dir) and _ray_dirs() <= before, (_leftovers(run_dir), _ray_dirs() - before)

    again, worker = _start(env, params)  # the same run key: resumes from the last checkpoint
    output = _finish(worker)
    assert _flow_run(again).state.is_completed(), output[-4000:]
    assert _steps(run_dir) == [1, 2, 3] and _evals(run_dir) == [0, 1, 2, 3]
    assert not _leftovers(run_dir) and _ray_dirs() <= before


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["miles", "megatron"])
def test_generation_2_runs_the_deployment_with_each_dsv4_impl(deployed, miles_gen2_tree, megatron_gen2_tree,
                                                             sglang_paths, impl, tmp_path):
    from engines.upstream.rehearsal.weight_check import check_broadcasts

    env, bucket = deployed
    run_dir = tmp_path / "runs" / f"gen2-{impl}"
    t0 = time.monotonic()
    flow_run_id, worker = _start(env, _params(tmp_path, bucket, f"gen2-{impl}", miles_check_dir=str(miles_gen2_tree),
                                              megatron_check_dir=str(megatron_gen2_tree), dsv4_impl=impl))
    output = _finish(worker)
    print(f"generation 2, --dsv4-impl {impl}: {time.monotonic() - t0:.0f} s")
    assert _flow_run(flow_run_id).state.is_completed(), output[-4000:]
    assert _steps(run_dir) == [1, 2, 3] and _evals(run_dir) == [0, 1, 2, 3]
    log = (run_dir / f"gen2-{impl}.log").read_text()
    assert f"--dsv4-impl {impl}" in log  # the submitted argv
    alignment = json.loads((run_dir / "align.json").read_text())
    assert alignment["passed"] and alignment["token_abs_diff"]["mean"] < 0.02, alignment["token_abs_diff"]
    checks = check_broadcasts(run_dir / "local-cluster" / "broadcasts", run_dir / "local-cluster" / "hf-fp8-experts")
    assert len(checks) == 4 and all(c["ok"] for c in checks), checks
    assert not _leftovers(run_dir)


@pytest.mark.slow
def test_a_miles_that_zeroes_the_hash_routing_table_fails_the_run_at_its_first_broadcast(
        deployed, miles_gen2_tree, megatron_gen2_tree, sglang_paths, tmp_path):
    from tests.conformance.test_rehearse import _miles_sending_zero_tid2eid

    env, bucket = deployed
    run_dir = tmp_path / "runs" / "planted"
    miles = _miles_sending_zero_tid2eid(miles_gen2_tree, tmp_path)
    flow_run_id, worker = _start(env, _params(tmp_path, bucket, "planted", miles_check_dir=str(miles),
                                              megatron_check_dir=str(megatron_gen2_tree), dsv4_impl="megatron"))
    output = _finish(worker)
    run = _flow_run(flow_run_id)
    assert run.state.is_failed(), f"{run.state}\n{output[-3000:]}"
    assert "model.layers.0.mlp.topk.tid2eid" in (run.state.message or ""), run.state.message
    tasks, _ = flow_run_children(flow_run_id, expect=("train",))
    (train,) = [t for t in tasks if t.name.rsplit("-", 1)[0] == "train"]
    assert train.run_count == 1 and train.state.is_failed()  # a refused weight is not retried
    assert not (run_dir / "report.md").exists() and not _leftovers(run_dir)


def test_a_megatron_that_does_not_fit_the_miles_is_one_line_before_anything_starts(prefect_server, miles_tree,
                                                                                   megatron_gen2_tree, tmp_path):
    """Bad input of the local cluster (a Megatron-LM of the other generation; the others: Miles missing or not
    Miles, too little memory, in tests/conformance/test_rehearse.py and the parameters' own validation) fails the
    flow run in one line naming the fix, before preflight, with nothing started."""
    from flows.params import PipelineParams
    from flows.rl_pipeline import rl_pipeline

    run_dir, before = tmp_path / "runs" / "misfit", _ray_dirs()
    params = PipelineParams.preset_defaults("cluster-rehearsal", runs_root=str(tmp_path / "runs"), run_key="misfit",
                                            miles_check_dir=str(miles_tree), megatron_check_dir=str(megatron_gen2_tree))
    state = rl_pipeline(params, return_state=True)
    assert state.is_failed(), state
    message = str(state.result(raise_on_failure=False))
    assert "the Megatron-LM does not fit this Miles (generation 1)" in message and "\n" not in message, message
    assert not (run_dir / "local-cluster").exists() and not _leftovers(run_dir) and _ray_dirs() <= before


@pytest.mark.slow
def test_the_nightly_validates_the_cluster_rehearsal_run(deployed, miles_tree, sglang_paths, tmp_path):
    """`nightly-validation/cluster-rehearsal`: the run with the preset's own numbers, its verdict recorded in the
    store and judged as tiny-cpu's nights are (no earlier nights: pass@1 needs history; alignment and
    train-vs-rollout |Δlogprob| are judged at once)."""
    env, bucket = deployed
    _prefect(env, "--no-prompt", "deploy", "--prefect-file", "deployments/prefect.yaml", "--name", "cluster-rehearsal")
    out = _prefect(env, "deployment", "run", "nightly-validation/cluster-rehearsal", "--param", "params=" + json.dumps(
        {"preset": "cluster-rehearsal", "runs_root": str(tmp_path / "runs"), "store_url": bucket.store_url("v4rl"),
         "s3_endpoint_url": bucket.endpoint_url}))
    flow_run_id = re.search(r"UUID:\s*([0-9a-f-]{36})", out).group(1)
    output = _prefect(env, "worker", "start", "--pool", "v4rl-process", "--run-once", timeout=1500)
    assert _flow_run(flow_run_id).state.is_completed(), output[-4000:]
    (key,) = [k for k in bucket.keys("v4rl/runs/") if k.endswith("/nightly.json")]
    record = json.loads(bucket.client.get_object(Bucket=bucket.name, Key=key)["Body"].read())
    assert record["preset"] == "cluster-rehearsal" and record["diff_steps"] == [1, 2, 3], record
    assert record["verdict"]["checks"]["pass@1"]["status"] == "insufficient_history", record["verdict"]
    assert record["align_mean"] < 0.02 and record["verdict"]["passed"], record
