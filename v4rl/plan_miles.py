"""The Miles half of `v4rl plan`: the job as JSON, Miles' own parse_args on it, the launcher comparison.

Thin glue between v4rl/cmd_plan.py and engines/miles (build_command, preflight, launcher_compare); every
import of an engine check happens inside the function that runs it, so plain `v4rl plan` stays fast.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from typing import Any

import typer

from engines.miles.launch import launch_plan, resolve
from engines.profiles import get_profile
from engines.profiles.site import Site
from engines import miles


def site_and_job(preset: str, overrides: Mapping[str, Any], paths: Mapping[str, str | None], *, head_ip, worker_ip,
                 ifname, ib_hca, ray_address, master_addr) -> tuple[Site, miles.MilesJob]:
    """The CLI's site and job: given values, ${VAR} placeholders for the rest."""
    eff, _ = resolve(preset, overrides)
    job = miles.with_paths(miles.MilesJob.placeholder(eff, get_profile(eff.profile)), **paths)
    site = Site(head_ip=head_ip, worker_ips=tuple(worker_ip), socket_ifname=ifname, ib_hca=ib_hca,
                ray_address=ray_address, master_addr=master_addr)
    return site, job


def launch(preset: str, overrides: Mapping[str, Any], site: Site, job: miles.MilesJob) -> dict[str, Any]:
    return launch_plan(preset, overrides, site=site, job=job)


def job_json(preset: str, overrides: Mapping[str, Any], site: Site, job: miles.MilesJob) -> dict[str, Any]:
    """{"entrypoint": "train.py", "argv": [...], "env": {...}, "pin": ..., "submit": [...], "seed_command": ...}."""
    eff, inp = resolve(preset, overrides)
    profile = get_profile(eff.profile)
    command = miles.build_command(eff, job, site=site, cluster=inp.cluster, profile=profile)
    submit_site = site if site.resolved_ray_address else Site(ray_address="${RAY_ADDRESS}")
    return {**command.to_json(), "submit": miles.submit_argv(command, submit_site),
            "seed_command": {"miles": miles.PR_HEAD, "argv": miles.launcher_argv(eff, profile, job)}}


def pin_line(generation: int = 1) -> str:
    from engines.miles.command import MILES_PINS

    pin = MILES_PINS[generation]
    return (f"Miles job: {miles.ENTRYPOINT} for Miles {pin['miles']} with Megatron-LM {pin['megatron_lm_branch']} "
            f"{pin['megatron_lm']} (DeepSeek-V4 generation {generation}; --json shows its argv and env; --miles-dir "
            "DIR checks a checkout)")


def generation_overrides(miles_dir: str | None, generation: int | None, dsv4_impl: str | None) -> dict[str, Any]:
    """Preset overrides for the Miles DeepSeek-V4 generation: given, else read from the checkout's code
    (--miles-dir, else $V4RL_MILES_DIR), else none (the preset's generation 1)."""
    import os

    out: dict[str, Any] = {}
    local = miles_dir or os.environ.get("V4RL_MILES_DIR")
    if generation is None and local:
        from engines.miles.generation import detect_generation

        generation = detect_generation(local).generation
    if generation is not None:
        out["miles_generation"] = generation
    if dsv4_impl is not None:
        out["dsv4_impl"] = dsv4_impl
    return out


def seed_command_text(obj: Mapping[str, Any]) -> str:
    seed = obj["seed_command"]
    return (f"# the seed's launcher command; only Miles {seed['miles']} (PR #1300 head) parses it:\n"
            + shlex.join(seed["argv"]))


def check(preset: str, overrides: Mapping[str, Any], site: Site, job: miles.MilesJob, *, miles_dir: str | None,
          megatron_dir: str | None, check_data: bool):
    """Miles' own parse_args on the job (engines/upstream/miles_preflight.py)."""
    from engines.upstream.miles_preflight import check_job

    eff, inp = resolve(preset, overrides)
    return check_job(eff, job, site=site, cluster=inp.cluster, miles_dir=miles_dir, megatron_dir=megatron_dir,
                     check_data=check_data)


def compare(preset: str, overrides: Mapping[str, Any], site: Site | None, miles_dir: str | None):
    """Miles' own launcher recorded for the preset's layout, against v4rl's job."""
    from engines.upstream.miles_launcher_compare import compare_with_launcher

    eff, _ = resolve(preset, overrides)
    given = site if site is not None and site.resolved_ray_address and site.socket_ifname else None
    return compare_with_launcher(eff, miles_dir=miles_dir, site=given)


def print_check(result) -> None:
    color = typer.colors.GREEN if result.ok else typer.colors.RED
    typer.secho(result.summary(), fg=color)


def print_comparison(comparison) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    con = Console(width=max(Console().width, 160))
    con.print(escape(f"Miles' launcher {' '.join(comparison.launcher_argv)}"))
    if comparison.launcher_error:
        con.print(f"[red]the launcher refuses this layout[/]: {escape(comparison.launcher_error)}")
        return
    table = Table(title=f"{comparison.preset}: v4rl's job vs Miles' launcher")
    for col in ("kind", "key", "launcher", "v4rl", "status", "why"):
        table.add_column(col, overflow="fold")
    for r in comparison.rows:
        style = {"same": "", "allowed": "yellow", "DIFF": "bold red"}[r.status]
        table.add_row(r.kind, escape(r.key), escape(_short(r.launcher)), escape(_short(r.v4rl)), r.status,
                      escape(r.reason), style=style)
    con.print(table)
    for command in comparison.launcher_commands:
        con.print(escape(f"the launcher also runs (v4rl never does): {command.strip()}"))
    counts = {s: sum(r.status == s for r in comparison.rows) for s in ("same", "allowed", "DIFF")}
    con.print(f"{counts['same']} same, {counts['allowed']} allowed (listed in engines/miles/"
              f"launcher_compare.py ALLOWED), {counts['DIFF']} DIFF")


def _short(value: str | None, width: int = 70) -> str:
    if value is None:
        return "-"
    return value if len(value) <= width else value[:width - 3] + "..."
