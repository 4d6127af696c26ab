"""Submitting a built Miles job to the user's existing Ray cluster.

    ray job submit --address $RAY_ADDRESS --runtime-env-json '{"env_vars": {...}}' -- python3 <miles>/train.py ...

(`ray` and `python3` are the Site's `ray_cli` and `python`.)

`MILES_SCRIPT_EXTERNAL_RAY` semantics are kept by construction: v4rl never runs Miles' launcher, so nothing
ever runs `ray stop`, `ray start` or `pkill` (Miles' `execute_train` does all three without that variable,
and `pkill -9 sglang/miles/redis` even with it: conformance A16). The submitting client follows the job's log
(`ray job submit` without --no-wait), which runner.run_miles streams; stopping the client does not stop the
job, so the runner stops it by id (`ray job stop`).
"""

from __future__ import annotations

import json

from engines.profiles.site import Site
from engines.miles.command import MilesCommand


def runtime_env_json(command: MilesCommand) -> str:
    """The `--runtime-env-json` value: every rank's environment, one JSON object."""
    return json.dumps({"env_vars": command.env}, sort_keys=False)


def submit_argv(command: MilesCommand, site: Site) -> list[str]:
    """The `ray job submit` argv for the command on the site's cluster (SiteError when RAY_ADDRESS is unknown)."""
    address = site.resolved_ray_address
    if not address:
        from engines.profiles.site import SiteError

        raise SiteError("ray_address (RAY_ADDRESS) is unset: the Ray Jobs API of the existing cluster, e.g. "
                        "http://10.0.0.1:8265; set it in the deployment's parameters; nothing was submitted")
    return [site.ray_cli, "job", "submit", "--address", address, "--runtime-env-json", runtime_env_json(command),
            "--", site.python, command.script, *command.argv]


def submit_env(site: Site) -> dict[str, str]:
    """The submitting client's own environment additions (it talks to the Jobs API, not to the ranks)."""
    master = site.resolved_master_addr or "127.0.0.1"
    return {"RAY_ADDRESS": site.resolved_ray_address or "", "MILES_SCRIPT_EXTERNAL_RAY": "1",
            "PYTHONUNBUFFERED": "1", "no_proxy": f"127.0.0.1,{master}"}
