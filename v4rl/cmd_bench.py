"""`v4rl bench convert|rollout|train|e2e|learning --json OUT`: side-by-side benchmarks (bench/), JSON out.

`v4rl bench learning` takes `--arms A,B`, `--seeds N`, `--prompts-per-step N`, `--n-eval N` and `--work-dir DIR`
(resumable) besides `--steps` (bench/learning.py: FP8 rollout with each correction against BF16 rollout).
`v4rl bench e2e` takes `--seeds N`, `--arms A,B` (bench/e2e_arms.py: v4rl with one difference from TRL taken away)
and `--work-dir DIR` (keep the runs) besides `--steps`.

`v4rl bench rollout --config-sweep --json OUT` runs the rollout bench over several DeepSeek-V4 shapes instead
(bench/rollout_sweep.py).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import typer

from bench.e2e_arms import ARMS as E2E_ARMS

BENCHES = {"convert": "bench.convert", "rollout": "bench.rollout", "train": "bench.train", "e2e": "bench.e2e",
           "learning": "bench.learning"}
STEPS_BENCHES = ("e2e", "learning")
"""Benchmarks that take --steps."""
FLAG_BENCHES = {"--arms": ("learning", "e2e"), "--seeds": ("learning", "e2e"), "--prompts-per-step": ("learning",),
                "--n-eval": ("learning",), "--work-dir": ("learning", "e2e")}
"""Which benchmarks take each of the other flags."""
SWEEPS = {"rollout": "bench.rollout_sweep"}
"""Benchmarks with a --config-sweep variant."""


def register(app: typer.Typer) -> None:
    @app.command()
    def bench(name: str = typer.Argument(..., help=f"One of {', '.join(BENCHES)}."),
              json_out: Path = typer.Option(..., "--json", help="Where to write the results."),
              steps: int = typer.Option(None, "--steps", min=1,
                                        help="GRPO steps per side (e2e: default 20) or per run (learning: 30)."),
              arms: str = typer.Option(None, "--arms", help="learning and e2e: comma list of arms (learning, default "
                                       "all: bf16-tis, fp8-none, fp8-tis, fp8-icepop, fp8-geo-mask, fp8-opsm, "
                                       f"fp8-r3-tis; e2e, default v4rl only: {', '.join(E2E_ARMS[1:])})."),
              seeds: int = typer.Option(None, "--seeds", min=1,
                                        help="learning and e2e: seeds per arm (learning default 3, e2e 1)."),
              prompts_per_step: int = typer.Option(None, "--prompts-per-step", min=1,
                                                   help="learning only: prompts per GRPO step (default 128)."),
              n_eval: int = typer.Option(None, "--n-eval", min=1,
                                         help="learning only: held-out problems per evaluation (default 200)."),
              work_dir: Path = typer.Option(None, "--work-dir", help="learning and e2e: keep the runs here (learning: "
                                            "runs that finished there are reused, so an interrupted experiment "
                                            "continues; e2e: an empty directory)."),
              config_sweep: bool = typer.Option(False, "--config-sweep",
                                                help="rollout only: several DeepSeek-V4 shapes instead of tiny-cpu "
                                                     "(writes a PNG beside the JSON).")) -> None:
        """Run a side-by-side benchmark against its named peer; ratios measured in the same run."""
        from v4rl import inputs

        problem = inputs.first_problem(
            None if name in BENCHES else f"NAME: unknown benchmark {name!r}; choose one of {', '.join(BENCHES)}",
            None if steps is None or name in STEPS_BENCHES else
            f"--steps applies to {', '.join(STEPS_BENCHES)} only, not {name!r}",
            None if not config_sweep or name in SWEEPS else
            f"--config-sweep applies to {', '.join(SWEEPS)} only, not {name!r}",
            *(None if value is None or name in FLAG_BENCHES[flag] else
              f"{flag} applies to {' and '.join(FLAG_BENCHES[flag])} only, not {name!r}"
              for flag, value in (("--arms", arms), ("--seeds", seeds), ("--prompts-per-step", prompts_per_step),
                                  ("--n-eval", n_eval), ("--work-dir", work_dir))),
            _arms_problem(name, arms),
            # before a benchmark of minutes, not when it writes its result
            inputs.output_file("--json", json_out), inputs.output_dir("--work-dir", work_dir))
        if problem:
            typer.secho(f"error: {problem}", fg=typer.colors.RED, err=True)
            raise typer.Exit(code=2)
        target = SWEEPS[name] if config_sweep else BENCHES[name]
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as exc:
            if exc.name != target:
                raise
            typer.secho(f"benchmark {name!r} is not built yet", fg=typer.colors.RED, err=True)
            raise typer.Exit(code=2)
        given = {"steps": steps, "arms": arms, "seeds": seeds, "prompts_per_step": prompts_per_step, "n_eval": n_eval,
                 "work_dir": work_dir}
        module.main(json_out, **{k: v for k, v in given.items() if v is not None})


def _arms_problem(name: str, arms: str | None) -> str | None:
    """--arms checked before any run starts (bench.learning and bench.e2e_arms import no torch at module level)."""
    if arms is None or name not in FLAG_BENCHES["--arms"]:
        return None
    if name == "e2e":
        from bench.e2e_arms import parse_arms
    else:
        from bench.learning import parse_arms

    try:
        parse_arms(arms)
    except ValueError as exc:
        return str(exc)
    return None
