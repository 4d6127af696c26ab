"""`v4rl bench train --json OUT`: trainer tokens/s (fwd + bwd, shared prompts) against transformers with padded batches.

One GRPO-like batch, the same for both sides: `n_sequences` samples (`n_samples_per_prompt` per math prompt from
rl.math_task.make_splits, BOS + prompt tokenized with the checkpoint's tokenizer) with responses of 3..24 random
tokens (ids 4..99, seeded), group-normalised advantages of random 0/1 rewards, fixed rollout logprobs for TIS.
Both sides start from the same weights (engines/tiny_base unless `model_dir` names another checkpoint;
transformers' DeepseekV4ForCausalLM via engines.train.hf_model.reference_from_native, one fresh copy each),
run under BF16 autocast with fp32 master weights, and take one full GRPO step per timed run: zero_grad,
forward + backward of every micro-batch, the same loss (rl.grpo.grpo_loss with TIS, aggregated over the
batch as GRPOConfig's default says), gradient clipping and the AdamW step (the optimizer step is on both sides).

  ours          engines.train.trainer.Trainer.grpo_step: each micro-batch forwards its distinct prompts once
                and continues every sample's response from the prompt's cache (expanded per sample), within
                max_tokens_per_gpu (prompts + padded responses); same logprobs and gradients as full sequences
                (tests/test_trainer.py). True packing is impossible with DeepSeek-V4's compressors in
                transformers: they pool across row positions. mHC's Sinkhorn and its gradient run as native
                kernels (engines/train/hf_model.py use_native_mhc; bit-identical results).
  transformers  the usual padded recipe: samples in rollout order, a fixed batch size chosen so that a padded
                batch of the longest sample fills the same token budget, each batch right-padded to its
                longest sample (dynamic padding) with an attention mask, loss masked to the response tokens

tokens/s counts real (non-pad) prompt + response tokens of every sample on both sides (a prompt shared by
8 samples counts 8 times, as the peer computes it 8 times). Runs alternate ours / transformers
`repeats` times after one warm-up step each (the machine may be shared): tok/s best and median of each side,
the speedup is the median of the per-pair ratios. The first step of each side runs on identical weights, so
its loss and gradient norm are reported side by side as a check that both compute the same thing.

    v4rl bench train --json runs/bench/train.json
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

# libgomp's default spin-wait makes a torch process on a loaded CPU machine ~10x slower; both sides run in
# this process and share the setting. It only takes effect if torch is not imported yet.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from bench import load_average, machine_info  # noqa: E402
from engines.model import kernels  # noqa: E402
from engines import TINY_BASE

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = TINY_BASE
N_SEQUENCES, SAMPLES_PER_PROMPT = 256, 8
RESPONSE_LEN = (3, 24)
TOKEN_IDS = (4, 99)
MAX_TOKENS = 2048  # the tiny-cpu launch preset's max_tokens_per_gpu (engines/miles/launch.py)
GOAL = 1.5


def main(json_out: Path, *, model_dir: Path | None = None, n_sequences: int = N_SEQUENCES,
         samples_per_prompt: int = SAMPLES_PER_PROMPT, max_tokens: int = MAX_TOKENS, repeats: int = 3,
         seed: int = 0) -> dict[str, Any]:
    from checkpoints.hf import load_hf_checkpoint
    from engines.train.hf_model import reference_from_native
    from engines.train.trainer import Trainer, TrainerConfig, prefix_batches
    from rl.grpo import GRPOConfig

    json_out = Path(json_out)
    model_dir = Path(model_dir) if model_dir else DEFAULT_MODEL
    machine = machine_info()
    cfg, native = load_hf_checkpoint(model_dir)
    samples = _samples(model_dir, cfg, n_sequences, samples_per_prompt, seed)
    grpo = GRPOConfig()
    tconf = TrainerConfig(max_tokens_per_gpu=max_tokens, compute_dtype="bfloat16")

    def fresh() -> Any:  # reference_from_native assigns the given tensors: clone so the sides share nothing
        return reference_from_native(cfg, {k: v.clone() for k, v in native.items()})

    trainer = Trainer(fresh(), cfg, tconf)
    peer = _PaddedPeer(fresh(), tconf, grpo, samples, max_tokens)
    real_tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)

    ours_perf: list[dict[str, float]] = []

    def ours() -> tuple[float, dict[str, float]]:
        t0 = time.perf_counter()
        m = trainer.grpo_step(samples, grpo)
        ours_perf.append({k: v for k, v in m.items() if k.startswith("perf/")})
        return time.perf_counter() - t0, m

    def theirs() -> tuple[float, dict[str, float]]:
        t0 = time.perf_counter()
        m = peer.step()
        return time.perf_counter() - t0, m

    # warm-up = the first step of each side, on identical weights: also the same-computation check
    _, ours_first = ours()
    _, peer_first = theirs()
    runs = [(ours()[0], theirs()[0]) for _ in range(repeats)]

    ours_tps = [real_tokens / o for o, _ in runs]
    peer_tps = [real_tokens / h for _, h in runs]
    speedup = statistics.median(h / o for o, h in runs)
    micro = prefix_batches([(s.prompt_ids, s.response_ids) for s in samples], max_tokens)
    ours_forwarded = ours_perf[-1]["perf/train_forwarded_tokens"]  # the trainer's own count of its forwards
    result: dict[str, Any] = {
        "machine": machine, "model": str(model_dir), "dtype": "bfloat16 autocast, fp32 master weights, AdamW",
        "step": "zero_grad + fwd + bwd of every micro-batch + grad clip + AdamW step (both sides)",
        "data": {"n_sequences": n_sequences, "samples_per_prompt": samples_per_prompt,
                 "prompt_tokens": sorted({len(s.prompt_ids) for s in samples}),
                 "response_tokens": list(RESPONSE_LEN), "real_tokens": real_tokens,
                 "response_tokens_total": sum(len(s.response_ids) for s in samples), "seed": seed},
        "max_tokens_per_gpu": max_tokens, "repeats": repeats,
        "ours": {"tok_s_best": max(ours_tps), "tok_s_median": statistics.median(ours_tps),
                 "micro_batches": len(micro), "forwarded_tokens": ours_forwarded,
                 "forwarded_per_real_token": ours_forwarded / real_tokens,
                 "mean_micro_batch_tokens": ours_forwarded / len(micro),
                 "threads": ours_perf[-1]["perf/train_threads"],
                 "trainer_tok_s_median": statistics.median(p["perf/train_tokens_per_s"] for p in ours_perf[1:]),
                 "with_rollout_routes": True},
        "transformers": {"tok_s_best": max(peer_tps), "tok_s_median": statistics.median(peer_tps),
                         "batch_size": peer.batch_size, "micro_batches": len(peer.batches),
                         "padded_tokens": peer.padded_tokens,
                         "padding_fraction": 1 - real_tokens / peer.padded_tokens,
                         "mean_micro_batch_tokens": peer.padded_tokens / len(peer.batches)},
        "speedup": speedup,
        "speedup_best_vs_best": max(ours_tps) / max(peer_tps),
        "runs_s": [{"ours": o, "transformers": h} for o, h in runs],
        "first_step_check": {
            "ours": {"pg_loss": ours_first["train/pg_loss"], "grad_norm": ours_first["train/grad_norm"]},
            "transformers": {"pg_loss": peer_first["pg_loss"], "grad_norm": peer_first["grad_norm"]},
            "note": "same weights, same samples, same loss: equal up to BF16 rounding of different batch shapes"},
        "note": "tok/s = real (non-pad) prompt + response tokens / step seconds; speedup = median over "
                "interleaved (ours, transformers) run pairs; both sides in one process, same thread count",
    }
    result["machine"]["load_avg_1m_at_end"] = load_average()
    result["native_kernels"] = kernels.status()
    result["goals"] = {"tokens_per_s_vs_transformers_padded": {"goal": f">= {GOAL}x", "value": speedup,
                                                                "met": speedup >= GOAL}}
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(result, indent=1) + "\n")
    _print_summary(result, json_out)
    return result


# ---------------------------------------------------------------------------------------------- data
def _samples(model_dir: Path, cfg: Any, n: int, per_prompt: int, seed: int) -> list:
    from transformers import AutoTokenizer

    from engines.train.trainer import Sample
    from rl.grpo import group_advantages
    from rl.math_task import make_splits

    if n % per_prompt:
        raise ValueError(f"n_sequences ({n}) must be a multiple of samples_per_prompt ({per_prompt})")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rows, _ = make_splits(n // per_prompt, 0, seed)
    prompts = [[tok.bos_token_id] + tok(r["prompt"], add_special_tokens=False).input_ids for r in rows]
    rng = random.Random(seed)
    rewards = torch.tensor([[float(rng.random() < 0.5) for _ in range(per_prompt)] for _ in prompts])
    adv = group_advantages(rewards)
    out = []
    for g, prompt in enumerate(prompts):
        for j in range(per_prompt):
            resp = [rng.randint(*TOKEN_IDS) for _ in range(rng.randint(*RESPONSE_LEN))]
            rollout_lp = [-4.5 + 0.5 * rng.random() for _ in resp]  # ~ uniform over 128 ids, jittered
            # the rollout's routed experts, as `v4rl train`'s rollout always returns them: the trainer logs
            # train/router_mismatch_frac from them, so the timed step is the run's step
            routes = torch.randint(0, cfg.n_routed_experts, (len(prompt) + len(resp) - 1, cfg.num_hidden_layers,
                                                             cfg.num_experts_per_tok), dtype=torch.int32)
            out.append(Sample(list(prompt), resp, rollout_lp, float(rewards[g, j]), g, advantage=float(adv[g, j]),
                              routed_experts=routes))
    return out


# ---------------------------------------------------------------------------------------------- the padded peer
class _PaddedPeer:
    """The usual transformers fine-tuning loop: fixed batch size, right padding to each batch's longest sample."""

    def __init__(self, model: Any, tconf: Any, grpo: Any, samples: list, max_tokens: int) -> None:
        from rl.grpo import step_denominator

        self.model = model.float().train()
        self.grpo = grpo
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=tconf.lr, betas=tconf.betas,
                                           weight_decay=tconf.weight_decay)
        longest = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        self.batch_size = max(1, max_tokens // longest)
        pad = int(model.config.pad_token_id if model.config.pad_token_id is not None else 0)
        self.denominator = step_denominator(grpo.loss_aggregation, [len(s.response_ids) for s in samples])
        self.batches = [self._collate(samples[i:i + self.batch_size], pad)
                        for i in range(0, len(samples), self.batch_size)]
        self.padded_tokens = sum(b["input_ids"].numel() for b in self.batches)

    @staticmethod
    def _collate(chunk: list, pad: int) -> dict[str, torch.Tensor]:
        width = max(len(s.prompt_ids) + len(s.response_ids) for s in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        attn = torch.zeros((len(chunk), width), dtype=torch.long)
        # response mask and rollout logprobs aligned with the shifted targets ids[:, 1:]
        resp = torch.zeros((len(chunk), width - 1), dtype=torch.bool)
        rollout = torch.zeros((len(chunk), width - 1))
        for b, s in enumerate(chunk):
            p, r = len(s.prompt_ids), len(s.response_ids)
            ids[b, :p + r] = torch.tensor(s.prompt_ids + s.response_ids)
            attn[b, :p + r] = 1
            resp[b, p - 1:p - 1 + r] = True
            rollout[b, p - 1:p - 1 + r] = torch.tensor(s.rollout_logprobs)
        return {"input_ids": ids, "attention_mask": attn, "mask": resp, "rollout_lp": rollout,
                "advantages": torch.tensor([s.advantage for s in chunk])}

    def step(self) -> dict[str, float]:
        from rl.grpo import grpo_loss

        g = self.grpo
        self.optimizer.zero_grad(set_to_none=True)
        pg_loss = 0.0
        for batch in self.batches:
            ids = batch["input_ids"]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = self.model(input_ids=ids, attention_mask=batch["attention_mask"]).logits[:, :-1].float()
            logp = torch.log_softmax(logits, dim=-1)
            lp = logp.gather(-1, ids[:, 1:, None])[..., 0]
            loss, m, _ = grpo_loss(lp, lp.detach(), batch["rollout_lp"], batch["advantages"], batch["mask"], g,
                                   denominator=self.denominator)
            loss.backward()
            pg_loss += m["pg_loss"]
        clip = g.max_grad_norm if g.max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.optimizer.step()
        return {"pg_loss": pg_loss, "grad_norm": float(grad_norm)}


# ---------------------------------------------------------------------------------------------- machine
def _print_summary(r: dict[str, Any], json_out: Path) -> None:
    o, t, d = r["ours"], r["transformers"], r["data"]
    print(f"train step ({d['n_sequences']} sequences, {d['real_tokens']} real tokens, budget "
          f"{r['max_tokens_per_gpu']} tokens/micro-batch, BF16 autocast, fwd+bwd+AdamW):")
    print(f"  ours shared prompts {o['tok_s_best']:.0f} tok/s best, {o['tok_s_median']:.0f} median "
          f"({o['micro_batches']} micro-batches forwarding {o['forwarded_per_real_token']:.2f} tokens per real token)")
    print(f"  transformers padded {t['tok_s_best']:.0f} tok/s best, {t['tok_s_median']:.0f} median "
          f"({t['micro_batches']} batches of {t['batch_size']}, {t['padding_fraction']:.0%} padding)")
    print(f"  speedup {r['speedup']:.2f}x (median of pairs; goal >= {GOAL}x: "
          f"{'met' if r['goals']['tokens_per_s_vs_transformers_padded']['met'] else 'NOT met'})")
    c = r["first_step_check"]
    print(f"  first step: pg_loss {c['ours']['pg_loss']:.5f} vs {c['transformers']['pg_loss']:.5f}, grad_norm "
          f"{c['ours']['grad_norm']:.4f} vs {c['transformers']['grad_norm']:.4f}")
    print(f"wrote {json_out}")
