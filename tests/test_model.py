"""Our DeepSeek-V4 against transformers' DeepseekV4ForCausalLM on the same fp32 weights, and our cached
decode against our own full-sequence scoring.

Pins: every layer type (sliding, CSA with the lightning indexer, HCA), hash and top-k MoE, mHC, sinks,
grouped output projection, sequences longer than the window so compressed entries matter, and ragged
shapes (sequence lengths that are not multiples of the compression rates). Tolerance: 1e-4 max abs on
logprobs (measured: ~1e-6). Each test runs our model on the torch ops and through the fused native kernels
(`fused` ids: the rollout engine's path), both held to the same bounds.

One documented difference: when indexer scores tie exactly at the top-k boundary (ReLU can zero every
head for several entries), we keep the earlier entry, while torch.topk's choice depends on the row
length. The configs here use 8 indexer heads, where exact ties are rare; `test_indexer_ties_*` pins our
rule with forced ties.

    .venv/bin/python -m pytest tests/test_model.py -q
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from engines.model import DecodeBatch, DeepseekV4, ModelConfig, kernels
from engines.model.config import CSA, HASH_MOE, HCA, SLIDING, TOPK_MOE
from engines.model.params import native_param_specs
from engines.train.hf_model import build_reference_model, native_from_reference

TOL = 1e-4
needs_compiler = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")


def _config(**overrides) -> ModelConfig:
    base = dict(vocab_size=61, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, head_dim=32,
                q_lora_rank=32, partial_rotary_factor=0.25, layer_types=[SLIDING, CSA, HCA, CSA],
                mlp_layer_types=[HASH_MOE, TOPK_MOE, TOPK_MOE, TOPK_MOE],
                compress_rates={CSA: 4, HCA: 8}, sliding_window=8, o_groups=2, o_lora_rank=16,
                index_n_heads=8, index_head_dim=16, index_topk=3, n_routed_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=32, hc_mult=4)
    base.update(overrides)
    return ModelConfig(**base)


CONFIGS = {
    "mixed": _config(),
    "hca-first-hash-heavy": _config(layer_types=[HCA, CSA, SLIDING], num_hidden_layers=3,
                                    mlp_layer_types=[HASH_MOE, HASH_MOE, TOPK_MOE], compress_rates={CSA: 4, HCA: 4},
                                    sliding_window=5, index_topk=2, hc_mult=2, num_experts_per_tok=1),
    "ragged": _config(hidden_size=48, num_attention_heads=3, head_dim=24, partial_rotary_factor=1 / 3,
                      q_lora_rank=40, o_groups=3, o_lora_rank=12, compress_rates={CSA: 3, HCA: 5},
                      sliding_window=7, index_topk=5, n_routed_experts=5, num_experts_per_tok=3,
                      moe_intermediate_size=20, hc_mult=3, vocab_size=37,
                      layer_types=[CSA, SLIDING, HCA, CSA]),
}


def _pair(cfg: ModelConfig, seed: int, fused: bool = False):
    reference = build_reference_model(cfg, seed=seed).eval()
    native = native_from_reference(reference)
    assert set(native) == set(native_param_specs(cfg))
    ours = DeepseekV4(cfg).eval()
    ours.load_state_dict(native)
    ours.fused_kernels = fused
    if fused:
        assert ours.fused.usable(), kernels.status()
    return reference, ours


# Our model on the torch ops, and through the fused native kernels (engines/model/fused_model.py) as the rollout
# engine runs it: both must meet the same bounds.
PATHS = [pytest.param(False, id="torch"), pytest.param(True, id="fused", marks=needs_compiler)]


@pytest.mark.parametrize("fused", PATHS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_full_sequence_matches_transformers(name, fused):
    cfg = CONFIGS[name]
    reference, ours = _pair(cfg, seed=1, fused=fused)
    ids = torch.randint(0, cfg.vocab_size, (3, 29), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = reference(input_ids=ids).logits.log_softmax(-1)
        got = ours(ids).log_softmax(-1)
    assert (want - got).abs().max().item() < TOL


@pytest.mark.parametrize("fused", PATHS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cached_decode_matches_full_sequence(name, fused):
    cfg = CONFIGS[name]
    _, ours = _pair(cfg, seed=3, fused=fused)
    ids = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(4))
    prefix = 6
    with torch.no_grad():
        full = ours(ids).log_softmax(-1)
        logits, caches = ours.prefill(ids[:, :prefix])
        batch = DecodeBatch.from_caches(cfg, caches)
        steps = [ours.decode(ids[:, t], batch) for t in range(prefix, ids.shape[1])]
    assert (logits.log_softmax(-1) - full[:, :prefix]).abs().max().item() < TOL
    decoded = torch.stack(steps, dim=1).log_softmax(-1)
    assert (decoded - full[:, prefix:]).abs().max().item() < TOL


@pytest.mark.parametrize("fused", PATHS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_rows_at_different_positions_share_a_decode_batch(name, fused):
    """Continuous batching: rows join at other positions, finish early, and each still equals full scoring."""
    cfg = CONFIGS[name]
    _, ours = _pair(cfg, seed=11, fused=fused)
    ids = torch.randint(0, cfg.vocab_size, (3, 40), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        full = ours(ids).log_softmax(-1)
        _, first = ours.prefill(ids[:1, :3])
        batch = DecodeBatch.from_caches(cfg, first)
        got = {0: {}, 1: {}, 2: {}}
        rows = [0]
        for step in range(34):
            if step == 5:  # row 1 joins with a 17-token prefill (its entries outnumber row 0's)
                _, joined = ours.prefill(ids[1:2, :17])
                batch.extend(DecodeBatch.from_caches(cfg, joined))
                rows.append(1)
            if step == 9:  # row 2 joins at position 2
                _, joined = ours.prefill(ids[2:3, :2])
                batch.extend(DecodeBatch.from_caches(cfg, joined))
                rows.append(2)
            if step == 20:  # row 1 finishes
                batch.select([i for i, r in enumerate(rows) if r != 1])
                rows.remove(1)
            positions = batch.positions.tolist()
            logits = ours.decode(torch.stack([ids[r, p] for r, p in zip(rows, positions)]), batch).log_softmax(-1)
            for i, (r, p) in enumerate(zip(rows, positions)):
                got[r][p] = logits[i]
    for r, steps in got.items():
        assert len(steps) >= 10
        for p, logp in steps.items():
            assert (logp - full[r, p]).abs().max().item() < TOL, (r, p)


@pytest.mark.parametrize("fused", PATHS)
def test_extend_aligns_entry_capacities(fused):
    """A batch whose entry buffers have grown takes rows with smaller ones (and the reverse)."""
    cfg = CONFIGS["mixed"]
    _, ours = _pair(cfg, seed=13, fused=fused)
    ids = torch.randint(0, cfg.vocab_size, (2, 30), generator=torch.Generator().manual_seed(14))
    with torch.no_grad():
        full = ours(ids).log_softmax(-1)
        _, (a,) = ours.prefill(ids[:1, :5])
        _, (b,) = ours.prefill(ids[1:, :21])
        batch, other = DecodeBatch.from_caches(cfg, [a]), DecodeBatch.from_caches(cfg, [b])
        for mine, theirs in zip(batch.layers, other.layers):  # ours just above theirs: no doubling may follow
            for slots, their_slots in ((mine.compressor, theirs.compressor), (mine.indexer, theirs.indexer)):
                if slots is not None:
                    slots.pad_entries(their_slots.entries.shape[1] + 1)
        batch.extend(other)
        got = ours.decode(torch.stack([ids[0, 5], ids[1, 21]]), batch).log_softmax(-1)
    assert (got[0] - full[0, 5]).abs().max() < TOL and (got[1] - full[1, 21]).abs().max() < TOL


@pytest.mark.parametrize("fused", PATHS)
def test_forked_caches_decode_independently(fused):
    """Two samples forked from one prefill must not leak state into each other (n samples per prompt)."""
    cfg = CONFIGS["mixed"]
    _, ours = _pair(cfg, seed=5, fused=fused)
    ids = torch.randint(0, cfg.vocab_size, (1, 30), generator=torch.Generator().manual_seed(6))
    other = ids.clone()
    other[0, 7:] = (other[0, 7:] + 1) % cfg.vocab_size
    with torch.no_grad():
        _, (cache,) = ours.prefill(ids[:, :7])
        batch = DecodeBatch.from_caches(cfg, [cache, cache])
        for t in range(7, 30):
            a, b = ours.decode(torch.stack([ids[0, t], other[0, t]]), batch).unsqueeze(1)
        again = DecodeBatch.from_caches(cfg, [cache])  # the prefill's cache itself was never written to
        for t in range(7, 30):
            alone = ours.decode(ids[:, t], again)
        want_a = ours(ids)[:, -1]
        want_b = ours(other)[:, -1]
    assert (a.log_softmax(-1) - want_a.log_softmax(-1)).abs().max() < TOL
    assert (b.log_softmax(-1) - want_b.log_softmax(-1)).abs().max() < TOL
    assert (alone.log_softmax(-1) - want_a.log_softmax(-1)).abs().max() < TOL


@pytest.mark.parametrize("fused", PATHS)
def test_right_padding_does_not_change_valid_positions(fused):
    cfg = CONFIGS["mixed"]
    _, ours = _pair(cfg, seed=7, fused=fused)
    ids = torch.randint(0, cfg.vocab_size, (1, 21), generator=torch.Generator().manual_seed(8))
    padded = torch.cat([ids, torch.zeros(1, 11, dtype=torch.long)], dim=1)
    with torch.no_grad():
        assert (ours(ids) - ours(padded)[:, :21]).abs().max() < TOL


@pytest.mark.parametrize("fused", PATHS)
def test_indexer_ties_break_toward_earlier_entries_in_decode_and_full(fused):
    """All indexer scores 0 (zero query projection): every query keeps its earliest entries, both paths."""
    cfg = CONFIGS["mixed"]
    _, ours = _pair(cfg, seed=9, fused=fused)
    with torch.no_grad():
        for layer in ours.layers:
            if layer.attn.indexer is not None:
                layer.attn.indexer.wq_b.weight.zero_()
        ids = torch.randint(0, cfg.vocab_size, (1, 31), generator=torch.Generator().manual_seed(10))
        full = ours(ids).log_softmax(-1)
        _, caches = ours.prefill(ids[:, :5])
        batch = DecodeBatch.from_caches(cfg, caches)
        steps = [ours.decode(ids[:, t], batch) for t in range(5, 31)]
        scores = torch.zeros(1, 1, 6)
        chosen = ours.layers[1].attn.indexer.select(scores, torch.tensor([[30]]))
    assert chosen[0, 0].tolist() == [True] * cfg.index_topk + [False] * (6 - cfg.index_topk)
    assert (torch.stack(steps, 1).log_softmax(-1) - full[:, 5:]).abs().max() < TOL
