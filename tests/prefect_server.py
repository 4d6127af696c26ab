"""A real Prefect server for tests: started once per session on 127.0.0.1 with a temporary PREFECT_HOME and
no UI, telemetry off; stopped (by PID) at the end. tests/conftest.py
registers the fixture once for the whole suite (a test names `prefect_server` as an argument).
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
        # 300 s, not 90: under `-n 3` the workers start their servers together, and on a loaded 2-core machine a
        # server's first start (imports, a fresh database's migrations) took over 90 s (#26).
        wait_for(api + "/health", timeout=300, proc=proc)
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


def flow_run_children(flow_run_id, expect: tuple[str, ...] = (), timeout: float = 90.0) -> tuple[list, list]:
    """(task runs, subflow runs) of a flow run, once a task run named `<name>-N` in a final state is on the server
    for each name in `expect`.

    The server records task runs from events in a background service, so right after a flow run ends some of its
    task runs may not be readable yet (seen for whole minutes late in a long CI run); subflow runs are created
    through the API and are there at once. Returns what is there at the timeout, so the caller's assertion names
    what is missing.
    """
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterParentFlowRunId
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all()
    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            settled = {t.name.rsplit("-", 1)[0] for t in tasks if t.state and t.state.is_final()}
            if set(expect) <= settled or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        subflows = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])))
    return tasks, subflows
