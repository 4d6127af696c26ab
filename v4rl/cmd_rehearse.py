"""`v4rl rehearse`: Miles' own train.py, unmodified, on this CPU machine with v4rl's engine as its SGLang
(engines/upstream/rehearsal/; docs/rehearsal.md says what it proves and what it cannot).

    v4rl rehearse --stage rollout                         # the vendored Miles pins where ../shared/vendor exists
    v4rl rehearse --miles-dir ~/miles --megatron-dir ~/Megatron-LM --json rehearsal.json
    v4rl rehearse --stage train --miles-dir ~/miles-e9e19b223 --dsv4-impl megatron   # rollout, then train
    v4rl rehearse --stage full --miles-dir ~/miles-e9e19b223 --dsv4-impl megatron    # loop, kill, resume
    v4rl rehearse --stage full --submit ray-job           # the same, `ray job submit`ted as the cluster path does
    v4rl rehearse --stage train --miles-dir ~/miles-e9e19b223 --dsv4-impl megatron --layout pp2-ep2
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import typer

from rl.field_docs import field_default_and_doc

_LAYOUT = field_default_and_doc("engines.upstream.rehearsal.run", "RehearsalRequest", "layout")
_SUBMIT = field_default_and_doc("engines.upstream.rehearsal.run", "RehearsalRequest", "submit")


def register(app: typer.Typer) -> None:
    @app.command("rehearse")
    def rehearse_cmd(
        stage: str = typer.Option("rollout", help="rollout: Miles' train.py --debug-rollout-only against v4rl's "
                                                  "engine (generate, reward, eval pass@k); train: Miles' Megatron "
                                                  "actor trains on those rollouts (--debug-train-only), after a "
                                                  "rollout stage unless --rollout-data is given; full: Miles' "
                                                  "normal loop (broadcast, generate, train, save, eval), killed "
                                                  "after rollout 1 and resumed from --load, a weight check "
                                                  "after every broadcast."),
        rollout_data: Path = typer.Option(None, help="Stage train: the rollout-data/ folder of an earlier rollout "
                                                     "stage (Miles' rollout_<id>.pt dumps)."),
        dsv4_impl: str = typer.Option(None, help="Generation 2: miles | megatron (Megatron's own PyTorch "
                                                 "attention, --dsa-kernel-backend none)."),
        layout: str = typer.Option(_LAYOUT[0], help=_LAYOUT[1]),
        submit: str = typer.Option(_SUBMIT[0], help=_SUBMIT[1]),
        miles_dir: Path = typer.Option(None, envvar="V4RL_MILES_DIR",
                                       help="Miles checkout (default: the vendored pin where ../shared/vendor exists)."),
        megatron_dir: Path = typer.Option(None, envvar="V4RL_MEGATRON_DIR",
                                          help="Megatron-LM checkout that fits that Miles (default: its pinned pair)."),
        json_out: Path = typer.Option(None, "--json", help="Write the report (stages, rollouts, evals, "
                                                           "substitutions; stages train and full: "
                                                           "logprob_bound; stage full: weight_checks, "
                                                           "resumed_from) as JSON here."),
        work_dir: Path = typer.Option(None, help="Where the checkpoint, data, logs go (default: a new temp dir)."),
        engine_port: int = typer.Option(0, help="Port of v4rl's engine on 127.0.0.1 (0: a free one)."),
        ray_port: int = typer.Option(0, help="Port of the local Ray head (0: a free one)."),
        timeout: float = typer.Option(900.0, help="Seconds Miles' train.py may run before it is stopped."),
    ) -> None:
        """Rehearse the cluster's Miles job on CPU: Miles' own code, v4rl's engine, a tiny DeepSeek-V4."""
        from v4rl import inputs

        problem = inputs.first_problem(inputs.output_dir("--work-dir", work_dir), inputs.output_file("--json", json_out))
        if problem:  # before Miles, Ray and the engine start, not when the report is written minutes later
            typer.secho(f"error: {problem}", fg=typer.colors.RED, err=True)
            raise typer.Exit(code=1)
        from engines.upstream.rehearsal.job import substitution_table
        from engines.upstream.rehearsal.metrics import MilesMetrics, metrics_summary
        from engines.upstream.rehearsal.run import RehearsalError, RehearsalRequest, rehearse

        req = RehearsalRequest(stage=stage, miles_dir=str(miles_dir) if miles_dir else None,
                               megatron_dir=str(megatron_dir) if megatron_dir else None,
                               work_dir=str(work_dir) if work_dir else None, engine_port=engine_port,
                               ray_port=ray_port, timeout_s=timeout,
                               rollout_data=str(rollout_data) if rollout_data else None, dsv4_impl=dsv4_impl,
                               layout=layout, submit=submit)
        try:
            report = rehearse(req, log=lambda line: typer.echo(line, err=True))
        except RehearsalError as exc:
            typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
            raise typer.Exit(code=1) from None
        except KeyboardInterrupt:  # rehearse() stopped what it started and said where its work is
            raise typer.Exit(code=130) from None
        typer.echo(substitution_table(report.substitutions, width=shutil.get_terminal_size((120, 24)).columns))
        for line in metrics_summary(MilesMetrics(report.rollouts, report.evals)):
            typer.echo(line)
        if report.logprob_bound:
            b = report.logprob_bound
            typer.echo(f"bounds on train/train_rollout_logprob_abs_diff: {b['factor']:g} x bf16 noise "
                       f"{b['bf16_noise']:.4f} = {b['bound']:.4f} (stage train); {b['factor']:g} x (bf16 + FP8 "
                       f"re-quantization {b['fp8_requant_noise']:.4f}) = {b['broadcast_bound']:.4f} (stage full)")
        if json_out:
            json_out.write_text(json.dumps(report.to_json(), indent=1) + "\n")
        failed = [(name, s) for name, s in report.stages.items() if not s["ok"]]
        for name, s in report.stages.items():
            typer.echo(f"stage {name}: {'ok' if s['ok'] else 'FAILED'} in {s['seconds']} s"
                       + (f" - {s['error']}" if s["error"] else ""))
        typer.echo(verdict(report))
        if failed:
            raise typer.Exit(code=1)


def verdict(report) -> str:
    """The rehearsal's last line: passed or FAILED, the stages, and what they showed (rollouts, evaluations, the
    largest train/rollout |Δlogprob| against its bound, weight checks, the resume), so a pass is read at a glance."""
    stages = report.stages
    failed = [name for name, s in stages.items() if not s["ok"]]
    passed = [name for name in stages if name not in failed]
    plural = lambda n, what: f"{n} {what}{'' if n == 1 else 's'}"  # noqa: E731
    facts = [f"Miles generation {report.generation}", plural(len(report.rollouts), "rollout") + " logged",
             plural(len(report.evals), "evaluation")]
    diffs = [v["train/train_rollout_logprob_abs_diff"] for v in report.rollouts.values()
             if "train/train_rollout_logprob_abs_diff" in v]
    if diffs and report.logprob_bound:
        bound = report.logprob_bound["broadcast_bound" if "full" in stages else "bound"]
        facts.append(f"max |Δlogprob| {max(diffs):.4f} (bound {bound:.4f})")
    if report.weight_checks:
        equal = sum(bool(c.get("ok")) for c in report.weight_checks)
        facts.append(f"{equal}/{len(report.weight_checks)} weight checks equal")
    if report.resumed_from:
        facts.append(f"resumed from iteration {report.resumed_from.get('latest_checkpointed_iteration')}")
    shown = ", ".join(f"stage {name}" for name in passed) or "no stage"
    if not failed:
        return f"rehearsal passed: {shown} ({'; '.join(facts)})"
    first = stages[failed[0]]
    return (f"rehearsal FAILED at stage {failed[0]}: {first['error'] or 'see its log'}"
            + (f" (passed: {shown})" if passed else ""))
