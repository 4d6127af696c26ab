"""The SGLang half of `v4rl plan --sglang-dir DIR` (engines/upstream/sglang_preflight.py does the work): the
user's own SGLang DeepSeek-V4 model on CPU, a tiny model of the run's format, one update vs a fresh load; printed
per mode, refused (exit 2) when the cluster job's own mode does not round-trip.

    v4rl plan --preset dsv4-flash-mi355x --sglang-dir ~/sglang/python [--sglang-update distributed] [--json]
"""

from __future__ import annotations

import typer

from engines.upstream.sglang_preflight import SGLangModelCheck, check, summary

__all__ = ["check", "print_check"]


def print_check(result: SGLangModelCheck) -> None:
    typer.echo(f"SGLang model check ({result.sglang}), one {result.update_kind} update vs a fresh load:")
    for label, mode in result.modes.items():
        verdict = "round-trips" if mode["round_trips"] else \
            ("does not round-trip" if mode["loads"] else "fails to load")
        line = f"  {label}: {verdict}" + (f" — {mode['reason']}" if mode["reason"] else "")
        typer.secho(line, fg=typer.colors.GREEN if mode["round_trips"] else
                    (typer.colors.RED if label == result.run_mode else typer.colors.YELLOW))
    if not result.ok:
        typer.secho("refused: " + summary(result), fg=typer.colors.RED)
