"""Weights of both sides of `v4rl bench e2e` at the evaluation steps, and one evaluator for all of them.

Each snapshot is an HF DeepSeek-V4 checkpoint of the weights its side generates with: v4rl's is a copy of the
FP8 export its rollout server serves at that step (FP8 linears and experts, UE8M0 scales); TRL's holds its fp32
weights as they are. Re-quantizing TRL's weights to FP8 would round away much of what a run of a few steps
moves them (v4rl trains through that rounding, TRL does not), which is why its weights stay fp32.
`evaluate_snapshots` runs one evaluator on every snapshot alike: our model (engines/model) with the snapshot's
weights dequantized to fp32, in this process, sampling with `engines.rollout.sampling.generate` and scored by
rl.loop.evaluate (v4rl's held-out evaluation: pass@k, the synthetic task's grader), on v4rl's held-out problems
with the sampling seed `v4rl train` evaluates with. (Our rollout server serves FP8 storage only, so it cannot
hold TRL's weights.)

    save_snapshot(Path("runs/e2e/snapshots/trl"), 5, model, base)   # -> runs/e2e/snapshots/trl/step_000005
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import torch

from bench.e2e_settings import E2ESettings, held_out_rows, synthetic_grader


def snapshot_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def save_snapshot(root: Path, step: int, model, base: str) -> Path:
    """transformers model -> fp32 HF checkpoint under root/step_XXXXXX (written beside it, renamed when complete)."""
    from checkpoints.hf import save_hf_checkpoint
    from engines.model.config import ModelConfig
    from engines.train.hf_model import native_from_reference

    cfg = ModelConfig.from_hf_dict(model.config.to_dict())
    return save_hf_checkpoint(snapshot_dir(root, step), cfg, native_from_reference(model), weight_format="fp32",
                              tokenizer_dir=base, overwrite=True)


def save_rollout_start(root: Path, base: str) -> Path:
    """Step 0 of v4rl: the base as its rollout engine first serves it (FP8 routed experts, engines/train/run.py)."""
    from checkpoints.hf import load_hf_checkpoint, save_hf_checkpoint

    cfg, native = load_hf_checkpoint(base)
    return save_hf_checkpoint(snapshot_dir(root, 0), cfg, native, weight_format="fp8", expert_dtype="fp8",
                              scale_fmt="ue8m0", tokenizer_dir=base, overwrite=True)


def copy_snapshot(source: Path, root: Path, step: int) -> Path:
    """A copy of an exported checkpoint directory (v4rl's weights/current) under root/step_XXXXXX."""
    target = snapshot_dir(root, step)
    partial = target.with_name(f".{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(source, partial)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target


def evaluate_snapshots(settings: E2ESettings, snapshots: dict[str, dict[int, Path]],
                       log=print) -> dict[str, list[dict[str, Any]]]:
    """{side: [{"step", "pass@1", ..., "pass@8", "pass@1_se", ...}]} for {side: {step: snapshot dir}}."""
    evals: dict[str, list[dict[str, Any]]] = {}
    for side, by_step in snapshots.items():
        log(f"held-out evaluation of {side} at steps {sorted(by_step)}")
        evals[side] = [{"step": step, **evaluate_one(settings, path)} for step, path in sorted(by_step.items())]
    return evals


def evaluate_one(settings: E2ESettings, model_dir: Path) -> dict[str, Any]:
    """The held-out evaluation of one checkpoint: pass@1..8, truncation, length and the pass@1 standard error."""
    from transformers import AutoTokenizer

    from engines.align.score import load_ours
    from engines.train.run import prompt_encoder
    from rl.loop import evaluate

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    encode = prompt_encoder(tokenizer)
    rows = held_out_rows(settings)
    result = evaluate(InProcessRollout(load_ours(model_dir), tokenizer.eos_token_id),
                      [encode(r["prompt"]) for r in rows], [r["label"] for r in rows], n=settings.eval_samples,
                      max_new_tokens=settings.max_new_tokens, seed=settings.seed + 99,  # `v4rl train`'s eval seed
                      decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True), grader=synthetic_grader())
    samples = result["n_problems"] * result["n_samples"]
    # the problems are fixed, only the sampling varies: the binomial standard error over all samples bounds it
    result["pass@1_se"] = math.sqrt(result["pass@1"] * (1 - result["pass@1"]) / samples)
    return result


class InProcessRollout:
    """What rl.loop.evaluate needs of a Rollout (`generate`), on our model in this process; each snapshot gets a
    fresh model (evaluate_one), so there are no weight updates."""

    def __init__(self, model, eos_token_id: int) -> None:
        self.model, self.eos_token_id = model, eos_token_id

    def generate(self, prompts, *, n: int, temperature: float, max_new_tokens: int, seed: int):
        from engines.rollout.sampling import SamplingParams, generate

        params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)
        with torch.inference_mode():
            return generate(self.model, [list(p) for p in prompts], params, n=n, seed=seed,
                            eos_token_id=self.eos_token_id)


def cross_format_evals(settings: E2ESettings, v4rl_run_dir: Path, trl_last: Path, work: Path) -> dict[str, Any]:
    """Why the sides' pass@1 may differ at equal steps: the last step's weights of each side in the other side's
    format. `trl_as_fp8` is TRL's weights quantized the way v4rl serves them (how much of TRL's learning FP8
    rounding keeps); `v4rl_master_fp32` is v4rl's fp32 master weights from its final training checkpoint
    (trained through the FP8 forward, so not the model v4rl serves)."""
    from checkpoints.hf import load_hf_checkpoint, save_hf_checkpoint
    from engines.runs.checkpointing import load_training_checkpoint

    cfg, trl_weights = load_hf_checkpoint(trl_last)
    as_fp8 = save_hf_checkpoint(work / "trl_as_fp8", cfg, trl_weights, weight_format="fp8", expert_dtype="fp8",
                                scale_fmt="ue8m0", tokenizer_dir=settings.base, overwrite=True)
    master = load_training_checkpoint(Path(v4rl_run_dir) / "checkpoints", settings.steps, cfg)["master"]
    as_fp32 = save_hf_checkpoint(work / "v4rl_master_fp32", cfg, master, weight_format="fp32",
                                 tokenizer_dir=settings.base, overwrite=True)
    return {"step": settings.steps, "trl_as_fp8": evaluate_one(settings, as_fp8),
            "v4rl_master_fp32": evaluate_one(settings, as_fp32)}
