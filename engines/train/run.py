"""A GRPO training run on the embedded engines: rollout worker (our engine behind its SGLang-compatible
HTTP server) and trainer, as Ray actors in one placement group, driven by the loop in rl/loop.py.

Resumable: the trainer reloads the latest checkpoint (weights, optimizer, RNG, data cursor = step), the
rollout engine is brought to the same weights, metrics past that step are dropped, and the loop goes on
from the next step with the same prompts it would have used. As Miles does on the cluster, the run evaluates
itself (before training, every loop.eval_interval steps and at the last step: eval/step_XXXXXX.json, which the
rl-pipeline flow publishes as each lands) and checkpoints every save_interval steps and at the last step, so
the Prefect flow runs it as ONE long task. `stop` (engines/runs/stopping.py) ends it from another thread: its
Ray actors are killed at once (any call blocked on them ends) and the run raises TrainingStopped.

    v4rl train --preset tiny-cpu --steps 100 --out runs/grpo
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from engines.rollout.sglang import SGLangClient, SGLangTimeout
from engines.runs.checkpointing import latest_step
from engines.train.cluster import RemoteCallTimeout
from engines.runs.guards import MismatchBudget, MismatchBudgetExceeded, StepHung, append_event, record_hang
from engines.runs.run_lock import hold_run_dir
from engines.runs.runlog import RunLog
from engines.runs.sinks import check_sink_names, open_sinks
from engines.runs.stopping import StopRequest, TrainingStopped
from engines.runs.summary import eval_line
from rl.correction_setting import RolloutCorrection
from rl.grading import Grader, GraderFailed
from rl.loss_setting import LossAggregation, check_loss_aggregation
from rl.loop import LoopConfig, TaskData, run_grpo, sync_weights
from rl.reward_spec import check_reward, check_reward_spec, resolve_reward
from engines import TINY_BASE
from engines.presets.runs import run_numbers

DEFAULT_BASE = TINY_BASE
TINY = run_numbers("tiny-cpu")
"""The tiny-cpu preset's numbers (engines/presets/runs.py TINY_RUN): the defaults below and of `v4rl train`."""
LOOP_NUMBERS = ("prompts_per_step", "n_samples", "eval_interval", "eval_samples", "seed", "max_new_tokens",
                "temperature")
"""The preset numbers the loop (rl.loop.LoopConfig) reads; the others are TrainRunConfig's own fields."""


def tiny_loop(**overrides) -> LoopConfig:
    """The tiny-cpu preset's loop (dynamic sampling off, as its runs were measured), with `overrides`."""
    return LoopConfig(**{**{k: TINY[k] for k in LOOP_NUMBERS}, "dynamic_sampling": False, **overrides})
OPERATIONAL_FIELDS = ("steps", "call_timeout_s", "use_ray", "mismatch_threshold", "mismatch_steps", "mismatch_action",
                      "metric_sinks", "max_grader_error_ratio", "grader_workers", "grader_pool", "share_prompt_prefix")
"""Config fields a resumed run may change: they steer the run, not the trajectory."""
NEW_FIELD_DEFAULTS = {"train_data": "", "eval_data": "", "reward": "auto", "eval_reward": "auto",
                      "rollout_expert_dtype": "fp8", "input_key": "prompt", "label_key": "label",
                      "rollout_correction": RolloutCorrection().to_dict(), "rollout_weights": "fp8",
                      "loss_aggregation": "token-mean"}
NEW_LOOP_FIELD_DEFAULTS = {"advantage_eps": 1e-6}
"""Left out of config.json while at these values, so runs written before these fields existed resume unchanged
(loss_aggregation's is what those runs trained, not today's default: such a run resumes with token-mean only);
NEW_LOOP_FIELD_DEFAULTS the same inside `loop`."""
ROLLOUT_WEIGHTS = ("fp8", "bf16")
"""How a rollout engine can serve the linears (TrainRunConfig.rollout_weights): FP8 128x128 blocks, or unquantized."""
EXPERT_DTYPES = ("fp8", "fp4")
"""Routed-expert storage a rollout engine can serve (checkpoints.hf: FP8 128x128 blocks, FP4 E2M1 + UE8M0 1x32)."""
ROLLOUT_API_KEY_ENV = "V4RL_ROLLOUT_API_KEY"
"""When set, the run's rollout server requires this key (SGLang's --api-key semantics) and the client sends it;
it is read from the environment only, never written to config.json, metrics, events or logs."""


@dataclass(kw_only=True)
class TrainRunConfig:
    base: str = str(DEFAULT_BASE)
    """HF FP8 checkpoint to start from (the rollout engine serves it; the trainer loads it in BF16)."""
    steps: int = TINY["steps"]
    """GRPO steps of the whole run."""
    save_interval: int = 10
    """Training checkpoint every this many steps (and at the last step). An interrupted or failed run resumes after
    the last one and trains the steps past it again: a smaller interval loses fewer steps, each save costs time."""
    n_eval: int = TINY["n_eval"]
    """Held-out problems per evaluation (disjoint from the training prompts)."""
    n_train: int = 4000
    """Training problems the step schedule cycles through."""
    lr: float = TINY["lr"]
    """AdamW learning rate of the trainer (TrainerConfig.lr)."""
    max_tokens_per_gpu: int = TINY["max_tokens_per_gpu"]
    """Token budget of one trainer micro-batch."""
    recompute: bool = False
    share_prompt_prefix: bool = True
    """The trainer forwards each GRPO group's prompt once and continues its samples from the prompt's cache
    (TrainerConfig.share_prompt_prefix: the same logprobs and gradients as full sequences, to float rounding, at
    about a quarter of the forwarded tokens on tiny-cpu). False forwards every sample whole."""
    quantization_aware: bool = True
    """Trainer forwards with the FP8 weights the rollout serves (engines/train/fake_quant.py); without it the
    per-step updates are mostly rounded away on export and train/rollout logprobs drift apart (~0.2)."""
    rollout_expert_dtype: str = "fp8"
    """How routed experts are stored in what the rollout engine serves and in every weight update: fp8 (128x128
    blocks, UE8M0 scales: the seed's FP8-expert repackage, SGLang's SGLANG_DSV4_FP4_EXPERTS=0) or fp4 (E2M1 +
    UE8M0 per 1x32, how the bootstrap base stores them). Start and updates always agree: the rollout engine starts
    from the base re-stored in this format (converted once, logged, when the base stores experts otherwise), the
    trainer exports in it and its quantization-aware forward uses it. fp8 as on the cluster; fp4 measured as good
    over the first steps (`_rollout_start_weights` has the numbers)."""
    rollout_weights: str = "fp8"
    """How the rollout engine serves the linears: fp8 (the cluster's FP8 rollout, 128x128 blocks) or bf16
    (unquantized, the BF16-rollout baseline of `v4rl bench learning`; needs quantization_aware off)."""
    loop: LoopConfig = field(default_factory=tiny_loop)
    rollout_correction: RolloutCorrection = field(default_factory=RolloutCorrection)
    """How the loss corrects the train/rollout logprob mismatch (rl/corrections.py): the seed's token TIS by
    default; a mode name or the asdict form (config.json) is accepted too."""
    loss_aggregation: LossAggregation = "sample-mean"  # rl.loss_setting.DEFAULT_LOSS_AGGREGATION, as a literal
    """How the policy loss averages its tokens (rl/loss_setting.py): sample-mean (each sample's token mean, averaged
    over the step's samples: what the cluster job trains, Miles' default) or token-mean (the mean over all the
    step's tokens: Miles --calculate-per-token-loss, TRL's dapo). A run from before this setting trained token-mean
    and resumes only with it."""
    use_ray: bool = True
    """Host trainer and rollout as Ray actors (False: in this process, for debugging)."""
    call_timeout_s: float = 900.0
    """Timeout of every remote call (a step, an export, a weight update); a step that exceeds it fails with
    the thread stacks of the trainer and rollout processes in <run_dir>/hangs/ (a retry resumes)."""
    train_data: str = ""
    """JSONL/parquet prompt file ({"prompt", "label"} rows, Miles' format); empty: the synthetic addition task.
    Bad rows (missing label, non-string prompt, prompt over the context length, ...) are dropped and counted
    in events.jsonl and the report; fewer usable rows than prompts_per_step is an error naming the file."""
    eval_data: str = ""
    """Held-out prompt file (the first n_eval usable rows); empty: the synthetic held-out set."""
    input_key: str = "prompt"
    """Column of train_data / eval_data holding the prompt (Miles' --input-key), e.g. "question"."""
    label_key: str = "label"
    """Column holding the reference answer (Miles' --label-key), e.g. "answer"."""
    max_grader_error_ratio: float = 0.25
    """Fraction of samples per step whose reward function may fail (scored 0, counted in rollout/grader_errors)
    before the run stops with GraderFailed."""
    grader_workers: int = 0
    """Grade in a pool of this many workers (0: in the driver thread)."""
    grader_pool: str = "thread"
    """thread or process (spawned workers; the reward function must be picklable)."""
    reward: str = "auto"
    """How training samples are scored (rl/reward_spec.py): auto (literal for the synthetic task, math-verify for
    train_data), literal (the last \\boxed{} is a plain number equal to the label), math-verify (equal under
    math-verify), or package.module:function, a reward function with TRL's contract
    `f(prompts, completions, label, **kwargs) -> list[float]`. An unknown name, an import path that does not
    resolve or a function with another signature is a ValueError naming this field and the fix."""
    eval_reward: str = "auto"
    """How held-out samples are graded for pass@k (a sample solves its problem when its reward is > 0): auto
    (literal for the synthetic held-out set, math-verify for eval_data; not the training reward, so pass@k stays a
    task metric), or any value `reward` accepts."""
    mismatch_threshold: float = 0.09
    """Mean train/rollout |Δlogprob| per step over which a step counts against the mismatch budget."""
    mismatch_steps: int = 3
    """Consecutive over-threshold steps that exhaust the budget."""
    mismatch_action: str = "alert"
    """alert (record in events.jsonl and the report), stop (fail the run), or rollback (reload the last
    checkpoint once, then stop)."""
    metric_sinks: list[str] = field(default_factory=list)
    """Dashboards mirroring metrics.jsonl and eval/ (always written): "tensorboard" (<run_dir>/tensorboard/)
    and/or "wandb" (offline under <run_dir>/wandb/ unless WANDB_MODE=online); see engines/runs/sinks.py.
    Any other name is a ValueError listing the allowed ones; a resumed run may change the list."""

    def __post_init__(self) -> None:
        self.metric_sinks = check_sink_names(self.metric_sinks)
        self.rollout_correction = RolloutCorrection.coerce(self.rollout_correction)
        self.loss_aggregation = check_loss_aggregation(self.loss_aggregation, "TrainRunConfig.loss_aggregation")
        self.reward = check_reward_spec(self.reward, "reward")
        self.eval_reward = check_reward_spec(self.eval_reward, "eval_reward")
        if self.save_interval < 1:
            raise ValueError(f"save_interval={self.save_interval}: give 1 or more (a checkpoint every that many "
                             "steps, and at the last step)")
        if self.rollout_weights not in ROLLOUT_WEIGHTS:
            raise ValueError(f"rollout_weights={self.rollout_weights!r}: choose fp8 (FP8 rollout) or bf16 (unquantized)")
        if self.rollout_weights == "bf16" and self.quantization_aware:
            raise ValueError("rollout_weights='bf16' serves unquantized weights, so there is no FP8 rounding for the "
                             "quantization-aware forward to reproduce; set quantization_aware False")
        if self.rollout_expert_dtype not in EXPERT_DTYPES:
            raise ValueError(f"rollout_expert_dtype={self.rollout_expert_dtype!r} is not a routed-expert storage the "
                             f"rollout engine serves; choose one of {', '.join(EXPERT_DTYPES)}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainRunConfig":
        """The config from its dict form (to_dict, dataclasses.asdict, config.json): how it crosses the Prefect
        task boundary; a field left out takes its default, an unknown one is refused naming the closest."""
        from rl.known_fields import check_known_fields

        check_known_fields(data, cls.__dataclass_fields__, "TrainRunConfig")
        if "loop" in data:
            check_known_fields(data["loop"], LoopConfig.__dataclass_fields__, "TrainRunConfig.loop")
        return cls(**{**data, "loop": LoopConfig(**data["loop"])} if "loop" in data else data)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for fields, defaults in ((out, NEW_FIELD_DEFAULTS), (out["loop"], NEW_LOOP_FIELD_DEFAULTS)):
            for name, default in defaults.items():
                if fields[name] == default:
                    del fields[name]
        return out


def _task_data(config: TrainRunConfig, tokenizer, run_dir: Path, log: Callable[[str], None]):
    """(train prompt ids, train labels, eval prompt ids, eval labels): the synthetic task, with the training or
    held-out set replaced by config.train_data / config.eval_data when given (see load_data_file)."""
    from rl.math_task import make_splits

    train_rows, eval_rows = make_splits(config.n_train, config.n_eval, config.loop.seed)
    encode = prompt_encoder(tokenizer)
    data = [[encode(r["prompt"]) for r in train_rows], [r["label"] for r in train_rows],
            [encode(r["prompt"]) for r in eval_rows], [r["label"] for r in eval_rows]]
    files = (("train_data", config.train_data, config.loop.prompts_per_step, None, "prompts_per_step"),
             ("eval_data", config.eval_data, config.n_eval, config.n_eval, "n_eval"))
    for slot, (what, path, needed, keep, setting) in enumerate(files):
        if path:
            loaded = load_data_file(path, encode, base=config.base, max_new_tokens=config.loop.max_new_tokens,
                                    min_rows=needed, max_rows=keep, what=what, needed_by=f"{setting}={needed}",
                                    input_key=config.input_key, label_key=config.label_key)
            data[2 * slot], data[2 * slot + 1] = loaded.prompt_ids, loaded.labels
            record_dataset(run_dir, what, loaded.report, log)
    trained = {tuple(p) for p in data[0]}
    shared = sum(tuple(p) in trained for p in data[2])
    if shared:  # e.g. the same file for both: pass@k would then not measure generalization, and nothing said so
        warn(run_dir, f"warning: {shared} of the {len(data[2])} held-out prompts (eval_data "
                      f"{config.eval_data or '(synthetic)'}) are also training prompts (train_data "
                      f"{config.train_data or '(synthetic)'}), so held-out pass@k measures prompts the run trains "
                      "on; give eval_data rows that train_data does not hold", log)
    return tuple(data)


def prompt_encoder(tokenizer) -> Callable[[str], list[int]]:
    """BOS + the prompt's tokens: how every prompt of a run reaches the rollout engine."""
    return lambda text: [tokenizer.bos_token_id] + tokenizer(text, add_special_tokens=False).input_ids


def load_data_file(path: str, encode: Callable[[str], list[int]], *, base: str, max_new_tokens: int, min_rows: int,
                   max_rows: int | None = None, what: str = "dataset", needed_by: str = "", input_key: str = "prompt",
                   label_key: str = "label"):
    """A prompt file tokenized for the model in `base`: rows with a bad prompt or label, or a prompt that leaves no
    room for max_new_tokens in the model's context length, are dropped and counted (rl/datasets.py)."""
    from checkpoints.hf import read_config
    from rl.datasets import load_encoded_prompts

    context = read_config(base)[0].max_position_embeddings
    return load_encoded_prompts(path, encode, context_length=context, max_new_tokens=max_new_tokens,
                                min_rows=min_rows, max_rows=max_rows, what=what, needed_by=needed_by,
                                input_key=input_key, label_key=label_key)


def record_dataset(run_dir: Path, what: str, report, log: Callable[[str], None]) -> None:
    """Log a data file's kept/dropped counts and record them once in events.jsonl (the report lists events)."""
    message = f"{what}: {report.summary()}"
    log(message)
    _event_once(run_dir, {"step": 0, "action": "data", "what": what, **report.to_dict(), "message": message})


def warn(run_dir: Path, message: str, log: Callable[[str], None]) -> None:
    """Log a warning about the run's setup and record it once in events.jsonl (a resumed run logs it again)."""
    log(message)
    _event_once(run_dir, {"step": 0, "action": "warning", "message": message})


def _event_once(run_dir: Path, event: dict) -> None:
    message = event["message"]
    path = Path(run_dir) / "events.jsonl"
    seen = path.read_text().splitlines() if path.exists() else []
    if not any(json.loads(line).get("message") == message for line in seen if line.strip()):
        append_event(Path(run_dir), event)


def _graders(config: TrainRunConfig, decode: Callable[[list[int]], str], train_sample: tuple[list[int], str],
             eval_sample: tuple[list[int], str], log: Callable[[str], None]) -> tuple[Grader, Grader]:
    """The training and the evaluation grader (one Grader when both datasets resolve to the same reward), each
    checked before any worker starts: a built-in on its golden cases, a user's function on one sample per set."""
    train = resolve_reward(config.reward, config.train_data, "reward")
    held_out = resolve_reward(config.eval_reward, config.eval_data, "eval_reward")
    for choice, what, (prompt_ids, label) in ((train, "reward", train_sample), (held_out, "eval_reward", eval_sample)):
        check_reward(choice, decode(prompt_ids), label, what)
    log(f"reward: {train.name} (training, reward={config.reward}), {held_out.name} (held-out pass@k, "
        f"eval_reward={config.eval_reward})")
    options = dict(max_error_ratio=config.max_grader_error_ratio, workers=config.grader_workers, pool=config.grader_pool)
    grader = train.grader(**options)
    return grader, grader if held_out.name == train.name else held_out.grader(**options)


def _grader_events(run_dir: Path, grader, reported: set[str], step: int, metrics: dict) -> None:
    """One event per new kind of reward-function failure (type and first message), for events.jsonl and the report."""
    for kind, error in grader.first_error_by_type.items():
        if kind not in reported:
            reported.add(kind)
            message = f"{error}; failed samples score 0 and are counted in rollout/grader_errors"
            append_event(run_dir, {"step": step, "action": "grader_error",
                                   "value": metrics.get("rollout/grader_errors"), "message": message})


def run_training(run_dir: str | Path, config: TrainRunConfig, *, until: int | None = None,
                 log: Callable[[str], None] = print, on_step: Callable[[int, dict], None] | None = None,
                 stop: StopRequest | None = None) -> dict:
    """Train (or resume) the run in run_dir up to step `until` (default: config.steps); a set `stop` ends it
    (TrainingStopped) at once, its workers killed. The run directory is locked meanwhile (RunDirBusy names the
    process that holds it)."""
    with hold_run_dir(run_dir, log=log):
        return _train(run_dir, config, until=until, log=log, on_step=on_step, stop=stop)


def _train(run_dir: str | Path, config: TrainRunConfig, *, until: int | None, log: Callable[[str], None],
           on_step: Callable[[int, dict], None] | None, stop: StopRequest | None) -> dict:
    from transformers import AutoTokenizer

    from engines.rollout.api import EngineConfig
    from engines.train.actors import HTTPRollout
    from engines.train.trainer import TrainerConfig
    from rl.grpo import GRPOConfig

    # The sinks start on their first row, inside the `with` below that closes them (also on failure)
    runlog = RunLog(run_dir, sinks=open_sinks(config.metric_sinks, run_dir, config=config.to_dict()))
    runlog.check_config(config.to_dict(), may_change=OPERATIONAL_FIELDS)  # written once data and reward pass
    last = min(until or config.steps, config.steps)
    done = latest_step(Path(run_dir) / "checkpoints")
    if done is not None and done >= last:  # the same command again: say so instead of starting engines for nothing
        log(f"{run_dir} is complete: its checkpoint of step {done} covers the {last} steps asked for, so there is "
            "nothing to train; raise steps (--steps) to train further, or give a new output directory")
        return {"run_dir": str(run_dir), "resumed_from": done, "last_step": done, "evals": runlog.evals(),
                "complete": True}
    tokenizer = AutoTokenizer.from_pretrained(config.base)
    prompts, labels, eval_prompts, eval_labels = _task_data(config, tokenizer, Path(run_dir), log)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    grader, eval_grader = _graders(config, decode, (prompts[0], labels[0]), (eval_prompts[0], eval_labels[0]), log)
    _check_weights(Path(config.base), "give a base checkpoint whose config.json matches its weights")
    runlog.write_config(config.to_dict(), may_change=OPERATIONAL_FIELDS)
    api_key = os.environ.get(ROLLOUT_API_KEY_ENV) or None
    trainer_args = dict(base_dir=config.base, checkpoint_root=str(Path(run_dir) / "checkpoints"),
                        trainer_config=TrainerConfig(lr=config.lr, max_tokens_per_gpu=config.max_tokens_per_gpu,
                                                     recompute=config.recompute,
                                                     share_prompt_prefix=config.share_prompt_prefix,
                                                     quantization_aware=config.quantization_aware,
                                                     rollout_expert_dtype=config.rollout_expert_dtype,
                                                     rollout_weight_format=config.rollout_weights),
                        grpo_config=GRPOConfig(rollout_correction=config.rollout_correction,
                                               loss_aggregation=config.loss_aggregation),
                        seed=config.loop.seed)
    serving, fresh = _rollout_start_weights(config.base, Path(run_dir), config.rollout_expert_dtype, log,
                                            weight_format=config.rollout_weights)
    # the rollout always returns its routes: the trainer logs train/router_mismatch_frac with replay off too (#29)
    workers = _workers(config, Path(run_dir).name, trainer_args,
                       {"model_dir": str(serving), "api_key": api_key,
                        "engine_config": EngineConfig(enable_return_routed_experts=True)})
    stop = stop or StopRequest()
    stop.check()
    with runlog.sinks, grader, eval_grader, workers as (trainer, rollout_url, call), _stoppable(stop, workers):
        client = SGLangClient(rollout_url, api_key=api_key, timeout=config.call_timeout_s,
                              generate_timeout=config.call_timeout_s, update_timeout=config.call_timeout_s)
        if api_key:
            _check_protected(client, log)
        top_k = json.loads((serving / "config.json").read_text())["num_experts_per_tok"]
        rollout = HTTPRollout(client, routed_experts_top_k=top_k)
        learner = _RemoteLearner(call, trainer)
        start = learner.resume("resuming the trainer")
        dropped = runlog.truncate_after(start)
        stale = [e["step"] for e in runlog.evals() if e["step"] > start]
        for past in stale:  # evaluations of weights the resumed run trains again: redone when reached
            (runlog.eval_dir / f"step_{past:06d}.json").unlink()
        if start:
            log(f"resuming at step {start + 1} (checkpoint step {start}; dropped {dropped} metric rows past it"
                + (f" and the evaluations of steps {stale})" if stale else ")"))
        elif dropped or stale:  # an earlier run stopped before its first checkpoint: say that this one starts over
            log(f"starting over at step 1: {Path(run_dir) / 'checkpoints'} has no checkpoint; dropped {dropped} "
                "metric rows of an earlier run" + (f" and the evaluations of steps {stale}" if stale else ""))
        weights = str(Path(run_dir) / "weights" / "current")
        if not fresh or start:  # the served export may be newer (or, rewritten from the base, older) than the
            sync_weights(learner, rollout, weights, start)  # checkpoint the trainer resumed from
        hooks = _RunHooks(config, Path(run_dir), runlog, learner, rollout, weights, stop, workers, log, on_step,
                          graders=[grader] if eval_grader is grader else [grader, eval_grader])
        run_grpo(rollout=rollout, learner=learner, data=TaskData(prompts, labels, eval_prompts, eval_labels),
                 config=config.loop, decode=decode, grader=grader, eval_grader=eval_grader, hooks=hooks,
                 weights_path=weights, start=start, last=last, final_step=config.steps,
                 save_interval=config.save_interval,
                 evaluate_first=start == 0 and not (runlog.eval_dir / "step_000000.json").exists()
                 and bool(config.loop.eval_interval))
    return {"run_dir": str(run_dir), "resumed_from": start, "last_step": last, "evals": runlog.evals()}


def no_signal_warning(step: int, metrics: dict, config: TrainRunConfig) -> str:
    """The one line a step without a learning signal logs (rollout/no_learning_signal = 1): every group's samples
    scored alike, so every advantage is 0. Reward 0 everywhere on a data file is the common case: the tiny base
    answers only the prompt wording it was bootstrapped on (rl/math_task.py), and rl/sample_math.jsonl shows it."""
    from rl.datasets import SAMPLE_DATA

    groups = int(metrics.get("rollout/dynamic_filter_prompts") or config.loop.prompts_per_step)
    reward = metrics["rollout/raw_reward"]
    filtered = " (dynamic sampling filtered them all; the optimizer step was skipped)" \
        if config.loop.dynamic_sampling else ""
    line = (f"warning: step {step} has no learning signal: in each of its {groups} groups every sample scored the "
            f"same{filtered}, so every advantage is 0 and the step cannot change the model")
    if reward == 0 and config.train_data:
        line += (f"; reward is 0 on {config.train_data}: the tiny base solves only its own prompt wording "
                 f"(rows like {SAMPLE_DATA}), see docs/data-and-reward.md")
    elif reward == 0:
        line += "; reward is 0 on every sample: check the base checkpoint (--base) and --reward"
    else:
        line += "; every sample is right: give harder prompts"
    return line


def _check_weights(ckpt: Path, fix: str) -> None:
    """A HF checkpoint's tensors (from the headers) against its config.json, in the driver and before anything is
    written: in a Ray actor's __init__ the same error comes with Ray's print of its traceback."""
    from checkpoints.hf import CheckpointError
    from checkpoints.hf_stream import plan_source

    try:
        plan_source(ckpt)
    except CheckpointError as exc:
        raise CheckpointError(f"{exc}; {fix}") from exc


def _rollout_start_weights(base: str, run_dir: Path, expert_dtype: str = "fp8",
                           log: Callable[[str], None] = print, *, weight_format: str = "fp8") -> tuple[Path, bool]:
    """The directory the rollout engine starts from: the base with its routed experts stored as `expert_dtype`,
    the format every later update carries (TrainRunConfig.rollout_expert_dtype). A base that stores experts
    another way (the bootstrap base: FP4) is converted here, once per run, and the conversion is logged; the
    engine refuses an update in another expert format, and so does SGLang (conformance C10).

    Why fp8 by default: the cluster path serves FP8 experts (SGLANG_DSV4_FP4_EXPERTS=0 on the FP8 repackage, as
    the seed and Miles' launchers) and the 100-step table in docs/results.md was measured this way. With the trainer's
    quantization-aware forward in the same format, FP4 does as well over the first steps (measured 2026-12-01,
    `v4rl train --steps 4 --prompts-per-step 32 --no-ray`, lr 1e-4, loaded machine: mean |Δlogprob| fp4 0.0046,
    fp8 0.0056; reward 0.246 -> 0.375 vs 0.246 -> 0.359). Without that forward FP4 is far worse: a UE8M0 1x32
    group whose largest value sits on the top grid point doubles its power-of-two scale at the smallest upward move
    (|Δlogprob| 0.19 after one lr-1e-4 step, vs 0.016 with FP8 experts). Written once; a resumed run starts from
    its latest export instead (returns (path, True) when written now).
    """
    from checkpoints.hf import load_hf_checkpoint, read_config, save_hf_checkpoint

    current = run_dir / "weights" / "current"
    if (current / "config.json").exists():
        _check_weights(current, f"delete {current} and run again (the run writes it anew from its training checkpoint)")
        return current, False
    stored = read_config(base)[1].get("expert_dtype") or "fp4"
    cfg, native = load_hf_checkpoint(base)
    save_hf_checkpoint(current, cfg, native, weight_format=weight_format, expert_dtype=expert_dtype, scale_fmt="ue8m0",
                       tokenizer_dir=base, overwrite=True)
    if stored != expert_dtype:
        log(f"rollout start: the base {base} stores routed experts as {stored.upper()}; converted once to "
            f"{expert_dtype.upper()} in {current} (rollout_expert_dtype={expert_dtype}), the format every weight "
            "update of this run carries")
    else:
        log(f"rollout start: routed experts stay {expert_dtype.upper()} as the base stores them "
            f"(rollout_expert_dtype={expert_dtype})")
    return current, True


class _RemoteLearner:
    """rl.loop.Learner over the trainer worker: every call through `call` (Ray: with the run's timeout)."""

    def __init__(self, call, trainer) -> None:
        self.call, self.trainer = call, trainer

    def train_step(self, groups, advantages) -> dict[str, float]:
        return self.call(self.trainer.train_step, "a GRPO step", groups, advantages)

    def export(self, path: str) -> None:
        self.call(self.trainer.export, "exporting weights", path)

    def save(self, step: int) -> None:
        self.call(self.trainer.save, "saving a checkpoint", step, {"step": step})

    def resume(self, what: str) -> int:
        """Reload the latest checkpoint; the step it holds (0: none)."""
        return self.call(self.trainer.resume, what)["step"]


class _RunHooks:
    """rl.loop.LoopHooks for a run directory: stop requests, hang capture (StepHung with the workers' stacks),
    grader events, metrics.jsonl and eval/, the step's log line and the mismatch budget (alert, stop, rollback)."""

    def __init__(self, config: TrainRunConfig, run_dir: Path, runlog: RunLog, learner: _RemoteLearner, rollout,
                 weights: str, stop: StopRequest, workers: "_workers", log: Callable[[str], None],
                 on_step: Callable[[int, dict], None] | None, graders: list[Grader]) -> None:
        self.config, self.run_dir, self.runlog, self.learner, self.rollout = config, run_dir, runlog, learner, rollout
        self.weights, self.stop, self.workers, self.log, self.on_step, self.graders = \
            weights, stop, workers, log, on_step, graders
        self.reported_grader_errors: set[str] = set()
        self.budget = MismatchBudget(config.mismatch_threshold, config.mismatch_steps, config.mismatch_action)

    def check_stop(self, step: int) -> None:
        self.stop.check()

    @contextmanager
    def guard(self, step: int) -> Iterator[None]:
        try:
            yield
        except GraderFailed as exc:  # too many reward-function failures: recorded in events.jsonl
            append_event(self.run_dir, {"step": step, "action": "stop", "message": str(exc)})
            raise
        except (RemoteCallTimeout, SGLangTimeout) as exc:
            path = record_hang(self.run_dir, step, self.workers.pids, exc)
            raise StepHung(f"step {step} made no progress within {self.config.call_timeout_s:.0f}s ({exc}); thread "
                           f"stacks of {sorted(self.workers.pids)} are in {path}; a retry resumes from the last "
                           "checkpoint") from exc

    def graded(self, step: int, metrics: dict) -> None:
        for used in self.graders:
            _grader_events(self.run_dir, used, self.reported_grader_errors, step, metrics)

    def log_metrics(self, step: int, metrics: dict) -> None:
        self.runlog.append_metrics(step, metrics)
        self.log(f"step {step}: reward {metrics['rollout/raw_reward']:.3f} "  # before the step's evaluation, if any
                 f"|Δlogprob| {metrics.get('train/train_rollout_logprob_abs_diff', float('nan')):.4f} "
                 f"({metrics['perf/step_time']:.1f}s)")

    def log_eval(self, step: int, result: dict) -> None:
        self.runlog.write_eval(step, result)
        self.log(eval_line(step, result))  # as it lands: an interrupted run has shown every evaluation it made

    def step_done(self, step: int, metrics: dict) -> int | None:
        if metrics["rollout/no_learning_signal"]:
            self.log(no_signal_warning(step, metrics, self.config))
        if self.on_step:
            self.on_step(step, metrics)
        event = self.budget.observe(step, metrics.get("train/train_rollout_logprob_abs_diff"))
        if not event:
            return None
        append_event(self.run_dir, event)
        self.log(event["message"])
        if event["action"] == "stop":
            raise MismatchBudgetExceeded(event["message"] + f" (events in {self.run_dir / 'events.jsonl'})")
        if event["action"] != "rollback":
            return None
        back = self.learner.resume("rolling back to the last checkpoint")
        self.runlog.truncate_after(back)
        sync_weights(self.learner, self.rollout, self.weights, back)
        self.log(f"rolled back to step {back}")
        return back


class RolloutUnprotected(ValueError):
    """V4RL_ROLLOUT_API_KEY is set, but the rollout server answers requests that do not carry it (a configuration
    error: a ValueError, so the Prefect task does not retry it)."""


def _check_protected(client: SGLangClient, log: Callable[[str], None]) -> None:
    if not client.requires_api_key():
        raise RolloutUnprotected(
            f"{ROLLOUT_API_KEY_ENV} is set but the rollout server at {client.base_url} answers requests without it, "
            "so anyone who can reach its port can generate and replace its weights; start it with the key "
            "(sglang.launch_server --api-key, v4rl serve-rollout --api-key) or unset the variable")
    log(f"rollout server {client.base_url} refuses requests without the API key ({ROLLOUT_API_KEY_ENV})")


class _stoppable:
    """Within the block, a stop request kills the workers at once (a call blocked on them fails) and whatever
    the block raises after a stop becomes TrainingStopped, so the caller sees why it ended."""

    def __init__(self, stop: StopRequest, workers: "_workers") -> None:
        self.stop, self.workers = stop, workers

    def __enter__(self) -> None:
        self.unregister = self.stop.on_stop(self.workers.kill)

    def __exit__(self, kind, exc, tb) -> None:
        self.unregister()
        if exc is not None and self.stop.is_set() and not isinstance(exc, TrainingStopped):
            raise TrainingStopped(f"training stopped: {self.stop.reason} (ended {type(exc).__name__})") from exc


class _workers:
    """Context manager yielding (trainer, rollout url, call) either on Ray or in this process."""

    def __init__(self, config: TrainRunConfig, run_key: str, trainer_args: dict, rollout_args: dict) -> None:
        self.config, self.run_key = config, run_key
        self.trainer_args, self.rollout_args = trainer_args, rollout_args

    def __enter__(self):
        if not self.config.use_ray:
            from engines.train.actors import RolloutWorker, TrainerWorker

            self._rollout = RolloutWorker(**self.rollout_args)
            trainer = TrainerWorker(**self.trainer_args)
            self.pids = {"driver, trainer and rollout": os.getpid()}
            direct = lambda method, what, *a: method(*a)  # noqa: E731
            return trainer, self._rollout.url(), direct
        from engines.train.cluster import RunActors, call, ray_session

        self._session = ray_session()
        self._session.__enter__()
        try:  # an actor whose __init__ raises (a damaged checkpoint): the session ends now, not in a GC at exit
            self._actors = RunActors.create(_safe_key(self.run_key), trainer_args=self.trainer_args,
                                            rollout_args=self.rollout_args)
            timeout = self.config.call_timeout_s
            remote = lambda method, what, *a: call(method, *a, timeout=timeout, what=what)  # noqa: E731
            url = remote(self._actors.rollout.url, "asking the rollout worker for its URL")
            self.pids = {"driver": os.getpid(), "trainer": remote(self._actors.trainer.ping, "trainer pid"),
                         "rollout": remote(self._actors.rollout.ping, "rollout pid")}
        except BaseException:
            self._session.__exit__(*sys.exc_info())
            raise
        return self._actors.trainer, url, remote

    def kill(self) -> None:
        """End the workers now, from any thread (a stop request): Ray actors are killed, so a call blocked on one
        fails; in this process the rollout server stops (the trainer's step in progress runs to its end)."""
        if not self.config.use_ray:
            self._rollout.stop()
            return
        import ray

        for actor in (self._actors.trainer, self._actors.rollout):
            ray.kill(actor)

    def __exit__(self, kind, exc, tb) -> None:
        if not self.config.use_ray:
            self._rollout.stop()
            return
        try:
            if kind is not None and issubclass(kind, KeyboardInterrupt):
                # Ctrl-C or SIGTERM: a SIGTERM to the process group (timeout, systemd, Slurm) also ended the local
                # cluster's GCS, and a call to an actor would then wait out its timeout; ray.kill does not wait
                self.kill()
            else:
                self._actors.shutdown()
        finally:
            self._session.__exit__(kind, exc, tb)


def _safe_key(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in name)[:48]
