"""`v4rl align`: train-vs-rollout alignment report with layer localisation (engines/align).

    v4rl align --model ckpt/hf-fp8 --torch-dist ckpt/torch_dist --prompts 32 --json align.json
    v4rl align ... --p99-threshold 0.5 --max-threshold 2.0      # gate the tail too

Exit status: 0 passed; 1 over a threshold or a sub-block diverges (the JSON says which); 2 the inputs
cannot be compared (message on stderr, no JSON written).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer

EXIT_FAILED, EXIT_BAD_INPUT = 1, 2


def _write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)


def _summary(report: dict) -> str:
    s, first = report["token_abs_diff"], report["first_divergence"]
    where = "none" if first is None else f"layer {first['layer']} {first['block']} ({first['sub_block']})"
    verdict = "PASSED" if report["passed"] else "FAILED: " + "; ".join(report["failures"])
    return (f"{report['n_tokens']} tokens from {report['n_sequences']} sequences: rollout vs trainer |dlogprob| "
            f"mean {s['mean']:.4f} p50 {s['p50']:.4f} p99 {s['p99']:.4f} max {s['max']:.4f}; "
            f"first divergence (fp32): {where}\n{verdict}")


def register(app: typer.Typer) -> None:
    @app.command()
    def align(
        model: Path = typer.Option(..., help="HF DeepSeek-V4 checkpoint (FP8/FP4): the rollout engine and reference."),
        torch_dist: Path = typer.Option(..., help="Megatron torch_dist directory of the same model: the trainer."),
        prompts: int = typer.Option(32, help="Held-out math prompts, one sampled response each."),
        json_out: Path = typer.Option(..., "--json", help="Where to write the report."),
        max_new_tokens: int = typer.Option(32, help="Longest response."),
        temperature: float = typer.Option(1.0, help="Sampling temperature of the rollout."),
        seed: int = typer.Option(0, help="Seed of the held-out split and the sampling."),
        mean_threshold: float = typer.Option(0.09, help="Max mean |dlogprob| rollout vs trainer (seed: ~0.09)."),
        p99_threshold: float = typer.Option(None, help="Max p99 |dlogprob| (default: not gated)."),
        max_threshold: float = typer.Option(None, help="Max |dlogprob| of any token (default: not gated)."),
        layer_tolerance: float = typer.Option(1e-3, help="fp32 relative error beyond which a sub-block diverges."),
        router_tolerance: float = typer.Option(0.0, help="Fraction of tokens routed differently that is tolerated."),
        fail_on_divergence: bool = typer.Option(True, help="A diverging sub-block fails the check by itself."),
        against: str = typer.Option("trainer", help="Layer-by-layer comparison with: trainer | reference."),
        rollout_dtype: str = typer.Option("float32", help="Rollout engine runtime dtype: float32 | bfloat16."),
        trainer_dtype: str = typer.Option("bfloat16", help="Trainer compute dtype: bfloat16 | float32."),
    ) -> None:
        """Rollout generates once; trainer and reference rescore the same tokens; localise the first mismatch."""
        from v4rl import inputs

        problem = inputs.first_problem(inputs.hf_checkpoint("--model", model),
                                       inputs.torch_dist_checkpoint("--torch-dist", torch_dist),
                                       inputs.output_file("--json", json_out, parents_made=True))
        if problem:
            typer.secho(f"error: {problem}", fg=typer.colors.RED, err=True)
            raise typer.Exit(code=EXIT_BAD_INPUT)
        from engines.align import AlignConfig, AlignError, align as run

        try:
            config = AlignConfig(n_prompts=prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                                 seed=seed, mean_threshold=mean_threshold, p99_threshold=p99_threshold,
                                 max_threshold=max_threshold, layer_rel_tol=layer_tolerance,
                                 router_tol=router_tolerance, fail_on_divergence=fail_on_divergence,
                                 against=against, rollout_dtype=rollout_dtype,  # type: ignore[arg-type]
                                 trainer_dtype=trainer_dtype)
            report = run(model, torch_dist, config, log=lambda msg: typer.echo(msg, err=True))
        except (AlignError, ValueError) as exc:
            typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
            raise typer.Exit(code=EXIT_BAD_INPUT)
        _write_json(json_out, report)
        typer.echo(_summary(report))
        typer.echo(f"wrote {json_out}")
        if not report["passed"]:
            raise typer.Exit(code=EXIT_FAILED)
