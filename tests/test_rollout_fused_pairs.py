"""Distributed weight-update buckets never split one of SGLang's fused pairs (engines/rollout/fused_pairs.py).

SGLang's DeepSeek-V4 `load_weights` runs once per `/update_weights_from_distributed` bucket and asserts its
fused-pair caches (compressor wkv+wgate; attention wq_a+wkv weight and scale) are empty at the end of each call
(conformance C9). Here every tensor of engines/tiny_base, under the names a push sends, goes through the
grouping with buckets so small that a plain byte packer splits every pair; the table is also held against the
pinned SGLang's own source (skipped when that source is absent). About 5 s.

    .venv/bin/python -m pytest tests/test_rollout_fused_pairs.py -q
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from checkpoints.hf import read_config
from engines.model.params import native_param_specs
from engines.rollout.fused_pairs import FUSED_PAIRS, SplitPairError, fused_parameter, update_buckets
from engines.rollout.launcher import DistributedWeightSync, init_weight_sync_group, sglang_named_tensors
from engines import TINY_BASE



def _tiny_base_push() -> list[tuple[str, torch.Tensor]]:
    """Every stored tensor of tiny-base in the order a trainer encodes them (weight, then its scale), SGLang names."""
    cfg, _ = read_config(TINY_BASE)
    index = json.loads((TINY_BASE / "model.safetensors.index.json").read_text())["weight_map"]
    stored: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index.values())):
        stored.update(load_file(TINY_BASE / shard))
    encoded = []
    for name in native_param_specs(cfg):
        encoded.append((name, stored.pop(name)))
        scale = name.removesuffix(".weight") + ".scale"
        if scale in stored:
            encoded.append((scale, stored.pop(scale)))
    assert not stored, sorted(stored)[:3]
    return list(sglang_named_tensors(encoded))


@pytest.fixture(scope="module")
def push() -> list[tuple[str, torch.Tensor]]:
    return _tiny_base_push()


def _pairs_in(named) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, _ in named:
        hit = fused_parameter(name)
        if hit:
            out.setdefault(hit[0], []).append(name)
    return out


@pytest.mark.parametrize("order", ["encoded", "reversed", "by_name"])
def test_one_byte_buckets_keep_every_pair_together(push, order):
    named = {"encoded": push, "reversed": push[::-1], "by_name": sorted(push, key=lambda x: x[0])}[order]
    pairs = _pairs_in(named)
    cfg, _ = read_config(TINY_BASE)
    compressors = sum(n.endswith(".compressor.wkv.weight") for n, _ in named)  # CSA: attention + indexer; HCA
    assert compressors == sum(n.endswith(".compressor.wgate.weight") for n, _ in named) > 0
    # + per layer: wq_a/wkv weight, their scales, and wo_a weight + scale (SGLANG_OPT_FP8_WO_A_GEMM=0's pre-pass)
    assert len(pairs) == compressors + 3 * cfg.num_hidden_layers
    assert all(len(halves) == 2 for halves in pairs.values())
    # a plain byte packer (no pairs) splits every one of them at this size: the test would notice a regression
    assert all(len(b) == 1 for b in update_buckets(named, 1, pairs=()))

    buckets = list(update_buckets(named, 1))
    sent = [(n, t) for b in buckets for n, t in b]
    assert sorted(n for n, _ in sent) == sorted(n for n, _ in named)
    by_name = dict(named)
    assert all(t is by_name[n] for n, t in sent)  # the same tensors, untouched
    for bucket in buckets:
        fused = {fused_parameter(n)[0] if fused_parameter(n) else None for n, _ in bucket}
        if len(bucket) == 2:
            assert len(fused) == 1 and None not in fused, [n for n, _ in bucket]
        else:
            assert len(bucket) == 1 and fused == {None}, [n for n, _ in bucket]
    assert sum(len(b) == 2 for b in buckets) == len(pairs)


def test_byte_budget_still_applies_to_whole_pairs(push):
    budget = 64 * 1024
    for bucket in update_buckets(push, budget):
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= budget or len(bucket) <= 2  # only a single tensor or one pair may exceed the budget
        for halves in _pairs_in(bucket).values():
            assert len(halves) == 2


def test_the_table_reads_sglang_names():
    assert fused_parameter("model.layers.3.self_attn.compressor.wkv.weight") == (
        "model.layers.3.self_attn.compressor.wkv_gate.weight", 0)
    assert fused_parameter("model.layers.3.self_attn.indexer.compressor.wgate.weight") == (
        "model.layers.3.self_attn.indexer.compressor.wkv_gate.weight", 1)
    assert fused_parameter("model.layers.0.self_attn.wkv.weight_scale_inv") == (
        "model.layers.0.self_attn.wqkv_a.weight_scale_inv", 1)
    assert fused_parameter("model.layers.2.self_attn.wo_a.scale") == ("model.layers.2.self_attn.wo_a.weight", 1)
    for alone in ("model.layers.0.self_attn.wq_b.weight", "model.layers.0.self_attn.indexer.wq_b.weight",
                  "model.layers.1.self_attn.compressor.ape", "model.layers.0.mlp.experts.0.gate_proj.weight"):
        assert fused_parameter(alone) is None, alone


def test_wo_a_scale_travels_under_the_name_sglangs_dequant_pass_pairs(push):
    """With SGLANG_OPT_FP8_WO_A_GEMM=0 SGLang pairs `.wo_a.weight` with `.wo_a.scale` only (its remap turns that
    name into `.wo_a.weight_scale_inv` for the default path): the push must not send `weight_scale_inv` for wo_a."""
    names = {n for n, _ in push}
    assert {f"model.layers.{i}.self_attn.wo_a.scale" for i in range(4)} <= names
    assert not any(n.endswith(".wo_a.weight_scale_inv") for n in names)
    assert "model.layers.0.self_attn.wo_b.weight_scale_inv" in names  # every other scale keeps SGLang's name


def test_a_missing_or_repeated_half_is_refused_before_anything_is_sent(push):
    without = [(n, t) for n, t in push if n != "model.layers.1.self_attn.compressor.wgate.weight"]
    with pytest.raises(SplitPairError, match=r"compressor\.wkv\.weight has no partner "
                                             r"model\.layers\.1\.self_attn\.compressor\.wgate\.weight.*"
                                             r"cache_compressor_weight"):
        list(update_buckets(without, 1 << 30))
    wq_a = next(x for x in push if x[0] == "model.layers.0.self_attn.wq_a.weight")
    with pytest.raises(SplitPairError, match="arrives twice"):
        list(update_buckets([wq_a, wq_a], 1 << 30))


class _Recorder:
    """The control calls of a weight push, with each bucket's names (what SGLang loads per load_weights call)."""

    base_url = "http://recorder"

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.bucket_names: list[list[str]] = []

    def server_info(self):
        return {"dp_size": 1}

    def update_weights_from_distributed(self, **kwargs):
        self.calls.append("update_weights_from_distributed")
        self.bucket_names.append(list(kwargs["names"]))
        return {"success": True}

    def __getattr__(self, method):
        return lambda *a, **k: self.calls.append(method) or {"success": True}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_distributed_push_announces_pairs_in_one_bucket(push):
    import torch.distributed as dist

    engine = _Recorder()
    sync = DistributedWeightSync([engine], master_address="127.0.0.1", master_port=1, engine_world_sizes=[1],
                                 backend="gloo")
    sync.group = init_weight_sync_group(backend="gloo", master_address="127.0.0.1", master_port=_free_port(),
                                        world_size=1, rank=0, group_name="fused-pairs", timeout_s=30)
    try:
        assert sync.push(push, bucket_bytes=1) == len(push) - len(_pairs_in(push))
        for names in engine.bucket_names:
            assert all(len(h) == 2 for h in _pairs_in([(n, None) for n in names]).values()), names
        engine.calls.clear()
        broken = [(n, t) for n, t in push if not n.endswith(".self_attn.wkv.weight_scale_inv")]
        with pytest.raises(SplitPairError, match="wq_a.weight_scale_inv has no partner"):
            sync.push(broken, bucket_bytes=1)
        assert engine.calls == []  # refused before pausing: the engines were never touched
    finally:
        dist.destroy_process_group(sync.group)
        sync._pool.shutdown()


def test_table_names_every_cache_sglang_load_weights_asserts():
    """Drift guard: the pinned SGLang's load_weights asserts exactly the `cache_*` caches the table names, and
    spells every half and fused suffix the table uses; its wo_a pre-pass pairs `.wo_a.weight` with `.wo_a.scale`
    (a new fused pair in a bumped SGLang fails here)."""
    from engines.upstream.sources import EngineSourceMissing, sglang_paths

    try:
        roots = sglang_paths(install=False)
    except EngineSourceMissing as exc:
        pytest.skip(f"SGLang source unavailable: {exc}")
    model_file = "sglang/srt/models/deepseek_v4.py"
    source = next(r / model_file for r in roots if (r / model_file).is_file())
    text = source.read_text()
    body = text[text.index("    def load_weights(self, weights"):]
    body = body[: body.index("\n    def ", 10)]
    asserted = set(re.findall(r"assert len\((cache_\w+)\) == 0", body))
    assert asserted == {p.cache for p in FUSED_PAIRS if p.cache.startswith("cache_")}
    prepass = text[text.index("def _dequant_fp8_wo_a_streaming("):]
    prepass = prepass[: prepass.index("\ndef ", 10)]
    assert 'name.endswith(".wo_a.weight")' in prepass and 'name.endswith(".wo_a.scale")' in prepass
    assert "_dequant_fp8_wo_a_streaming(weights)" in text  # what load_weights runs when wo_a is not kept in FP8
    for pair in (p for p in FUSED_PAIRS if p.cache.startswith("cache_")):
        for half in pair.halves:  # spelled as SGLang matches it: name.endswith(".wq_a.weight_scale_inv"), ...
            assert '".' + ".".join(half.split(".")[-2:]) + '"' in body, half
        assert "." + pair.fused.split(".")[-2] + "." in body, pair.fused  # ".wkv_gate." / ".wqkv_a."
        assert all(f'"{part}"' in body for part in pair.excluding), pair.excluding


def test_an_unquantized_wo_a_loads_alone_as_sglangs_pre_pass_emits_it():
    """Miles broadcasts wo_a in BF16 (its FP8 quantizer's list has no wo_a): SGLang's wo_a pre-pass emits a held
    `wo_a.weight` as is when the call carried no `wo_a.scale`; FP8 bytes alone would load unscaled: refused."""
    import torch

    from engines.rollout.fused_pairs import SplitPairError, pair_units

    name = "model.layers.0.self_attn.wo_a.weight"
    bf16 = torch.zeros(4, 4, dtype=torch.bfloat16)
    assert list(pair_units([(name, bf16), ("model.norm.weight", bf16)])) == [
        [("model.norm.weight", bf16)], [(name, bf16)]]
    with pytest.raises(SplitPairError, match="has no partner model.layers.0.self_attn.wo_a.scale"):
        list(pair_units([(name, bf16.to(torch.float8_e4m3fn))]))
