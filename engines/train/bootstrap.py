"""`v4rl bootstrap`: train the tiny DeepSeek-V4 from scratch on the synthetic math task until it is a
good RL starting point, then write it as a native FP8 + FP4-expert HF checkpoint.

"Good starting point" is the seed's base model: held-out pass@1 (temperature 1, 8 samples) between 0.25
and 0.45, with pass@8 low enough that RL has room on both (the seed: 0.39 and 0.53). The model is
evaluated with OUR engine on the weights exactly as the checkpoint will store them (FP8/FP4 round
trip), so the band holds for what rollout will actually serve.

Training is plain supervised next-token loss on the answer (`\\boxed{85}<eos>`), transformers'
DeepseekV4ForCausalLM with fp32 master weights, BF16 autocast on CPU, AdamW. Deterministic for a seed
on a given machine kind (fixed thread count, seeded batches, seeded sampling).

    v4rl bootstrap --out checkpoints/tiny --seed 0
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from checkpoints.hf import save_hf_checkpoint
from engines.model import DeepseekV4, ModelConfig
from engines.presets.models import tiny_cpu_model_config
from engines.rollout.sampling import SamplingParams, generate
from engines.model.tokenizer import build_tokenizer
from engines.train.hf_model import build_reference_model, native_from_reference, use_native_mhc
from engines.train.storage import storage_round_trip
from rl.math_task import format_answer, make_splits
from rl.passk import mean_pass_at_k
from rl.rewards import math_reward


@dataclass(kw_only=True)
class BootstrapConfig:
    seed: int = 0
    """Seeds the init, the problem sets, the batch order and the eval sampling."""
    batch_size: int = 128
    """Supervised examples per AdamW step."""
    lr: float = 1e-3
    """AdamW learning rate (constant)."""
    max_steps: int = 1500
    """Give up (with an error naming the last pass@k) if the band is not reached by then."""
    eval_every: int = 10
    """Steps between held-out evaluations while pass@1 is far below the band."""
    eval_every_near_band: int = 2
    """Steps between evaluations once pass@1 >= near_band (pass@1 can jump several points in a few steps)."""
    near_band: float = 0.12
    n_eval: int = 64
    """Held-out problems (disjoint from training) used for the band check."""
    eval_samples: int = 8
    """Samples per held-out problem (pass@1 and pass@8 come from the same samples)."""
    pass1_low: float = 0.25
    pass1_high: float = 0.45
    pass8_max: float = 0.82
    """Stop only when pass@8 is at most this, so that RL has room on coverage as well."""
    operand_low: int = 10
    operand_high: int = 99
    """Operands of the a+b problems; every pair not held out for evaluation is a training example."""
    threads: int = 2
    """torch CPU threads: fixed so that the same seed gives the same bytes on the same machine kind."""


@dataclass
class EvalResult:
    step: int
    pass1: float
    pass8: float
    mean_response_tokens: float


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


@torch.inference_mode()
def evaluate_pass_at_k(model: DeepseekV4, tokenizer, rows: list[dict], *, n: int, seed: int,
                       max_new_tokens: int = 8) -> tuple[float, float, float]:
    """(pass@1, pass@n, mean response tokens) of the model on rows at temperature 1."""
    prompts = [[tokenizer.bos_token_id] + _encode(tokenizer, r["prompt"]) for r in rows]
    outs = generate(model, prompts, SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens), n=n, seed=seed,
                    eos_token_id=tokenizer.eos_token_id)
    correct = [[math_reward(tokenizer.decode(c.output_ids, skip_special_tokens=True), r["label"], literal_only=True) > 0
                for c in group]
               for r, group in zip(rows, outs)]
    lengths = [len(c.output_ids) for group in outs for c in group]
    return mean_pass_at_k(correct, 1), mean_pass_at_k(correct, n), sum(lengths) / len(lengths)


@contextmanager
def deterministic_torch(threads: int):
    """Fixed thread count and deterministic kernels for the duration; the caller's settings come back after."""
    saved = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(saved[0])
        torch.use_deterministic_algorithms(saved[1])


def bootstrap(out_dir: str | Path, config: BootstrapConfig | None = None, *, log=print) -> dict:
    """Train, evaluate, and write the checkpoint to out_dir (atomically). Returns the summary written beside it."""
    config = config or BootstrapConfig()
    with deterministic_torch(config.threads):
        return _bootstrap(Path(out_dir), config, log)


def _bootstrap(out_dir: Path, config: BootstrapConfig, log) -> dict:
    cfg = tiny_cpu_model_config()
    tokenizer = build_tokenizer()
    n_pairs = (config.operand_high - config.operand_low + 1) ** 2
    train_rows, eval_rows = make_splits(n_pairs - config.n_eval, config.n_eval, config.seed,
                                        low=config.operand_low, high=config.operand_high)
    examples = [([tokenizer.bos_token_id] + _encode(tokenizer, r["prompt"]),
                 _encode(tokenizer, format_answer(r["label"])) + [tokenizer.eos_token_id]) for r in train_rows]

    model = use_native_mhc(build_reference_model(cfg, seed=config.seed).train(), cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    order = random.Random(config.seed)
    history: list[EvalResult] = []
    start = time.monotonic()
    reached: EvalResult | None = None
    next_eval = config.eval_every
    with Progress(TextColumn("bootstrap"), BarColumn(), TextColumn("step {task.completed}/{task.total}"),
                  TextColumn("{task.fields[status]}"), TimeElapsedColumn()) as progress:
        task = progress.add_task("train", total=config.max_steps, status="")
        for step in range(1, config.max_steps + 1):
            batch = order.sample(examples, config.batch_size)
            loss = _train_step(model, optimizer, batch, pad_id=tokenizer.pad_token_id)
            progress.update(task, advance=1, status=f"loss {loss:.3f}")
            if step < next_eval:
                continue
            result = _evaluate_as_stored(model, cfg, tokenizer, eval_rows, config, step)
            history.append(result)
            progress.update(task, status=f"loss {loss:.3f} pass@1 {result.pass1:.3f} pass@8 {result.pass8:.3f}")
            log(f"step {step}: loss {loss:.4f} pass@1 {result.pass1:.3f} pass@8 {result.pass8:.3f}")
            if config.pass1_low <= result.pass1 <= config.pass1_high and result.pass8 <= config.pass8_max:
                reached = result
                break
            near = result.pass1 >= config.near_band
            next_eval = step + (config.eval_every_near_band if near else config.eval_every)
    if reached is None:
        last = history[-1] if history else None
        raise RuntimeError(
            f"bootstrap did not reach pass@1 in [{config.pass1_low}, {config.pass1_high}] with pass@8 <= "
            f"{config.pass8_max} within {config.max_steps} steps (last eval: {last}). Raise max_steps, or widen "
            "the band with --pass1-low/--pass1-high/--pass8-max.")
    summary = {"seed": config.seed, "step": reached.step, "pass@1": reached.pass1, "pass@8": reached.pass8,
               "eval_problems": config.n_eval, "eval_samples": config.eval_samples,
               "history": [asdict(h) for h in history], "config": asdict(config)}
    _write(out_dir, cfg, native_from_reference(model), tokenizer, summary)
    log(f"wrote {out_dir} (step {reached.step}, pass@1 {reached.pass1:.3f}, pass@8 {reached.pass8:.3f}, "
        f"{time.monotonic() - start:.0f}s)")
    return summary


def _train_step(model, optimizer, batch: list[tuple[list[int], list[int]]], *, pad_id: int) -> float:
    length = max(len(p) + len(a) for p, a in batch)
    ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), length), -100, dtype=torch.long)
    for row, (prompt, answer) in enumerate(batch):
        seq = prompt + answer
        ids[row, :len(seq)] = torch.tensor(seq)
        labels[row, len(prompt):len(seq)] = torch.tensor(answer)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=labels).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return float(loss)


def _evaluate_as_stored(model, cfg: ModelConfig, tokenizer, rows, config: BootstrapConfig, step: int) -> EvalResult:
    ours = DeepseekV4(cfg).eval()
    ours.load_state_dict(storage_round_trip(native_from_reference(model), cfg))
    pass1, pass8, mean_len = evaluate_pass_at_k(ours, tokenizer, rows, n=config.eval_samples, seed=config.seed)
    return EvalResult(step, pass1, pass8, mean_len)


def _write(out_dir: Path, cfg: ModelConfig, native: dict, tokenizer, summary: dict) -> None:
    with tempfile.TemporaryDirectory() as tok_dir:
        tokenizer.save_pretrained(tok_dir)
        generation = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
                      "pad_token_id": cfg.pad_token_id, "do_sample": True, "temperature": 1.0}
        save_hf_checkpoint(out_dir, cfg, native, weight_format="fp8", expert_dtype="fp4", scale_fmt="ue8m0",
                           tokenizer_dir=tok_dir, generation_config=generation, overwrite=True)
    # Written last: its presence marks a finished bootstrap (the demo reuses such a directory).
    tmp = out_dir / "bootstrap.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, out_dir / "bootstrap.json")
