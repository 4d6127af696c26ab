"""A real Prefect server for tests: started once per session on 127.0.0.1 with a temporary PREFECT_HOME and
no UI, telemetry off; stopped (by PID) at the end. Import the fixture into a test module:

    from tests.prefect_server import prefect_server  # noqa: F401
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

QUIET_ENV = {
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_WORKER_WEBSERVER_HOST": "127.0.0.1",
    "PREFECT_WORKER_QUERY_SECONDS": "1",
    "PREFECT_RUNNER_POLL_FREQUENCY": "1",
    "PREFECT_SERVER_REGISTER_BLOCKS_ON_START": "false",
    "PREFECT_SERVER_EPHEMERAL_ENABLED": "false",
    "PREFECT_LOGGING_LEVEL": "WARNING",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, timeout: float = 90.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer within {timeout}s")


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """Yields {"api": url, "home": path, "env": environment for CLI/worker subprocesses}."""
    home = tmp_path_factory.mktemp("prefect_home")
    port = free_port()
    env = {**os.environ, **QUIET_ENV, "PREFECT_HOME": str(home)}
    env.pop("PREFECT_API_URL", None)
    log = open(home / "server.log", "w")  # noqa: SIM115 - closed in teardown
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                             "--port", str(port), "--no-ui"], env=env, stdout=log, stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{port}/api"
    saved = {k: os.environ.get(k) for k in [*QUIET_ENV, "PREFECT_API_URL", "PREFECT_HOME"]}
    try:
        wait_for(api + "/health", proc=proc)
        os.environ.update({**QUIET_ENV, "PREFECT_API_URL": api, "PREFECT_HOME": str(home)})
        from prefect.settings import PREFECT_API_URL, temporary_settings

        # Prefect may have read its settings when a test module imported it: point this process at the server too.
        with temporary_settings(updates={PREFECT_API_URL: api}):
            yield {"api": api, "home": Path(home), "env": {**env, "PREFECT_API_URL": api}}
        # Flush Prefect's background log/event workers while the server is still here; otherwise they flush at
        # interpreter exit, find no API URL, and start a temporary server just to deliver them.
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=10)
        EventsWorker.drain_all()
    finally:
        stop_process(proc)
        log.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 30 s: a server the tests started is always gone afterwards."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
