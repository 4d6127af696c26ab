"""The "Prefect deployments, step by step" block of docs/deployments.md, run as a new user pastes it.

The slow test extracts the bash block that follows the `tests/test_readme_deploy.py runs the next bash block`
marker in docs/deployments.md and runs exactly those lines in a fresh bash with job control (as in a terminal): no
profile, a PATH without the venv (so the block's own `source .venv/bin/activate` must provide `prefect`), a
temporary PREFECT_HOME and a free port (through the block's own `${PREFECT_HOME:-...}` and
`${PREFECT_SERVER_API_PORT:-...}` defaults). After each line the test records its exit status. It passes when
every line exits 0, the flow run ends Completed, and no process the block started is left (found by the
temporary PREFECT_HOME in its environment, killed by PID if it is). The run writes `runs/<run_key>/` and
`runs/store/runs/<run_key>/` in the repo, as a user's run does: the test skips when they exist already and
removes them (and the empty folders it made) afterwards.

The fast tests check what the block relies on: the tiny-cpu deployment's parameters equal the flow's
defaults (so a partial `params` object changes only the fields it names) and Prefect 3.9's CLI has no nested
parameter form.

    .venv/bin/python -m pytest tests/test_readme_deploy.py -q               # the fast checks
    .venv/bin/python -m pytest tests/test_readme_deploy.py -q -m slow       # the block itself (minutes)
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.prefect_server import free_port

REPO = Path(__file__).resolve().parent.parent
MARKER = "<!-- tests/test_readme_deploy.py runs the next bash block as written -->"


def readme_deploy_lines() -> list[str]:
    """The lines of the bash block after MARKER in docs/deployments.md."""
    text = (REPO / "docs" / "deployments.md").read_text()
    assert text.count(MARKER) == 1, f"docs/deployments.md must hold the marker {MARKER!r} once"
    match = re.search(re.escape(MARKER) + r"\s*```bash\n(.*?)\n```", text, flags=re.S)
    assert match, f"no ```bash block right after {MARKER!r} in docs/deployments.md"
    return match.group(1).splitlines()


def test_the_block_runs_a_server_on_loopback_with_the_api_url_set_before_any_prefect_command():
    lines = readme_deploy_lines()
    first_prefect = next(i for i, line in enumerate(lines) if line.startswith(("prefect ", "PROJECT_ROOT=")))
    before = "\n".join(lines[:first_prefect])
    assert "source .venv/bin/activate" in before
    assert "PREFECT_API_URL=http://127.0.0.1:" in before
    assert "DO_NOT_TRACK=1" in before and "PREFECT_SERVER_ANALYTICS_ENABLED=false" in before
    assert "PREFECT_WORKER_WEBSERVER_HOST=127.0.0.1" in before
    assert lines[first_prefect].startswith("prefect server start --host 127.0.0.1 ")
    assert any(line.startswith("prefect deployment run 'rl-pipeline/tiny-cpu' -p params=") for line in lines)


def test_the_tiny_cpu_deployment_parameters_are_the_flow_defaults():
    """What the README's "one field" advice rests on: Prefect replaces the deployment's whole `params` with the
    run's, so every field the run leaves out takes PipelineParams' default; for tiny-cpu that must equal the
    deployment's own value."""
    from flows.params import PipelineParams

    spec = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    tiny = next(d for d in spec["deployments"] if d["name"] == "tiny-cpu")
    defaults = PipelineParams().model_dump()
    differ = {k: (v, defaults.get(k)) for k, v in tiny["parameters"]["params"].items() if defaults.get(k) != v}
    assert not differ, f"tiny-cpu deployment values differ from PipelineParams' defaults (README, one field): {differ}"


def test_prefect_has_no_nested_parameter_form():
    """`prefect deployment run -p params.steps=2` names a top-level parameter `params.steps` in Prefect 3.9 (the
    CLI then rejects it as not on the deployment: prefect/cli/deployment.py `run`), so a run's `params` is
    always one whole object."""
    from prefect.cli._utilities import load_json_key_values

    assert load_json_key_values(["params.steps=2"], "parameter") == {"params.steps": 2}
    assert load_json_key_values(['params={"steps": 2}'], "parameter") == {"params": {"steps": 2}}


def _processes_with_home(home: Path) -> list[int]:
    """PIDs of processes whose environment holds PREFECT_HOME=home: everything the block started."""
    needle = f"PREFECT_HOME={home}".encode() + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes() + b"\0":
                    found.append(int(entry.name))
            except OSError:
                continue  # gone, or not ours
    return found


def _stop_leftovers(home: Path, grace: float = 60.0) -> list[int]:
    """Waits up to `grace` seconds for the block's processes to exit; kills (by PID) and returns the rest."""
    deadline = time.monotonic() + grace
    while (left := _processes_with_home(home)) and time.monotonic() < deadline:
        time.sleep(1)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


@pytest.mark.slow
def test_the_readme_deploy_steps_run_as_written(tmp_path):
    lines = readme_deploy_lines()
    run_key = re.search(r'"run_key": "([^"]+)"', "\n".join(lines)).group(1)
    written = [REPO / "runs" / run_key, REPO / "runs" / "store" / "runs" / run_key]
    if any(p.exists() for p in written):
        pytest.skip(f"{[str(p) for p in written if p.exists()]} exist (an earlier README run?): remove them to run "
                    "this test, which writes and then removes them")
    parents = [REPO / "runs" / "store" / "runs", REPO / "runs" / "store", REPO / "runs"]
    new_parents = [p for p in parents if not p.exists()]  # removed again when empty
    home = tmp_path / "prefect-home"
    venv_bin = str(REPO / ".venv" / "bin")
    path = os.pathsep.join(p for p in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep) if p != venv_bin)
    env = {"PATH": path, "HOME": os.environ.get("HOME", str(tmp_path)), "LANG": "C.UTF-8",
           "PREFECT_HOME": str(home), "PREFECT_SERVER_API_PORT": str(free_port())}
    # set -m: job control, as in the terminal a user pastes into. Without it bash starts background jobs with SIGINT
    # ignored, and the worker's SIGTERM handler (which turns SIGTERM into SIGINT) then never stops it.
    script = ["set -m", f"cd {REPO}"]
    for i, line in enumerate(lines, 1):  # each line as written, then its exit status for the assertion below
        script += [line, f'echo "README-LINE {i} EXIT $?" >&2']
    (tmp_path / "steps.sh").write_text("\n".join(script) + "\n")
    started = time.monotonic()
    try:
        proc = subprocess.run(["bash", "--noprofile", "--norc", str(tmp_path / "steps.sh")], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=3600)
        left = _stop_leftovers(home)
        output = proc.stdout[-6000:] + proc.stderr[-6000:]
        statuses = dict(re.findall(r"README-LINE (\d+) EXIT (\d+)", proc.stderr))
        assert len(statuses) == len(lines), f"the block stopped early:\n{output}"
        failed = {lines[int(i) - 1]: rc for i, rc in statuses.items() if rc != "0"}
        assert not failed, f"README lines failed: {failed}\n{output}"
        assert "Flow run finished successfully in 'Completed'" in proc.stdout, output
        assert (REPO / "runs" / run_key / "report.md").is_file()
        assert not left, f"processes left running after the block's last line (killed now): {left}"
        print(f"README deploy block: {time.monotonic() - started:.0f} s")
    finally:
        _stop_leftovers(home, grace=0)
        for p in written:
            shutil.rmtree(p, ignore_errors=True)
        for p in new_parents:
            if p.is_dir() and not any(p.iterdir()):
                p.rmdir()


def test_the_deploy_step_says_it_turns_the_nightly_schedule_on():
    """Deploying all makes the nightly schedule live (Prefect runs a prefect.yaml schedule once deployed): the
    deploy line of the block says so, and the page says how to pause it, with the schedule's real values."""
    spec = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    nightly = next(d for d in spec["deployments"] if d["name"] == "nightly")
    (schedule,) = nightly["schedules"]
    assert (schedule["cron"], schedule["timezone"], schedule["active"]) == ("30 2 * * *", "UTC", True)
    deploy = next(line for line in readme_deploy_lines() if "deployments/deploy.py" in line)
    assert "deploys them all" in deploy and "nightly schedule (02:30 UTC" in deploy, deploy
    page = " ".join((REPO / "docs" / "deployments.md").read_text().split())
    assert f'`cron: "{schedule["cron"]}"`, UTC, `active: true`' in page
    assert "prefect deployment schedule pause 'nightly-validation/nightly' ID" in page
    assert "runs at 02:30 utc once deployed" in nightly["description"].lower()
    # the cluster-rehearsal nightly (minutes of Miles on the worker's host) is deployed paused, and said so
    rehearsal = next(d for d in spec["deployments"] if d["name"] == "cluster-rehearsal"
                     and d["entrypoint"].startswith("flows/nightly.py"))
    assert [s["active"] for s in rehearsal["schedules"]] == [False] and "paused" in rehearsal["description"]
    assert "`nightly-validation/cluster-rehearsal` runs it every night at 03:30 UTC once you resume" in page
