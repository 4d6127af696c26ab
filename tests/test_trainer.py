"""The embedded trainer (transformers' DeepseekV4ForCausalLM + AdamW): its logprobs agree with our engine on
the same weights, a GRPO step changes the weights and reports finite Miles-named metrics, and micro-batches
never pad or exceed the token budget.

    .venv/bin/python -m pytest tests/test_trainer.py -q
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from checkpoints.hf import load_hf_checkpoint
from engines.model import DeepseekV4
from engines.align.score import token_logprobs
from engines.train.trainer import Sample, Trainer, TrainerConfig, micro_batches, prefix_batches
from rl.grpo import GRPOConfig, group_advantages


def _trainer(ckpt, **kw) -> tuple[Trainer, DeepseekV4]:
    cfg, state = load_hf_checkpoint(ckpt)
    ours = DeepseekV4(cfg).eval()
    ours.load_state_dict(state)
    return Trainer.from_native(cfg, state, TrainerConfig(**kw)), ours


def _seqs(n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    return [([0] + [rng.randrange(4, 100) for _ in range(30)], [rng.randrange(4, 100) for _ in range(rng.randrange(3, 7))])
            for _ in range(n)]


def test_micro_batches_cover_everything_within_budget_with_little_padding():
    lengths = [random.Random(0).randrange(30, 55) for _ in range(300)]
    batches = micro_batches(lengths, max_tokens=500)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    assert all(len(b) * max(lengths[i] for i in b) <= 500 for b in batches)
    assert padded / sum(lengths) < 1.05  # sorted neighbours share a batch: < 5% padding


def _groups(seed: int) -> list[tuple[list[int], list[int]]]:
    """GRPO-shaped: 3 prompts (lengths 29, 29, 31) x 4 samples with responses of 1-6 tokens."""
    rng = random.Random(seed)
    prompts = [[0] + [rng.randrange(4, 100) for _ in range(n)] for n in (28, 28, 30)]
    return [(p, [rng.randrange(4, 100) for _ in range(rng.choice([1, 2, 5, 6]))]) for p in prompts for _ in range(4)]


def test_prefix_batches_cover_each_sample_once_within_budget():
    seqs = _groups(seed=4) + _seqs(5, seed=5)
    for budget in (40, 90, 10_000):
        batches = prefix_batches(seqs, budget)
        rows = [i for b in batches for members in b.members for i in members]
        assert sorted(rows) == list(range(len(seqs)))
        for b in batches:
            assert len({len(p) for p in b.prompts}) == 1 and len(set(b.prompts)) == len(b.prompts)
            assert all(tuple(seqs[i][0]) == p for p, members in zip(b.prompts, b.members) for i in members)
            longest = max(len(seqs[i][1]) for members in b.members for i in members)
            size = len(b.prompts) * len(b.prompts[0]) + sum(map(len, b.members)) * longest
            assert size <= budget or (len(b.prompts) == 1 and len(b.members[0]) == 1)
    assert len(prefix_batches(_groups(seed=4), 10_000)) == 2  # one per prompt length


def test_shared_prompt_prefix_gives_the_same_logprobs_and_update(tiny_checkpoint):
    """Prompts forwarded once per micro-batch (cache expanded per sample) vs every sample as a full sequence."""
    seqs = _groups(seed=6)
    results = {}
    for shared in (True, False):
        trainer, _ = _trainer(tiny_checkpoint, lr=1e-3, compute_dtype="float32", max_tokens_per_gpu=90,
                              share_prompt_prefix=shared)
        assert trainer.shares_prefix is shared
        lp = trainer.logprobs(seqs)
        samples = [Sample(p, r, [x - 0.01 for x in lps], float(i % 2), i // 4, advantage=1.0 if i % 2 else -1.0)
                   for i, ((p, r), lps) in enumerate(zip(seqs, lp))]
        metrics = trainer.grpo_step(samples, GRPOConfig())
        results[shared] = (lp, metrics, {k: p.grad.clone() for k, p in trainer.model.named_parameters()
                                         if p.grad is not None})
    (lp_a, m_a, g_a), (lp_b, m_b, g_b) = results[True], results[False]
    assert [len(x) for x in lp_a] == [len(r) for _, r in seqs]
    assert max(abs(a - b) for x, y in zip(lp_a, lp_b) for a, b in zip(x, y)) < 1e-5
    for key in ("train/pg_loss", "train/entropy", "train/grad_norm"):
        assert abs(m_a[key] - m_b[key]) <= 1e-4 * max(1.0, abs(m_b[key])), key
    assert g_a.keys() == g_b.keys() and any("experts" in k for k in g_a)
    # Each tensor against its largest entry, floored at 1e-3 of the largest gradient entry of all: a tensor whose
    # gradient is ~1e-6 of the rest (tiny-cpu's hc_head scale) differs there by fp32 summation order only.
    floor = 1e-3 * max(g.abs().max().item() for g in g_b.values())
    worst = max(((g_a[k] - g_b[k]).abs().max() / g_b[k].abs().max().clamp_min(floor)).item() for k in g_a)
    assert worst < 1e-4, f"gradients differ by {worst:.2e} of their largest entry"


def test_trainer_logprobs_match_our_engine_in_fp32(tiny_checkpoint):
    trainer, ours = _trainer(tiny_checkpoint, compute_dtype="float32", max_tokens_per_gpu=100)
    seqs = _seqs(6, seed=0)
    got = trainer.logprobs(seqs)
    want = token_logprobs(ours, [{"prompt_ids": p, "response_ids": r} for p, r in seqs], vocab_size=ours.cfg.vocab_size)
    assert max(abs(a - b) for x, y in zip(got, want) for a, b in zip(x, y)) < 1e-4


def test_grpo_step_changes_weights_and_reports_finite_metrics(tiny_checkpoint):
    trainer, ours = _trainer(tiny_checkpoint, lr=1e-3, max_tokens_per_gpu=128)
    seqs = _seqs(8, seed=1)
    rollout_lp = token_logprobs(ours, [{"prompt_ids": p, "response_ids": r} for p, r in seqs],
                                vocab_size=ours.cfg.vocab_size)
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0]])
    adv = group_advantages(rewards).flatten().tolist()
    samples = [Sample(p, r, lp, float(rw), g // 4, advantage=a)
               for g, ((p, r), lp, rw, a) in enumerate(zip(seqs, rollout_lp, rewards.flatten(), adv))]
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    metrics = trainer.grpo_step(samples, GRPOConfig())
    changed = [k for k, v in trainer.model.state_dict().items() if not torch.equal(v, before[k])]
    assert any("experts" in k for k in changed) and any("self_attn" in k for k in changed)
    for name in ("train/pg_loss", "train/pg_clipfrac", "train/entropy", "train/grad_norm", "train/tis",
                 "train/tis_clipfrac", "train/train_rollout_logprob_abs_diff"):
        assert math.isfinite(metrics[name]), name
    # bf16 trainer vs fp32 rollout scoring of the same weights: a small but non-zero gap
    assert 0 < metrics["train/train_rollout_logprob_abs_diff"] < 0.1
    assert trainer.step == 1


def test_grpo_step_applies_the_chosen_rollout_correction(tiny_checkpoint):
    """IcePop on rollout logprobs of 0 (ratio = the trainer's probability, far below 0.5) zeroes every token, over
    several micro-batches: no policy loss, every token and sequence counted as masked."""
    trainer, _ = _trainer(tiny_checkpoint, lr=1e-3, max_tokens_per_gpu=128)
    samples = [Sample(p, r, [0.0] * len(r), 1.0, i // 4, advantage=1.0 if i % 2 else -1.0)
               for i, (p, r) in enumerate(_seqs(8, seed=2))]
    metrics = trainer.grpo_step(samples, GRPOConfig(rollout_correction="icepop"))
    assert metrics["train/pg_loss"] == 0.0
    assert metrics["train/correction_masked_token_frac"] == pytest.approx(1.0)
    assert metrics["train/correction_masked_seq_frac"] == pytest.approx(1.0)
    assert metrics["train/tis_clipfrac"] == pytest.approx(1.0) and metrics["train/train_rollout_kl"] > 0


def test_quantization_aware_trainer_scores_exactly_what_the_rollout_will_serve(tiny_base):
    """After a step, the trainer's logprobs (fp32 compute) equal our engine's on the re-quantized export;
    without the quantization-aware forward the gap is the whole rounded-away update."""
    from engines.train.storage import storage_round_trip

    cfg, state = load_hf_checkpoint(tiny_base)
    seqs = _seqs(8, seed=3)
    gaps = {}
    for qat in (True, False):
        trainer = Trainer.from_native(cfg, {k: v.clone() for k, v in state.items()},
                                      TrainerConfig(lr=1e-4, compute_dtype="float32", quantization_aware=qat))
        samples = [Sample(p, r, [0.0] * len(r), 1.0, i // 4, advantage=1.0 if i % 2 else -1.0)
                   for i, (p, r) in enumerate(seqs)]
        trainer.grpo_step(samples, GRPOConfig(rollout_correction="none"))
        served = DeepseekV4(cfg).eval()
        served.load_state_dict(storage_round_trip(trainer.native_state(), cfg, expert_dtype="fp8"))
        want = token_logprobs(served, [{"prompt_ids": p, "response_ids": r} for p, r in seqs], vocab_size=cfg.vocab_size)
        got = trainer.logprobs(seqs)
        gaps[qat] = max(abs(a - b) for x, y in zip(got, want) for a, b in zip(x, y))
    assert gaps[True] < 1e-4 and gaps[False] > 100 * gaps[True], gaps


def test_trainer_computes_on_every_core_unless_told(tiny_checkpoint):
    """Ray gives a 1-CPU actor OMP_NUM_THREADS=1; the trainer computes on every core (rollout and training take
    turns) and gives the process its setting back after each call."""
    import os

    import pytest

    cfg, native = load_hf_checkpoint(tiny_checkpoint)
    seqs = _seqs(4, seed=2)
    before = torch.get_num_threads()
    try:
        for threads, expected in ((None, os.cpu_count()), (1, 1)):
            torch.set_num_threads(1)
            trainer = Trainer.from_native(cfg, native, TrainerConfig(threads=threads))
            seen = []
            trainer.model.register_forward_pre_hook(lambda module, args: seen.append(torch.get_num_threads()))
            trainer.logprobs(seqs)
            assert seen and set(seen) == {expected}
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="threads"):
        TrainerConfig(threads=0)
