"""deployments/deploy.py against the session's Prefect server (issue 40): with the docs' port taken by another Prefect
server, the docs' `prefect server start` exits and the deploy refuses in one line naming both PREFECT_HOMEs and the
fix, instead of deploying into the other server; a re-deploy keeps a paused nightly schedule paused and says so
(plain `prefect deploy` recreates it active from prefect.yaml).

    .venv/bin/python -m pytest tests/test_deploy.py -q
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NIGHTLY = "nightly-validation/nightly"


def _deploy(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "deployments/deploy.py", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=600)


def _deployments() -> dict:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return {d.id: d.updated for d in client.read_deployments()}


def test_the_deploy_refuses_a_server_this_shell_did_not_start(prefect_server, tmp_path):  # noqa: F811
    mine = tmp_path / "prefect-home"
    mine.mkdir()
    env = {**prefect_server["env"], "PREFECT_HOME": str(mine)}
    port = prefect_server["api"].rsplit(":", 1)[1].split("/")[0]
    with open(mine / "server.log", "w") as log:  # the docs' line, on a port another server holds
        started = subprocess.run([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                                  port], env=env, stdout=log, stderr=subprocess.STDOUT, timeout=300)
    assert started.returncode != 0 and "already in use" in (mine / "server.log").read_text()
    before = _deployments()
    out = _deploy(env)
    assert out.returncode == 2 and out.stdout == "", out
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith(f"deploy refused: the Prefect server at {prefect_server['api']} is not this "
                                 f"shell's: it runs with PREFECT_HOME={prefect_server['home']}, this shell has {mine}")
    assert f"Port {port} is already in use" in out.stderr and "export PREFECT_SERVER_API_PORT=4300" in out.stderr
    assert _deployments() == before  # nothing deployed anywhere

    unset = {k: v for k, v in env.items() if k != "PREFECT_API_URL"}
    out = _deploy(unset)
    assert out.returncode == 2 and "deploy refused: PREFECT_API_URL is not set" in out.stderr, out


def test_a_redeploy_keeps_a_paused_schedule_paused(prefect_server):  # noqa: F811
    from prefect import get_client

    env = prefect_server["env"]
    out = _deploy(env, "--name", "nightly")
    assert out.returncode == 0, out
    lines = out.stdout.splitlines()
    assert lines[0] == f"Prefect server {prefect_server['api']}: Prefect 3.9.1, PREFECT_HOME {prefect_server['home']}"
    assert any(line.startswith(f"{NIGHTLY}: schedule '30 2 * * *' UTC is active") for line in lines), out.stdout
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(NIGHTLY)
        (schedule,) = deployment.schedules
        client.update_deployment_schedule(deployment.id, schedule.id, active=False)  # the docs' `schedule pause`

    out = _deploy(env, "--name", "nightly")
    assert out.returncode == 0, out
    assert f"{NIGHTLY}: schedule '30 2 * * *' UTC is kept paused as it was" in out.stdout, out.stdout
    with get_client(sync_client=True) as client:
        assert [s.active for s in client.read_deployment_by_name(NIGHTLY).schedules] == [False]
