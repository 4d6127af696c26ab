"""A GRPO training run on the embedded engines: rollout worker (our engine behind its SGLang-compatible
HTTP server) and trainer, as Ray actors in one placement group, driven by the loop in rl/loop.py.

Resumable: the trainer reloads the latest checkpoint (weights, optimizer, RNG, data cursor = step), the
rollout engine is brought to the same weights, metrics past that step are dropped, and the loop goes on
from the next step with the same prompts it would have used. `run_training(..., until=K)` stops after
step K so a caller (the Prefect flow) can run a long job as retryable segments.

    v4rl train --preset tiny-cpu --steps 100 --out runs/grpo
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from engines.rollout.sglang import SGLangClient, SGLangTimeout
from engines.train.cluster import RemoteCallTimeout
from engines.train.guards import MismatchBudget, MismatchBudgetExceeded, StepHung, append_event, record_hang
from engines.train.runlog import RunLog
from rl.loop import LoopConfig, advantages_of, evaluate, rollout_step, should_run

DEFAULT_BASE = Path(__file__).resolve().parents[2] / "tests" / "assets" / "tiny-base"
OPERATIONAL_FIELDS = ("steps", "call_timeout_s", "use_ray", "mismatch_threshold", "mismatch_steps", "mismatch_action")
"""Config fields a resumed run may change: they steer the run, not the trajectory."""


@dataclass(kw_only=True)
class TrainRunConfig:
    base: str = str(DEFAULT_BASE)
    """HF FP8 checkpoint to start from (the rollout engine serves it; the trainer loads it in BF16)."""
    steps: int = 100
    """GRPO steps of the whole run."""
    save_interval: int = 10
    """Training checkpoint every this many steps (and at the last step)."""
    n_eval: int = 200
    """Held-out problems per evaluation (disjoint from the training prompts)."""
    n_train: int = 4000
    """Training problems the step schedule cycles through."""
    lr: float = 1e-4
    max_tokens_per_gpu: int = 8192
    recompute: bool = False
    quantization_aware: bool = True
    """Trainer forwards with the FP8 weights the rollout serves (engines/train/fake_quant.py); without it the
    per-step updates are mostly rounded away on export and train/rollout logprobs drift apart (~0.2)."""
    loop: LoopConfig = field(default_factory=lambda: LoopConfig(dynamic_sampling=False))
    use_ray: bool = True
    """Host trainer and rollout as Ray actors (False: in this process, for debugging)."""
    call_timeout_s: float = 900.0
    """Timeout of every remote call (a step, an export, a weight update); a step that exceeds it fails with
    the thread stacks of the trainer and rollout processes in <run_dir>/hangs/ (a retry resumes)."""
    mismatch_threshold: float = 0.09
    """Mean train/rollout |Δlogprob| per step over which a step counts against the mismatch budget."""
    mismatch_steps: int = 3
    """Consecutive over-threshold steps that exhaust the budget."""
    mismatch_action: str = "alert"
    """alert (record in events.jsonl and the report), stop (fail the run), or rollback (reload the last
    checkpoint once, then stop)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _task_data(config: TrainRunConfig, tokenizer):
    from rl.math_task import make_splits

    train_rows, eval_rows = make_splits(config.n_train, config.n_eval, config.loop.seed)
    encode = lambda text: [tokenizer.bos_token_id] + tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    return ([encode(r["prompt"]) for r in train_rows], [r["label"] for r in train_rows],
            [encode(r["prompt"]) for r in eval_rows], [r["label"] for r in eval_rows])


def run_training(run_dir: str | Path, config: TrainRunConfig, *, until: int | None = None,
                 log: Callable[[str], None] = print, on_step: Callable[[int, dict], None] | None = None) -> dict:
    """Train (or resume) the run in run_dir up to step `until` (default: config.steps)."""
    from transformers import AutoTokenizer

    from engines.train.actors import HTTPRollout
    from rl.rewards import math_reward

    runlog = RunLog(run_dir)
    runlog.write_config(config.to_dict(), may_change=OPERATIONAL_FIELDS)
    last = min(until or config.steps, config.steps)
    tokenizer = AutoTokenizer.from_pretrained(config.base)
    prompts, labels, eval_prompts, eval_labels = _task_data(config, tokenizer)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    reward = lambda text, label: math_reward(text, label, literal_only=True)  # noqa: E731
    trainer_args = dict(base_dir=config.base, checkpoint_root=str(Path(run_dir) / "checkpoints"),
                        trainer_config={"lr": config.lr, "max_tokens_per_gpu": config.max_tokens_per_gpu,
                                        "recompute": config.recompute,
                                        "quantization_aware": config.quantization_aware},
                        grpo_config={"n_samples_per_prompt": config.loop.n_samples, "lr": config.lr,
                                     "dynamic_sampling": config.loop.dynamic_sampling},
                        seed=config.loop.seed)
    serving, fresh = _rollout_start_weights(config.base, Path(run_dir))
    workers = _workers(config, Path(run_dir).name, trainer_args, {"model_dir": str(serving)})
    with workers as (trainer, rollout_url, call):
        client = SGLangClient(rollout_url, timeout=config.call_timeout_s, generate_timeout=config.call_timeout_s,
                              update_timeout=config.call_timeout_s)
        rollout = HTTPRollout(client)
        resumed = call(trainer.resume, "resuming the trainer")
        start = resumed["step"]
        dropped = runlog.truncate_after(start)
        if start:
            log(f"resuming at step {start + 1} (checkpoint step {start}; dropped {dropped} metric rows past it)")
        if not fresh:  # the served export may be newer than the checkpoint the trainer resumed from
            _sync(call, trainer, rollout, Path(run_dir), start)
        if start == 0 and not (runlog.eval_dir / "step_000000.json").exists() and config.loop.eval_interval:
            runlog.write_eval(0, evaluate(rollout, eval_prompts, eval_labels, n=config.loop.eval_samples,
                                          max_new_tokens=config.loop.max_new_tokens, decode=decode,
                                          reward_fn=reward, seed=config.loop.seed + 99))
        budget = MismatchBudget(config.mismatch_threshold, config.mismatch_steps, config.mismatch_action)
        step = start + 1
        while step <= last:
            t0 = time.monotonic()
            try:
                groups, metrics = rollout_step(step, rollout=rollout, prompts=prompts, labels=labels,
                                               config=config.loop, decode=decode, reward_fn=reward)
                t1 = time.monotonic()
                metrics.update(call(trainer.train_step, "a GRPO step", groups,
                                    advantages_of(groups, config.loop.normalize_std)))
                t2 = time.monotonic()
                metrics["perf/update_weights_time"] = _sync(call, trainer, rollout, Path(run_dir), step)
            except (RemoteCallTimeout, SGLangTimeout) as exc:
                path = record_hang(Path(run_dir), step, workers.pids, exc)
                raise StepHung(f"step {step} made no progress within {config.call_timeout_s:.0f}s ({exc}); thread "
                               f"stacks of {sorted(workers.pids)} are in {path}; a retry resumes from the last "
                               "checkpoint") from exc
            metrics.update({"perf/train_time": t2 - t1, "perf/step_time": time.monotonic() - t0})
            runlog.append_metrics(step, metrics)
            if should_run(step, config.loop.eval_interval, config.steps):
                result = evaluate(rollout, eval_prompts, eval_labels, n=config.loop.eval_samples,
                                  max_new_tokens=config.loop.max_new_tokens, decode=decode, reward_fn=reward,
                                  seed=config.loop.seed + 99)
                runlog.write_eval(step, result)
                metrics.update({f"eval/math/{k}": v for k, v in result.items() if k.startswith("pass@")})
            if should_run(step, config.save_interval, last):
                call(trainer.save, "saving a checkpoint", step, {"step": step})
            log(f"step {step}: reward {metrics['rollout/raw_reward']:.3f} "
                f"|Δlogprob| {metrics['train/train_rollout_logprob_abs_diff']:.4f} "
                f"({metrics['perf/step_time']:.1f}s)")
            if on_step:
                on_step(step, metrics)
            event = budget.observe(step, metrics.get("train/train_rollout_logprob_abs_diff"))
            if event:
                append_event(Path(run_dir), event)
                log(event["message"])
                if event["action"] == "stop":
                    raise MismatchBudgetExceeded(event["message"] + f" (events in {Path(run_dir) / 'events.jsonl'})")
                if event["action"] == "rollback":
                    back = call(trainer.resume, "rolling back to the last checkpoint")["step"]
                    runlog.truncate_after(back)
                    _sync(call, trainer, rollout, Path(run_dir), back)
                    log(f"rolled back to step {back}")
                    step = back + 1
                    continue
            step += 1
    return {"run_dir": str(run_dir), "resumed_from": start, "last_step": last, "evals": runlog.evals()}


def _rollout_start_weights(base: str, run_dir: Path) -> tuple[Path, bool]:
    """The directory the rollout engine starts from: the base with FP8 routed experts (the seed's FP8 repackage).

    Online updates re-quantize the trainer's fp32 master weights every step. FP4 experts with UE8M0 1x32
    scales do not survive that: a group whose largest value sits on the top grid point (6 x scale) doubles
    its power-of-two scale at the smallest upward move and loses half its resolution (measured here: mean
    |Δlogprob| 0.19 after one lr-1e-4 step, vs 0.016 with FP8 experts). The seed ran the same way
    (SGLANG_DSV4_FP4_EXPERTS=0 on the FP8 repackage). Updates keep this format (the engine refuses a
    change of expert dtype). Written once; a resumed run starts from its latest export instead (returns
    (path, True) when written now).
    """
    from checkpoints.hf import load_hf_checkpoint, save_hf_checkpoint

    current = run_dir / "weights" / "current"
    if (current / "config.json").exists():
        return current, False
    cfg, native = load_hf_checkpoint(base)
    save_hf_checkpoint(current, cfg, native, weight_format="fp8", expert_dtype="fp8", scale_fmt="ue8m0",
                       tokenizer_dir=base, overwrite=True)
    return current, True


def _sync(call, trainer, rollout, run_dir: Path, step: int) -> float:
    """Export the trainer's weights as HF FP8 and load them into the rollout engine (paused meanwhile)."""
    start = time.monotonic()
    path = run_dir / "weights" / "current"
    call(trainer.export, "exporting weights", str(path))
    rollout.load_weights(str(path), version=f"step-{step}")
    return time.monotonic() - start


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
        self._actors = RunActors.create(_safe_key(self.run_key), trainer_args=self.trainer_args,
                                        rollout_args=self.rollout_args)
        timeout = self.config.call_timeout_s
        remote = lambda method, what, *a: call(method, *a, timeout=timeout, what=what)  # noqa: E731
        url = remote(self._actors.rollout.url, "asking the rollout worker for its URL")
        self.pids = {"driver": os.getpid(), "trainer": remote(self._actors.trainer.ping, "trainer pid"),
                     "rollout": remote(self._actors.rollout.ping, "rollout pid")}
        return self._actors.trainer, url, remote

    def __exit__(self, *exc) -> None:
        if not self.config.use_ray:
            self._rollout.stop()
            return
        try:
            self._actors.shutdown()
        finally:
            self._session.__exit__(*exc)


def _safe_key(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in name)[:48]
