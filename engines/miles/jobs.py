"""The Miles jobs v4rl derives from the training job's `train.py` argv, each a run of Miles' own train.py:

  run_argv        the whole run in one job (`--num-rollout steps`), resuming through --load: Miles evaluates
                  before training (step 0, or the resume point when its evaluation was lost) and every
                  `--eval-interval` rollouts, saves every `--save-interval` rollouts and at the last one (train.py
                  `should_run_periodic_action(..., num_rollout)`); `--skip-eval-before-train` when the step the
                  job starts at was already evaluated (a resubmission after a failure)
  eval_only_argv  `--num-rollout 0` with the eval flags: train.py's "eval-only" case loads a checkpoint (as a
                  reference: --ref-load, with --ref-ckpt-step for a saved iteration), pushes it to SGLang and
                  runs Miles' evaluation once (`eval 0`)

Both evaluate with `--log-passrate`: without it Miles logs no `eval/<dataset>-pass@k` at all.
  align_argv      a train-only debug run of one saved rollout batch (the cluster alignment gate):
                  `--load-debug-rollout-data F` (Miles then sets --debug-train-only: no SGLang engines),
                  `--save-debug-train-data D` (every rank dumps its batch with Megatron's recomputed
                  `log_probs`), `--debug-disable-optimizer` (no optimizer state, no update), one rollout of
                  exactly the file's samples, no --load (Miles loads --ref-load, our converted checkpoint), no
                  save, no eval, no routing/indexer replay (the file carries no routed experts: Megatron routes
                  itself, which is what the gate measures)

Flags are edited as argv tokens: a flag is removed with its values (every token up to the next `--flag`), and
a set flag is appended once. Miles (argparse) keeps the last occurrence of a value flag, but a store_true
flag cannot be unset by appending, hence the removal.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from engines.miles.command import parse_flags

CHECKPOINT_FLAGS = ("--load", "--save", "--save-interval", "--save-retain-interval", "--save-hf", "--async-save",
                    "--start-rollout-id")
EVAL_FLAGS = ("--eval-interval", "--eval-prompt-data", "--eval-config", "--n-samples-per-eval-prompt",
              "--eval-max-response-len", "--eval-top-p", "--eval-top-k", "--eval-temperature", "--skip-eval-before-train",
              "--log-passrate")
REPLAY_FLAGS = ("--use-rollout-routing-replay", "--use-routing-replay", "--use-rollout-indexer-replay")
ROLLOUT_GENERATION_FLAGS = ("--over-sampling-batch-size", "--dynamic-sampling-filter-path", "--rollout-function-path",
                            "--global-batch-size", "--rollout-batch-size", "--num-steps-per-rollout", "--num-rollout",
                            "--num-epoch")


def flag_values(argv: Sequence[str], flag: str) -> list[str] | None:
    """The values after the last `flag` in argv ([] for a store_true flag), or None when it is absent."""
    return parse_flags(list(argv)).get(flag)


def without_flags(argv: Sequence[str], flags: Iterable[str]) -> list[str]:
    """argv with every occurrence of `flags` removed, values included."""
    drop, out, skipping = set(flags), [], False
    for token in argv:
        if token.startswith("--"):  # a flag (values never start with "--"; negative numbers have one dash)
            skipping = token in drop
        if not skipping:
            out.append(token)
    return out


def with_flags(argv: Sequence[str], **flags: str | int | Sequence[str] | bool) -> list[str]:
    """argv with each flag (python name: num_rollout -> --num-rollout) set once, at the end: True = store_true,
    a value or a list of values otherwise."""
    names = {f"--{name.replace('_', '-')}": value for name, value in flags.items()}
    out = without_flags(argv, names)
    for flag, value in names.items():
        if value is True:
            out.append(flag)
        elif value is not False:
            out += [flag, *([str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)])]
    return out


def run_argv(train_argv: Sequence[str], *, steps: int, eval_interval: int | None = None,
             save_interval: int | None = None, evaluate_first: bool = True) -> list[str]:
    """The one training job of a run: rollouts [resume point, steps), Miles evaluating itself every `eval_interval`
    rollouts and saving every `save_interval` (None: the job's own flags) and at the last rollout; with
    `evaluate_first` Miles also evaluates the weights it starts from (step 0, or the resume point)."""
    if steps < 1:
        raise ValueError(f"a training run must train at least one rollout (--num-rollout), got {steps}")
    if flag_values(train_argv, "--save") is None or flag_values(train_argv, "--load") is None:
        raise ValueError("the training job has no --save/--load: a resubmission resumes through them; build the job "
                         "with a save directory (MilesJob.save_dir)")
    for name, value in (("eval_interval", eval_interval), ("save_interval", save_interval)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1 (--{name.replace('_', '-')}), got {value}")
    cadence = {"eval_interval": eval_interval} if eval_interval and flag_values(train_argv, "--eval-interval") else {}
    if save_interval:
        cadence["save_interval"] = save_interval
    return with_flags(train_argv, num_rollout=steps, skip_eval_before_train=not evaluate_first, log_passrate=True,
                      **cadence)


def eval_only_argv(train_argv: Sequence[str], *, checkpoint_dir: str | None = None,
                   iteration: int | None = None) -> list[str]:
    """Miles' evaluation of one checkpoint: --ref-load (step 0) when `checkpoint_dir` is None, else iteration
    `iteration` of a save directory, loaded as Miles loads a reference (`--ref-load DIR --ref-ckpt-step N`, no
    --load: arguments.py:3047-3058), so no tracker is read or changed. `--lr-decay-iters 1`: Miles sizes the LR
    schedule from --num-rollout (model.py get_optimizer_param_scheduler: train_iters = num_rollout x ...), so with 0
    Megatron's OptimizerParamScheduler fails its `lr_decay_steps > 0` assertion as the actor starts, before any
    evaluation (found by running this job against Miles 31f1ca961 on a local Ray head); nothing trains, so the
    schedule's length is moot."""
    if flag_values(train_argv, "--eval-prompt-data") is None and flag_values(train_argv, "--eval-config") is None:
        raise ValueError("the training job has no --eval-prompt-data: Miles has nothing to evaluate on; give the "
                         "eval dataset (eval_data) to the job")
    if (checkpoint_dir is None) != (iteration is None):
        raise ValueError("give both checkpoint_dir and iteration (a saved iter_XXXXXXX), or neither for --ref-load")
    argv = without_flags(train_argv, CHECKPOINT_FLAGS + ("--skip-eval-before-train", "--num-epoch", "--ref-ckpt-step"))
    where = {"ref_load": checkpoint_dir, "ref_ckpt_step": iteration} if checkpoint_dir is not None else {}
    return with_flags(argv, num_rollout=0, log_passrate=True, lr_decay_iters=1, **where)


def align_argv(train_argv: Sequence[str], *, rollout_data: str, train_dump: str, n_prompts: int) -> list[str]:
    """The cluster gate's train-only debug job (module docstring); `rollout_data` and `train_dump` are Miles path
    templates (`{rollout_id}`, and `{rank}` for the dump) on storage every node of the job reads and writes."""
    if "{rollout_id}" not in rollout_data or "{rollout_id}" not in train_dump or "{rank}" not in train_dump:
        raise ValueError(f"rollout_data {rollout_data!r} needs {{rollout_id}} and train_dump {train_dump!r} needs "
                         "{rollout_id} and {rank}: Miles formats them per rollout and rank")
    argv = without_flags(train_argv, CHECKPOINT_FLAGS + EVAL_FLAGS + REPLAY_FLAGS + ROLLOUT_GENERATION_FLAGS)
    return with_flags(argv, load_debug_rollout_data=rollout_data, save_debug_train_data=train_dump,
                      debug_disable_optimizer=True, num_rollout=1, rollout_batch_size=n_prompts,
                      num_steps_per_rollout=1)
