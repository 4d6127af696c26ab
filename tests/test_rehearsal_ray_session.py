"""The rehearsal's own Ray head (engines/upstream/rehearsal/ray_session.py) takes a driver whatever the machine's ~/.ray holds.

    .venv/bin/python -m pytest tests/test_rehearsal_ray_session.py -q
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from engines.upstream.rehearsal.ray_session import RaySession
from engines.upstream.rehearsal.run import _ray_temp_dir
from engines.train.cluster import LOCAL_RAY_ENV
from tests.prefect_server import free_port


def test_a_driver_connects_though_home_holds_a_ray_auth_token(tmp_path, monkeypatch):
    """Ray 2.60's `ray.init()` writes ~/.ray/auth_token, and a later `ray start` turns token authentication on from
    it: Miles' driver then failed at its first Ray call ("InvalidAuthToken", stage full in the suite after this
    machine's first `ray.init()`). The head and the driver get the same LOCAL_RAY_ENV, so they agree."""
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("f" * 64)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    port = free_port()
    ray_dir = _ray_temp_dir(tmp_path / "work")  # under /tmp when tmp_path is too long for Ray's sockets
    head = RaySession(ray_dir, port=port, num_gpus=2, num_cpus=1, env={}, log=tmp_path / "ray.log")
    try:
        driver = subprocess.run(
            [sys.executable, "-c", f"import ray; ray.init(address='127.0.0.1:{port}'); "
                                   "print(ray.cluster_resources()['GPU'])"],
            env={**os.environ, **LOCAL_RAY_ENV}, capture_output=True, text=True, timeout=120)
    finally:
        head.stop()
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert driver.returncode == 0, driver.stderr[-2000:]
    assert driver.stdout.strip().splitlines()[-1] == "2.0"
