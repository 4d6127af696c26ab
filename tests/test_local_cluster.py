"""The cluster-rehearsal's local cluster when its flow process is killed (Prefect's runner SIGKILLs a cancelled flow
30 s after SIGTERM): the flow's on_cancellation hook ends the process groups it recorded
(engines/upstream/rehearsal/cluster_run.py `stop_local_cluster`) and removes its Ray temp dir; a recorded PID now
running something else is left alone. Stand-in processes: what is tested is the record and the kill, not Ray.

    .venv/bin/python -m pytest tests/test_local_cluster.py -q
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _group(*marker: str) -> subprocess.Popen:
    """A process group whose leader's command line holds `marker` (as `ray start` / `serve-rollout` would)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", *marker], start_new_session=True)


def test_the_hook_ends_the_groups_a_killed_flow_left_and_only_those(tmp_path):
    from engines.upstream.rehearsal.cluster_run import STARTED, _record_started, stop_local_cluster

    ray, engine, other = _group("ray", "start"), _group("serve-rollout"), _group("something-else")
    ray_dir = Path(tempfile.mkdtemp(prefix="v4rl-ray-", dir="/tmp"))
    try:
        _record_started(tmp_path, {"ray start": ray.pid, "serve-rollout": engine.pid, "not it": other.pid}, ray_dir)
        stopped = stop_local_cluster(tmp_path)
        assert sorted(stopped) == [f"ray start (process group {ray.pid})", f"serve-rollout (process group {engine.pid})"]
        assert ray.wait(10) == -9 and engine.wait(10) == -9
        time.sleep(0.2)
        assert other.poll() is None  # its command line is not the recorded one: a reused PID is never killed
        assert not ray_dir.exists() and not (tmp_path / STARTED).exists()
        assert stop_local_cluster(tmp_path) == []  # nothing recorded: nothing to do
    finally:
        for proc in (ray, engine, other):
            proc.kill()
            proc.wait(10)
