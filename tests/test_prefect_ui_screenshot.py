"""tests/prefect_ui_screenshot.py against real Prefect servers with their UI, rendered by headless Chromium:
a page of the server the script starts on `--port P` is shot (its UI calls port P), and a server whose UI calls
another port (what `prefect server start --port P` does without PREFECT_SERVER_API_PORT) fails the script
before anything is written, with one line naming the wrong API URL; Chromium's rendering of that server's page
is the "Can't connect to Server API" error page, and the page check rejects it.

Skips with what to install where Chromium is absent (Debian: apt-get install -y chromium). About 40 s alone.

    .venv/bin/python -m pytest tests/test_prefect_ui_screenshot.py -q
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests import prefect_ui_screenshot as shot
from tests.prefect_server import QUIET_ENV, free_port, stop_process, wait_for

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "prefect_ui_screenshot.py"
EMPTY_RUNS = "Run a task or flow to get started"
CHROMIUM = shot.chromium_binary()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH: the Prefect UI screenshot tests "
                                                         "need it (apt-get update && apt-get install -y chromium)")


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def misdirected_server(tmp_path_factory):
    """A server with its UI on 127.0.0.1:port whose /ui-settings names a port where nothing listens: the same
    fault as the default 4200, without depending on whether this machine runs something on 4200."""
    home = tmp_path_factory.mktemp("ui_home")
    port, dead_port = free_port(), free_port()
    env = {**os.environ, **QUIET_ENV, "PREFECT_HOME": str(home), "PREFECT_SERVER_API_PORT": str(dead_port)}
    for name in ("PREFECT_API_URL", "PREFECT_UI_API_URL", "PREFECT_SERVER_UI_API_URL"):
        env.pop(name, None)
    with open(home / "server.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                 "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(f"http://127.0.0.1:{port}/api/health", timeout=300, proc=proc)
        yield {"base": f"http://127.0.0.1:{port}", "dead_api": f"http://127.0.0.1:{dead_port}/api"}
    finally:
        stop_process(proc)


def _script(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **QUIET_ENV}
    env.pop("PREFECT_API_URL", None)
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)


def test_the_script_shoots_a_page_of_the_server_it_starts_on_a_given_port(tmp_path):
    out = tmp_path / "runs.png"
    # An empty server's Runs page says this only when its API answered (a UI that cannot reach it lists filters)
    proc = _script("--port", str(free_port()), "--page", "/runs", "--expect", EMPTY_RUNS, "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"wrote {out}" in proc.stdout
    assert _png_size(out) == (1400, 1000)
    assert out.stat().st_size > 20_000, "a rendered Runs page is tens of KB; a blank page is a few"


def test_a_server_whose_ui_calls_another_port_fails_the_script(misdirected_server, tmp_path):
    out = tmp_path / "runs.png"
    proc = _script("--server", misdirected_server["base"], "--page", "/runs", "--out", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"tells the UI to call {misdirected_server['dead_api']}" in proc.stderr
    assert "PREFECT_SERVER_API_PORT" in proc.stderr  # the fix is named
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not out.exists()


def test_the_page_check_rejects_the_cant_connect_page(misdirected_server, tmp_path):
    url = misdirected_server["base"] + "/runs"
    text = shot.page_text(CHROMIUM, url, tmp_path / "chromium", "1400,1000")
    assert f"Can't connect to Server API at {misdirected_server['dead_api']}" in text  # Chromium rendered the UI
    with pytest.raises(shot.PageError, match=r"shows an error page \(.Can't connect to Server API.\)"):
        shot.check_page(url, text, [EMPTY_RUNS])
