"""Deploy deployments/prefect.yaml into the Prefect server this shell started, keeping paused schedules paused.

    python deployments/deploy.py                   # every deployment (prefect deploy --all)
    python deployments/deploy.py --name tiny-cpu   # only these (repeat --name)
    python deployments/deploy.py --any-server      # into a server with another PREFECT_HOME, on purpose

It runs `prefect --no-prompt deploy --prefect-file deployments/prefect.yaml --all` (PROJECT_ROOT: this repo unless
set) and adds what that command does not do:

- It says which server answers at PREFECT_API_URL (its PREFECT_HOME and version, from the server's own
  /admin/settings) and refuses when that PREFECT_HOME is not this shell's: when port 4200 is taken, the docs'
  `prefect server start` exits ("Port 4200 is already in use") and every later command would talk to the other
  server. Without PREFECT_API_URL, `prefect deploy` would deploy into a temporary server gone a second later.
- Prefect recreates a deployment's schedules from prefect.yaml at every deploy, `active: true` included, so a
  re-deploy turned a paused nightly schedule back on. A schedule paused on the server (same cron and time
  zone) and a paused deployment are deployed paused again, and it says so; the others are as prefect.yaml says.
- It creates the work pools prefect.yaml names when the server lacks them (process pools, as the docs do).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
PREFECT_FILE = REPO / "deployments" / "prefect.yaml"


class Refused(Exception):
    """One line for the user: what is wrong and what to do."""


def check_server(any_server: bool) -> str:
    """The line naming the server PREFECT_API_URL reaches; Refused when it is not this shell's (by PREFECT_HOME)."""
    import httpx
    from prefect import get_client
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    api, home = settings.api.url, Path(settings.home).expanduser().resolve()
    if not api:
        raise Refused("PREFECT_API_URL is not set, so `prefect deploy` would deploy into a temporary server that is "
                      "gone when it ends; export PREFECT_API_URL=http://127.0.0.1:4200/api (docs/deployments.md)")
    try:  # Prefect's client: the same auth and TLS settings as `prefect deploy`
        with get_client(sync_client=True) as client:
            server = client.request("GET", "/admin/settings").json()
            version = client.request("GET", "/admin/version").json()
    except (httpx.HTTPError, ValueError) as exc:
        raise Refused(f"no Prefect server answers at PREFECT_API_URL={api} ({type(exc).__name__}); start it "
                      "(prefect server start --host 127.0.0.1) or fix PREFECT_API_URL") from None
    theirs = Path(server.get("home") or "?").expanduser()
    line = f"Prefect server {api}: Prefect {version}, PREFECT_HOME {theirs}"
    if theirs.resolve() != home and not any_server:
        log = home / "server.log"  # where the docs' `prefect server start` writes
        said = [t.strip() for t in log.read_text(errors="replace").splitlines() if "already in use" in t] \
            if log.is_file() else []
        why = f"{log} says: {said[-1]}" if said else "was its port taken when yours started? see its server.log"
        raise Refused(f"the Prefect server at {api} is not this shell's: it runs with PREFECT_HOME={theirs}, this "
                      f"shell has {home} ({why}); start yours on a free port (export PREFECT_SERVER_API_PORT=4300 "
                      "and PREFECT_API_URL to match), or add --any-server to deploy into that one")
    return line if theirs.resolve() == home else f"{line} (not this shell's {home}: --any-server)"


def _schedule_key(schedule) -> tuple:
    """What makes two schedules the same one: the prefect.yaml entry (a dict) or the server's (a model)."""
    get = schedule.get if isinstance(schedule, dict) else lambda name: getattr(schedule, name, None)
    if get("cron"):
        return ("cron", " ".join(str(get("cron")).split()), get("timezone") or "UTC")
    if get("interval") is not None:
        interval = get("interval")
        return ("interval", float(getattr(interval, "total_seconds", lambda: interval)()))
    return ("rrule", str(get("rrule")))


def _server_deployments(client, spec: dict, names: list[str]) -> list[tuple[dict, object]]:
    """(prefect.yaml entry, the server's deployment of the same name and entrypoint or None) for each one deployed."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    wanted = [d for d in spec.get("deployments") or [] if not names or d["name"] in names]
    found = client.read_deployments(deployment_filter=DeploymentFilter(
        name=DeploymentFilterName(any_=[d["name"] for d in wanted])))
    return [(d, next((f for f in found if f.name == d["name"] and f.entrypoint == d.get("entrypoint")), None))
            for d in wanted]


def keep_paused(spec: dict, names: list[str]) -> set[tuple[str, tuple]]:
    """Marks in `spec` (prefect.yaml, parsed) the deployments and schedules paused on the server now, so the deploy
    keeps them paused; returns the (deployment, schedule) pairs it kept paused."""
    from prefect import get_client

    kept = set()
    with get_client(sync_client=True) as client:
        for deployment, current in _server_deployments(client, spec, names):
            if current is None:
                continue
            if current.paused:
                deployment["paused"] = True
            paused = {_schedule_key(s.schedule) for s in current.schedules if not s.active}
            for schedule in deployment.get("schedules") or []:
                if _schedule_key(schedule) in paused and schedule.get("active", True):
                    schedule["active"] = False
                    kept.add((deployment["name"], _schedule_key(schedule)))
    return kept


def schedule_lines(spec: dict, names: list[str], kept: set[tuple[str, tuple]]) -> list[str]:
    """What the server now has: a line per schedule of the deployed deployments, with the command that flips it."""
    from prefect import get_client

    lines = []
    with get_client(sync_client=True) as client:
        for deployment, current in _server_deployments(client, spec, names):
            if current is None:
                continue
            title = f"{client.read_flow(current.flow_id).name}/{current.name}"
            if current.paused:
                lines.append(f"{title}: the deployment is paused (kept as it was; resume it in the UI)")
            for s in current.schedules:
                what = f"{title}: schedule {_describe(_schedule_key(s.schedule))}"
                if s.active:
                    lines.append(f"{what} is active (`prefect deployment schedule pause '{title}' {s.id}` pauses it)")
                else:
                    why = "kept paused as it was" if (current.name, _schedule_key(s.schedule)) in kept else "paused"
                    lines.append(f"{what} is {why} (`prefect deployment schedule resume '{title}' {s.id}` turns it "
                                 "on)")
    return lines


def _describe(key: tuple) -> str:
    return f"'{key[1]}' {key[2]}" if key[0] == "cron" else f"{key[0]} {key[1]}"


def ensure_work_pools(spec: dict, names: list[str]) -> list[str]:
    """`prefect work-pool create NAME --type process` for each pool the deployments name that the server lacks."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    pools = sorted({(d.get("work_pool") or {}).get("name") for d in spec.get("deployments") or []
                    if not names or d["name"] in names} - {None})
    created = []
    with get_client(sync_client=True) as client:
        for pool in pools:
            try:
                client.read_work_pool(pool)
            except ObjectNotFound:
                subprocess.run([sys.executable, "-m", "prefect", "work-pool", "create", pool, "--type", "process"],
                               check=True, stdout=subprocess.DEVNULL)
                created.append(f"created work pool {pool} (process)")
    return created


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", action="append", default=[], help="deploy only this deployment (repeatable)")
    parser.add_argument("--any-server", action="store_true",
                        help="deploy even when the server's PREFECT_HOME is not this shell's")
    parser.add_argument("--prefect-file", type=Path, default=PREFECT_FILE)
    args = parser.parse_args(argv)
    spec = yaml.safe_load(args.prefect_file.read_text())
    unknown = sorted(set(args.name) - {d["name"] for d in spec.get("deployments") or []})
    try:
        if unknown:
            raise Refused(f"--name {', '.join(unknown)}: not a deployment of {args.prefect_file}; use "
                          f"{', '.join(d['name'] for d in spec['deployments'])}")
        print(check_server(args.any_server), flush=True)
        for line in ensure_work_pools(spec, args.name):
            print(line, flush=True)
        kept = keep_paused(spec, args.name)
    except Refused as exc:
        print(f"deploy refused: {exc}", file=sys.stderr)
        return 2
    env = {**os.environ, "PROJECT_ROOT": os.environ.get("PROJECT_ROOT") or str(REPO)}
    with tempfile.TemporaryDirectory(prefix="v4rl-deploy-") as tmp:
        effective = Path(tmp) / "prefect.yaml"  # prefect.yaml as written, paused schedules marked paused
        effective.write_text(yaml.safe_dump(spec, sort_keys=False))
        selection = [a for n in args.name for a in ("--name", n)] or ["--all"]
        deployed = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--prefect-file",
                                   str(effective), *selection], env=env, cwd=REPO)
    if deployed.returncode == 0:
        for line in schedule_lines(spec, args.name, kept):
            print(line, flush=True)
    return deployed.returncode


if __name__ == "__main__":
    sys.exit(main())
