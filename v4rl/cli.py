"""The `v4rl` command line: thin wrappers over library functions (engines/, checkpoints/, rl/).

    v4rl demo                                   # what exists so far, end to end on the tiny model
    v4rl bootstrap --out runs/base --seed 0     # tiny DeepSeek-V4 base checkpoint (FP8 + FP4 experts)
    v4rl score --model runs/base --input seqs.json --engine ours --json out.json
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="DeepSeek-V4 RL pipeline: tiny CPU model end to end, cluster launch plans for MI355X.")


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=1)


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


@app.command()
def bootstrap(out: Path = typer.Option(..., help="Directory to write the checkpoint to (replaced if present)."),
              seed: int = typer.Option(0, help="Seed of init, data order and eval sampling."),
              max_steps: int = typer.Option(1500, help="Give up after this many training steps."),
              pass1_low: float = typer.Option(0.25), pass1_high: float = typer.Option(0.45),
              pass8_max: float = typer.Option(0.82)) -> None:
    """Train the tiny model from scratch until held-out pass@1 lies in the band; write FP8 + FP4 HF checkpoint."""
    from engines.train.bootstrap import BootstrapConfig, bootstrap as run

    try:
        run(out, BootstrapConfig(seed=seed, max_steps=max_steps, pass1_low=pass1_low, pass1_high=pass1_high,
                                 pass8_max=pass8_max))
    except (RuntimeError, ValueError) as exc:
        _fail(str(exc))


@app.command()
def score(model: Path = typer.Option(..., help="HF DeepSeek-V4 checkpoint directory."),
          input: Path = typer.Option(..., help='JSON list of {"prompt_ids": [...], "response_ids": [...]}.'),
          engine: str = typer.Option("ours", help="ours | reference (transformers' DeepseekV4ForCausalLM)."),
          dtype: str = typer.Option("float32", help="float32 | bfloat16 compute precision."),
          json_out: Path = typer.Option(..., "--json", help="Where to write [{\"logprobs\": [...]}, ...].")) -> None:
    """Per-token logprobs of the response tokens under our engine or the transformers reference."""
    from engines.score import read_sequences, score as run

    try:
        result = run(model, read_sequences(input), engine=engine, dtype=dtype)
    except ValueError as exc:
        _fail(str(exc))
    _write_json(json_out, result)
    typer.echo(f"wrote {len(result)} sequences to {json_out}")


@app.command()
def demo(workdir: Path = typer.Option(Path("runs/demo"), help="Where the demo keeps its checkpoint and outputs."),
         seed: int = typer.Option(0),
         fresh: bool = typer.Option(False, help="Bootstrap the base checkpoint anew instead of the committed one.")) -> None:
    """Run what exists so far on the tiny model and say what is not built yet."""
    from v4rl.demo import run_demo

    sys.exit(run_demo(workdir, seed=seed, fresh=fresh))


# Each area registers its own commands (`def register(app: typer.Typer) -> None`), so areas stay separate.
COMMAND_MODULES = ("v4rl.cmd_convert", "v4rl.cmd_rollout", "v4rl.cmd_plan", "v4rl.cmd_bench")
for _name in COMMAND_MODULES:
    try:
        _module = importlib.import_module(_name)
    except ModuleNotFoundError as exc:
        if exc.name != _name:
            raise
        continue
    _module.register(app)


if __name__ == "__main__":
    app()
