"""The rehearsal's `ray job submit` path (engines/upstream/rehearsal/submitted.py) on a real local Ray head with its
Jobs API: the cluster path's submitter (ClusterRun.submit: runtime env, streamed log, MilesRecorder, `ray job stop`)
against a real Jobs API, not the file-level stand-in. The driver here is a short script printing Miles' metric lines:
Miles' own train.py through this path is tests/conformance/test_rehearse.py's stage full (minutes), while these
cases (what arrives, a killed driver, a timeout) need seconds. One Ray head serves the module (about 15 s to start).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from engines.upstream.rehearsal.ray_session import RaySession
from engines.upstream.rehearsal.submitted import submit_miles

DRIVER = """
import os, sys, time
print("[t] log_utils.py:1 - eval 0: {'eval/aime': 0.25, 'eval/aime-pass@1': 0.25, 'eval/aime-none_reward_ratio': 0.0}",
      flush=True)
for rollout in range(int(os.environ["ROLLOUTS"])):
    print(f"[t] log_utils.py:1 - rollout {rollout}: {{'rollout/raw_reward': 0.5}}", flush=True)
    print(f"[t] log_utils.py:1 - step {rollout}: {{'train/loss': 0.1, 'train/step': {rollout}}}", flush=True)
    time.sleep(float(os.environ.get("PAUSE", "0")))
print("FROM_RUNTIME_ENV", os.environ.get("FROM_RUNTIME_ENV"), flush=True)
sys.exit(int(os.environ.get("EXIT", "0")))
"""


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    from engines.upstream.rehearsal.run import free_port

    work = tmp_path_factory.mktemp("head")
    ray_dir = Path(tempfile.mkdtemp(prefix="v4rl-rj-", dir="/tmp"))  # short: Ray's socket paths live under it
    ray = RaySession(ray_dir, port=free_port(0, "ray"), num_gpus=1, num_cpus=2, env={}, log=work / "ray.log",
                     jobs_api=True, cwd=work)
    yield ray
    ray.stop()
    shutil.rmtree(ray_dir, ignore_errors=True)


def _miles(tmp_path: Path) -> Path:
    miles = tmp_path / "miles"
    miles.mkdir()
    (miles / "train.py").write_text(DRIVER)
    return miles


def _submit(head, tmp_path, env, **kwargs):
    return submit_miles(_miles(tmp_path), [], env, ray=head, log_path=tmp_path / "miles.log",
                        run_dir=tmp_path / "run", save_dir=tmp_path / "save", **kwargs)


def test_a_submitted_job_gets_its_runtime_env_and_its_metrics_land_in_the_run_directory(head, tmp_path):
    error, killed = _submit(head, tmp_path, {"ROLLOUTS": "2", "FROM_RUNTIME_ENV": "yes"}, timeout=120)
    assert (error, killed) == (None, False)
    log = (tmp_path / "miles.log").read_text()
    assert "submitted successfully" in log and "FROM_RUNTIME_ENV yes" in log
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # v4rl's step = Miles' rollout + 1, each once
    assert (tmp_path / "run" / "eval" / "step_000000.json").is_file()


def test_a_failing_driver_is_one_line_with_its_exit(head, tmp_path):
    error, killed = _submit(head, tmp_path, {"ROLLOUTS": "0", "EXIT": "3"}, timeout=120)
    assert not killed and error.startswith("Miles' Ray job failed") and "\n" not in error, error


def test_the_kill_point_kills_the_driver_and_the_job_ends(head, tmp_path):
    t0 = time.monotonic()
    error, killed = _submit(head, tmp_path, {"ROLLOUTS": "100", "PAUSE": "1"}, timeout=120,
                            kill_when=lambda: "step 2:" in (tmp_path / "miles.log").read_text())
    assert (error, killed) == (None, True)
    assert time.monotonic() - t0 < 60  # ended by the kill, not by the 100 rollouts or the timeout


def test_a_job_past_its_timeout_is_stopped_and_named(head, tmp_path):
    error, killed = _submit(head, tmp_path, {"ROLLOUTS": "100", "PAUSE": "1"}, timeout=8)
    assert not killed and "timeout" in error, error
