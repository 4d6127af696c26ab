"""`v4rl bench convert|rollout|train --json OUT`: side-by-side benchmarks (bench/), JSON out."""

from __future__ import annotations

import importlib
from pathlib import Path

import typer

BENCHES = {"convert": "bench.convert", "rollout": "bench.rollout", "train": "bench.train"}


def register(app: typer.Typer) -> None:
    @app.command()
    def bench(name: str = typer.Argument(..., help=f"One of {', '.join(BENCHES)}."),
              json_out: Path = typer.Option(..., "--json", help="Where to write the results.")) -> None:
        """Run a side-by-side benchmark against its named peer; ratios measured in the same run."""
        if name not in BENCHES:
            raise typer.BadParameter(f"unknown benchmark {name!r}; choose one of {sorted(BENCHES)}")
        try:
            module = importlib.import_module(BENCHES[name])
        except ModuleNotFoundError as exc:
            if exc.name != BENCHES[name]:
                raise
            typer.secho(f"benchmark {name!r} is not built yet", fg=typer.colors.RED, err=True)
            raise typer.Exit(code=2)
        module.main(json_out)
