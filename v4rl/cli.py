"""The `v4rl` command line: thin wrappers over library functions (engines/, checkpoints/, rl/).

    v4rl demo                                   # what exists so far, end to end on the tiny model
    v4rl bootstrap --out runs/base --seed 0     # tiny DeepSeek-V4 base checkpoint (FP8 + FP4 experts)
    v4rl score --model runs/base --input seqs.json --engine ours --json out.json
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
from pathlib import Path

# Before torch loads OpenMP: spin-waiting threads cost ~10x on small CPU machines (see tests/conftest.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import typer  # noqa: E402

HELP_WIDTH = 120
"""Columns `--help` uses at most (fewer on a narrower terminal: COLUMNS or the terminal's width). Help is click's
plain layout, not typer's rich tables: those give the names, their --no- forms and the types a column each, and at
120 columns left the help text 30-odd (`train --help` was 163 lines; an option name could wrap inside its cell).
Click writes each option's names and type on one line and its help beside or below it, 80-odd columns wide; a usage
error is one plain `Error:` line, not a boxed panel whose borders cut the message."""

from engines.presets.runs import SHORT_RUNS, run_numbers  # noqa: E402
from rl.field_docs import field_default_and_doc  # noqa: E402
from v4rl.help_format import plain_help  # noqa: E402

TINY = run_numbers("tiny-cpu")
"""`v4rl train`'s defaults: the tiny-cpu preset's numbers (engines/presets/runs.py TINY_RUN), as the flow's form."""

SAVE_INTERVAL = field_default_and_doc("engines.train.run", "TrainRunConfig", "save_interval")
ROLLOUT_WEIGHTS = field_default_and_doc("engines.train.run", "TrainRunConfig", "rollout_weights")
LOSS_AGGREGATION = field_default_and_doc("engines.train.run", "TrainRunConfig", "loss_aggregation")
CORRECTION_MODE, CORRECTION_OPSM, CORRECTION_OPSM_DELTA, CORRECTION_ROUTING_REPLAY = (
    field_default_and_doc("rl.correction_setting", "RolloutCorrection", name)
    for name in ("mode", "opsm", "opsm_delta", "routing_replay"))
from v4rl.errors import OneLineErrors  # noqa: E402

app = typer.Typer(add_completion=False, no_args_is_help=True, cls=OneLineErrors, rich_markup_mode=None,
                  context_settings={"max_content_width": HELP_WIDTH},
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
    from v4rl import inputs

    problem = inputs.output_dir("--out", out, replaces="hf")
    if problem:
        _fail(problem)
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
    from v4rl import inputs

    problem = inputs.first_problem(inputs.hf_checkpoint("--model", model),
                                   inputs.input_file("--input", input, 'a JSON list of {"prompt_ids", "response_ids"}'),
                                   inputs.output_file("--json", json_out))
    if problem:
        _fail(problem)
    from engines.align.score import read_sequences, score as run

    try:
        result = run(model, read_sequences(input), engine=engine, dtype=dtype)
    except ValueError as exc:
        _fail(str(exc))
    _write_json(json_out, result)
    typer.echo(f"wrote {len(result)} sequences to {json_out}")


@app.command()
def train(out: Path = typer.Option(..., help="Run directory (metrics.jsonl, eval/, checkpoints/); resumes if present."),
          preset: str = typer.Option("tiny-cpu", help="Only tiny-cpu runs here; clusters go through `v4rl plan --launch`."),
          steps: int = typer.Option(TINY["steps"], min=1, help="GRPO steps of the run (default: the tiny-cpu "
                                                                 "preset's, engines/presets/runs.py, as every "
                                                                 "number below)."),
          save_interval: int = typer.Option(SAVE_INTERVAL[0], min=1, help=SAVE_INTERVAL[1]),
          base: Path = typer.Option(None, help="Base HF FP8 checkpoint (default: the committed tiny base)."),
          prompts_per_step: int = typer.Option(TINY["prompts_per_step"], min=1),
          n_samples: int = typer.Option(TINY["n_samples"], min=2, help="Samples per prompt (GRPO group size)."),
          eval_interval: int = typer.Option(TINY["eval_interval"], min=0, help="Evaluate every this many steps "
                                                                               "(and before training); 0: never."),
          n_eval: int = typer.Option(TINY["n_eval"], min=1, help="Held-out problems per evaluation."),
          eval_samples: int = typer.Option(TINY["eval_samples"], min=1, help="Samples per held-out problem."),
          lr: float = typer.Option(TINY["lr"]), seed: int = typer.Option(TINY["seed"]),
          dynamic_sampling: bool = typer.Option(False, help="Drop all-equal groups and over-sample to refill."),
          rollout_correction: str = typer.Option(CORRECTION_MODE[0], help=CORRECTION_MODE[1]),
          opsm: bool = typer.Option(CORRECTION_OPSM[0], "--opsm", help=CORRECTION_OPSM[1]),
          opsm_delta: float = typer.Option(CORRECTION_OPSM_DELTA[0], help=CORRECTION_OPSM_DELTA[1]),
          routing_replay: bool = typer.Option(CORRECTION_ROUTING_REPLAY[0], "--routing-replay",
                                              help=CORRECTION_ROUTING_REPLAY[1]),
          loss_aggregation: str = typer.Option(LOSS_AGGREGATION[0], help=LOSS_AGGREGATION[1]),
          train_data: Path = typer.Option(None, help="JSONL/parquet of {prompt, label} rows (default: the synthetic "
                                                     "addition task); bad rows (a malformed JSON line too) are "
                                                     "dropped and counted. The tiny base solves only its own wording: "
                                                     "rl/sample_math.jsonl is a file in it."),
          eval_data: Path = typer.Option(None, help="Held-out rows in the same format (default: synthetic)."),
          input_key: str = typer.Option("prompt", help="Column of --train-data / --eval-data holding the prompt "
                                                       "(Miles' --input-key), e.g. question."),
          label_key: str = typer.Option("label", help="Column holding the reference answer (Miles' --label-key), "
                                                      "e.g. answer."),
          reward: str = typer.Option("auto", help="auto (literal for the synthetic task, math-verify for --train-data), "
                                                  "literal, math-verify, or package.module:function with TRL's "
                                                  "contract f(prompts, completions, label, **kwargs) -> list[float] "
                                                  "(rl/reward_spec.py; the module must be on PYTHONPATH)."),
          eval_reward: str = typer.Option("auto", help="Grader of held-out pass@k: auto (literal for the synthetic "
                                                       "set, math-verify for --eval-data) or any --reward value."),
          max_grader_error_ratio: float = typer.Option(0.25, min=0.0, max=1.0,
                                                       help="Fraction of a step's samples whose reward may fail "
                                                            "(scored 0, counted) before the run stops."),
          rollout_expert_dtype: str = typer.Option("fp8", help="Routed experts as the rollout engine serves them and "
                                                               "every weight update carries: fp8 (the base's FP4 "
                                                               "experts converted once at the start, logged) or fp4."),
          rollout_weights: str = typer.Option(ROLLOUT_WEIGHTS[0], help=f"{ROLLOUT_WEIGHTS[1]} `v4rl train` turns "
                                                                       "quantization_aware off with bf16."),
          ray: bool = typer.Option(True, help="Host trainer and rollout as Ray actors (loopback-only local cluster "
                                              "unless RAY_ADDRESS is set)."),
          tensorboard: bool = typer.Option(False, "--tensorboard", help="Also write metrics and evals as "
                                                                        "TensorBoard scalars to OUT/tensorboard/."),
          wandb: bool = typer.Option(False, "--wandb", help="Also log metrics and evals to W&B: offline under "
                                                            "OUT/wandb/ unless WANDB_MODE=online.")) -> None:
    """GRPO with a rollout correction (token TIS by default) on the embedded engines (rollout server over HTTP,
    transformers trainer), resumable."""
    from engines.presets.runs import preset_name
    from v4rl import inputs

    try:  # tiny_cpu and tiny-cpu alike; an unknown name gets the closest known one
        preset = preset_name(preset)
    except ValueError as exc:
        _fail(f"--preset: {exc}")
    if preset != "tiny-cpu":
        _fail(f"preset {preset!r} trains on a GPU cluster through Miles; see `v4rl plan --preset {preset} --launch`")
    # Paths and settings first, in a second, before torch, Ray or a tokenizer loads; nothing is written yet. Every
    # mistake of the command line at once, each under its flag (v4rl/train_flags.py)
    from rl.correction_setting import RolloutCorrection
    from rl.loss_setting import check_loss_aggregation
    from v4rl.train_flags import setting_problems

    problems = [p for p in (inputs.run_dir("--out", out), inputs.hf_checkpoint("--base", base),
                            inputs.data_file("--train-data", train_data), inputs.data_file("--eval-data", eval_data))
                if p] + setting_problems(reward=reward, eval_reward=eval_reward,
                                         rollout_expert_dtype=rollout_expert_dtype, rollout_weights=rollout_weights)
    correction = None
    try:
        correction = RolloutCorrection(mode=rollout_correction, opsm=opsm, opsm_delta=opsm_delta,
                                       routing_replay=routing_replay)
    except ValueError as exc:
        problems.append(f"--rollout-correction / --opsm-delta: {exc}")
    try:
        check_loss_aggregation(loss_aggregation, "--loss-aggregation")
    except ValueError as exc:
        problems.append(str(exc))
    if problems:
        _fail("\nerror: ".join(problems))
    from engines.runs.run_lock import RunDirBusy, hold_run_dir
    from engines.runs.stopping import sigterm_as_interrupt

    created = not out.exists()
    try:  # before torch loads: a second run on this directory is refused in a second, naming the one that has it
        with hold_run_dir(out, log=typer.echo), sigterm_as_interrupt() as terminated:
            _train_run(out, created, terminated, base=base, steps=steps, save_interval=save_interval, n_eval=n_eval,
                                 lr=lr, use_ray=ray, tensorboard=tensorboard, wandb=wandb, train_data=train_data,
                                 eval_data=eval_data, input_key=input_key, label_key=label_key, reward=reward,
                                 eval_reward=eval_reward, max_grader_error_ratio=max_grader_error_ratio,
                                 rollout_expert_dtype=rollout_expert_dtype, rollout_weights=rollout_weights,
                                 # unquantized rollout: no FP8 rounding for the trainer's forward to reproduce
                                 quantization_aware=rollout_weights == "fp8", prompts_per_step=prompts_per_step,
                                 n_samples=n_samples, eval_interval=eval_interval, eval_samples=eval_samples,
                                 seed=seed,
                                 dynamic_sampling=dynamic_sampling, rollout_correction=correction,
                                 loss_aggregation=loss_aggregation)
    except RunDirBusy as exc:
        _fail(f"--out {exc}")
    _say_summary(out)


def _say_summary(out: Path) -> None:
    """Where the run's report, plots and checkpoints are (the report is written now, engines/runs/summary.py)."""
    from engines.runs.summary import run_summary

    try:
        lines = run_summary(out)
    except (OSError, ValueError) as exc:  # a run that cannot be summarized still ended as it did: say why, briefly
        lines = [f"no report: {type(exc).__name__}: {exc}"]
    typer.echo("\n".join(["summary:", *(f"  {line}" for line in lines)]))


def _train_run(out: Path, created: bool, terminated: list[int], *, tensorboard: bool, wandb: bool,
               train_data: Path | None, eval_data: Path | None, base: Path | None, prompts_per_step: int,
               n_samples: int, eval_interval: int, eval_samples: int, seed: int, dynamic_sampling: bool,
               **fields) -> dict:
    """`v4rl train` once the run directory is held: the run, or its failure or interruption in words.
    `terminated` is non-empty once SIGTERM came (engines/runs/stopping.py sigterm_as_interrupt)."""
    from engines.train.run import DEFAULT_BASE, TrainRunConfig, run_training, tiny_loop
    from v4rl.errors import is_run_failure, one_line_error, root_cause
    from v4rl.train_flags import as_flags

    sinks = [name for name, wanted in (("tensorboard", tensorboard), ("wandb", wandb)) if wanted]
    try:  # an unknown reward, an import path that does not resolve, bad data: a ValueError naming the fix
        config = TrainRunConfig(base=str(base or DEFAULT_BASE), metric_sinks=sinks, train_data=str(train_data or ""),
                                eval_data=str(eval_data or ""), **fields,
                                loop=tiny_loop(prompts_per_step=prompts_per_step, n_samples=n_samples,
                                               eval_interval=eval_interval, eval_samples=eval_samples, seed=seed,
                                               dynamic_sampling=dynamic_sampling))
        return run_training(out, config, log=lambda line: print(as_flags(line), flush=True))
    except ValueError as exc:
        if terminated:
            _interrupted(out, terminated)
        if created and not (out / "config.json").exists():
            shutil.rmtree(out, ignore_errors=True)  # the run never started: leave no directory behind
        _fail(as_flags(one_line_error(exc)))  # raised in a Ray actor: its message, not Ray's remote traceback
    except KeyboardInterrupt:
        _interrupted(out, terminated)
    except Exception as exc:
        if terminated:  # SIGTERM to a whole process group also ends the Ray workers: the driver may see that first
            _interrupted(out, terminated)
        if isinstance(root_cause(exc), FloatingPointError):  # diverged: a NaN/inf gradient, raised in the trainer
            _fail(f"{as_flags(one_line_error(exc))}; --lr is {fields['lr']:g} here (the tiny-cpu preset's: "
                  f"{TINY['lr']:g})")
        if not is_run_failure(exc):
            raise  # a bug: its traceback is what helps
        _fail(one_line_error(exc))  # a full disk, a hung step, a stop: the cause in one line, not Ray's dump


def _interrupted(out: Path, terminated: list[int]) -> None:
    """Ctrl-C or SIGTERM: what was kept and where the same command resumes, the summary; exit 130 or 143."""
    from engines.runs.kept import kept_after_interrupt

    how = "terminated (SIGTERM)" if terminated else "interrupted"
    typer.secho(f"{how}: {kept_after_interrupt(out)}", fg=typer.colors.YELLOW, err=True)
    _say_summary(out)
    raise typer.Exit(code=143 if terminated else 130)


@app.command()
def demo(workdir: Path = typer.Option(Path("runs/demo"), help="Where the demo keeps its checkpoint and outputs."),
         seed: int = typer.Option(TINY["seed"]),
         steps: int = typer.Option(SHORT_RUNS["demo"]["steps"], help="GRPO steps of the demo run (its other numbers: "
                                   "engines/presets/runs.py SHORT_RUNS['demo'] over the tiny-cpu preset)."),
         fresh: bool = typer.Option(False, help="Bootstrap the base checkpoint anew instead of the committed one."),
         ui: bool = typer.Option(False, "--ui", help="Serve the Prefect UI from the demo's own server, print live "
                                                     "links to the run and keep it up until Ctrl-C.")) -> None:
    """The tiny-cpu rl-pipeline end to end under a local Prefect server; prints where the report is."""
    from v4rl import inputs
    from v4rl.demo import DemoRefused, run_demo

    problem = inputs.output_dir("--workdir", workdir, refuses=("hf", "torch_dist", "run"))
    if problem:
        _fail(problem)
    try:
        code = run_demo(workdir, seed=seed, fresh=fresh, steps=steps, ui=ui)
    except DemoRefused as exc:
        _fail(str(exc))
    except Exception as exc:
        from v4rl.errors import is_run_failure, one_line_error

        if not is_run_failure(exc):
            raise  # a bug: its traceback is what helps
        _fail(one_line_error(exc))
    sys.exit(code)


# Each area registers its own commands (`def register(app: typer.Typer) -> None`), so areas stay separate.
COMMAND_MODULES = ("v4rl.cmd_convert", "v4rl.cmd_rollout", "v4rl.cmd_plan", "v4rl.cmd_align", "v4rl.cmd_bench",
                   "v4rl.cmd_rehearse")
for _name in COMMAND_MODULES:
    try:
        _module = importlib.import_module(_name)
    except ModuleNotFoundError as exc:
        if exc.name != _name:
            raise
        continue
    _module.register(app)
plain_help(app)


if __name__ == "__main__":
    app()
