"""Pins the Megatron columns of checkpoints/names.py: the names each Miles generation's DeepSeek-V4 model uses
(plugin names for 31f1ca961; Megatron's names for e9e19b223, mHC scales split into alpha_pre/post/res), the expert
stacking `[E, 2I, H]` (gate rows, then up rows) and `[E, H, I]`, the shared-expert gate/up fusion, and
that whole-state fusion, splitting and the streaming converters' per-tensor `placement` agree, because
they all read the same table. No megatron-core here: pure names and arange tensors.

    .venv/bin/python -m pytest tests/test_names_megatron.py -q        (CPU, ~2 s)
"""

from __future__ import annotations

import math

import pytest
import torch

from checkpoints.names import (
    EXPERT_FUSIONS,
    NAME_TABLE,
    Part,
    convert_name,
    detect_megatron_names,
    fuse_down,
    fuse_gate_up,
    megatron_to_native,
    megatron_to_native_name,
    native_to_megatron,
    native_to_megatron_name,
    native_to_transformers,
    placement,
    placements,
)
from checkpoints.torch_dist import TORCH_DIST_DTYPES, megatron_specs
from engines.model.config import CSA, HASH_MOE, HCA, SLIDING, TOPK_MOE, ModelConfig
from engines.model.params import native_param_specs

NUM_GPUS = 0


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return ModelConfig(
        vocab_size=64, hidden_size=128, num_hidden_layers=4, num_attention_heads=2, head_dim=64, q_lora_rank=64,
        partial_rotary_factor=0.25, layer_types=[SLIDING, CSA, HCA, CSA],
        mlp_layer_types=[HASH_MOE, HASH_MOE, TOPK_MOE, TOPK_MOE], compress_rates={CSA: 4, HCA: 8},
        sliding_window=8, o_groups=2, o_lora_rank=64, index_n_heads=2, index_head_dim=64, index_topk=4,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=96,
    )


def arange_state(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every native tensor holds distinct consecutive values, so any misplacement shows."""
    out, offset = {}, 0
    for name, spec in native_param_specs(cfg).items():
        n = math.prod(spec.shape)
        out[name] = torch.arange(offset, offset + n, dtype=torch.float64).reshape(spec.shape)
        offset += n
    return out


def test_names_match_miles_deepseek_v4_bridge():
    expect = {
        "embed.weight": "embedding.word_embeddings.weight",
        "head.weight": "output_layer.weight",
        "norm.weight": "decoder.final_layernorm.weight",
        "hc_head_fn": "decoder.hc_head_params.hc_head_fn",
        "hc_head_scale": "decoder.hc_head_params.hc_head_scale",
        "layers.5.attn_norm.weight": "decoder.layers.5.input_layernorm.weight",
        "layers.5.ffn_norm.weight": "decoder.layers.5.pre_mlp_layernorm.weight",
        "layers.5.hc_attn_fn": "decoder.layers.5.hc_attn_fn",
        "layers.5.hc_ffn_base": "decoder.layers.5.hc_ffn_base",
        "layers.5.attn.wq_a.weight": "decoder.layers.5.self_attention.wq_a.weight",
        "layers.5.attn.q_norm.weight": "decoder.layers.5.self_attention.q_norm.weight",
        "layers.5.attn.wkv.weight": "decoder.layers.5.self_attention.wkv.weight",
        "layers.5.attn.kv_norm.weight": "decoder.layers.5.self_attention.kv_norm.weight",
        "layers.5.attn.wo_b.weight": "decoder.layers.5.self_attention.wo_b.weight",
        "layers.5.attn.attn_sink": "decoder.layers.5.self_attention.attn_sink",
        "layers.5.attn.compressor.ape": "decoder.layers.5.self_attention.compressor.ape",
        "layers.5.attn.compressor.wgate.weight": "decoder.layers.5.self_attention.compressor.wgate.weight",
        "layers.5.attn.indexer.wq_b.weight": "decoder.layers.5.self_attention.indexer.linear_wq_b.weight",
        "layers.5.attn.indexer.weights_proj.weight":
            "decoder.layers.5.self_attention.indexer.linear_weights_proj.weight",
        "layers.5.attn.indexer.compressor.norm.weight":
            "decoder.layers.5.self_attention.indexer.compressor.norm.weight",
        "layers.5.ffn.gate.weight": "decoder.layers.5.mlp.router.weight",
        "layers.5.ffn.gate.bias": "decoder.layers.5.mlp.router.expert_bias",
        "layers.5.ffn.gate.tid2eid": "decoder.layers.5.mlp.router.tid2eid",
        "layers.5.ffn.shared_experts.w2.weight": "decoder.layers.5.mlp.shared_experts.linear_fc2.weight",
    }
    for native, megatron in expect.items():
        assert native_to_megatron_name(native) == megatron
        assert megatron_to_native_name(megatron) == native


def test_every_native_tensor_has_one_megatron_home(cfg):
    """Non-fused names round-trip; fused ones land in disjoint boxes that tile their tensor exactly."""
    specs = native_param_specs(cfg)
    boxes: dict[str, list] = {}
    for name, spec in specs.items():
        p = placement(name, spec.shape, "megatron", cfg.n_routed_experts)
        boxes.setdefault(p.name, []).append(p)
        if p.whole:
            assert megatron_to_native_name(p.name) == name
    for key, ps in boxes.items():
        assert len({p.global_shape for p in ps}) == 1
        assert sum(math.prod(p.sizes) for p in ps) == math.prod(ps[0].global_shape), key
        assert len({p.offsets for p in ps}) == len(ps), key


def test_state_round_trip_and_layout_on_arange(cfg):
    native = arange_state(cfg)
    meg = native_to_megatron(native, cfg)
    back = megatron_to_native(meg, cfg)
    assert sorted(back) == sorted(native)
    assert all(torch.equal(back[k], native[k]) for k in native)

    inter, hidden, E = cfg.moe_intermediate_size, cfg.hidden_size, cfg.n_routed_experts
    fc1 = meg["decoder.layers.2.mlp.experts.experts.linear_fc1.weight"]
    fc2 = meg["decoder.layers.2.mlp.experts.experts.linear_fc2.weight"]
    assert tuple(fc1.shape) == (E, 2 * inter, hidden) and tuple(fc2.shape) == (E, hidden, inter)
    assert torch.equal(fc1[3, :inter], native["layers.2.ffn.experts.3.w1.weight"])  # gate rows first
    assert torch.equal(fc1[3, inter:], native["layers.2.ffn.experts.3.w3.weight"])  # then up rows
    assert torch.equal(fc2[1], native["layers.2.ffn.experts.1.w2.weight"])
    shared = meg["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"]
    assert torch.equal(shared, torch.cat([native["layers.0.ffn.shared_experts.w1.weight"],
                                          native["layers.0.ffn.shared_experts.w3.weight"]]))
    # the stacked layout is the one transformers and the legacy fuse helpers use too
    tf = native_to_transformers(native, cfg)
    assert torch.equal(tf["model.layers.2.mlp.experts.gate_up_proj"], fc1)
    assert torch.equal(fc1, fuse_gate_up([native[f"layers.2.ffn.experts.{e}.w1.weight"] for e in range(E)],
                                         [native[f"layers.2.ffn.experts.{e}.w3.weight"] for e in range(E)]))
    assert torch.equal(fc2, fuse_down([native[f"layers.2.ffn.experts.{e}.w2.weight"] for e in range(E)]))


def test_placement_agrees_with_whole_state_fusion(cfg):
    native = arange_state(cfg)
    meg = native_to_megatron(native, cfg)
    for name, t in native.items():
        p = placement(name, tuple(t.shape), "megatron", cfg.n_routed_experts)
        box = meg[p.name][tuple(slice(o, o + s) for o, s in zip(p.offsets, p.sizes))]
        assert torch.equal(box.reshape(t.shape), t), name


def test_megatron_specs_shapes_and_dtypes(cfg):
    specs = megatron_specs(cfg)
    meg = native_to_megatron(arange_state(cfg), cfg)
    assert {k: s.shape for k, s in specs.items()} == {k: tuple(v.shape) for k, v in meg.items()}
    kinds = {n: s.kind for n, s in native_param_specs(cfg).items()}
    assert specs["decoder.layers.1.self_attention.attn_sink"].dtype == torch.float32
    assert specs["decoder.layers.1.self_attention.compressor.ape"].dtype == torch.float32
    assert specs["decoder.layers.1.hc_attn_fn"].dtype == torch.float32
    assert specs["decoder.layers.2.mlp.router.expert_bias"].dtype == torch.float32
    assert specs["decoder.layers.0.mlp.router.tid2eid"].dtype == torch.int32  # as both Miles routers hold it
    assert specs["decoder.layers.0.mlp.router.tid2eid"].shape == (cfg.vocab_size, cfg.num_experts_per_tok)
    assert specs["decoder.layers.0.mlp.experts.experts.linear_fc1.weight"].dtype == torch.bfloat16
    assert specs["embedding.word_embeddings.weight"].dtype == torch.bfloat16
    assert {TORCH_DIST_DTYPES[k] for k in kinds.values()} == {torch.bfloat16, torch.float32, torch.int32}


def test_unknown_and_fused_names_fail_loudly(cfg):
    with pytest.raises(ValueError, match=r"decoder\.layers\.0\.self_attention\.bogus\.weight"):
        megatron_to_native_name("decoder.layers.0.self_attention.bogus.weight")
    with pytest.raises(ValueError, match="fused"):
        megatron_to_native_name("decoder.layers.0.mlp.experts.experts.linear_fc1.weight")
    with pytest.raises(ValueError, match=r"linear_fc1"):
        native_to_megatron_name("layers.0.ffn.experts.2.w3.weight")
    with pytest.raises(ValueError, match=r"expert 9 is out of range"):
        placement("layers.0.ffn.experts.9.w1.weight", (96, 128), "megatron", 4)
    with pytest.raises(ValueError, match=r"layers\.1\.ffn\.experts\.3\.w3\.weight is missing"):
        native_to_megatron({f"layers.1.ffn.experts.{e}.w1.weight": torch.zeros(2, 2) for e in range(4)}
                           | {f"layers.1.ffn.experts.{e}.w3.weight": torch.zeros(2, 2) for e in range(3)}, cfg)
    with pytest.raises(ValueError, match=r"linear_fc2.*shape \(3, 128, 96\)"):
        megatron_to_native({"decoder.layers.1.mlp.experts.experts.linear_fc2.weight": torch.zeros(3, 128, 96)}, cfg)
    with pytest.raises(ValueError, match="columns"):
        convert_name("embed.weight", "native", "deepspeed")


def test_table_is_written_once_and_fusions_are_derived():
    """Each column names a tensor once; transformers' EXPERT_FUSIONS is derived from the same Parts."""
    for c in range(len(NAME_TABLE[0])):
        names = [row[c] for row in NAME_TABLE if isinstance(row[c], str)]
        assert len(names) == len(set(names))
    assert {k: v[0] for k, v in EXPERT_FUSIONS.items()} == {
        "model.layers.{i}.mlp.experts.gate_up_proj": ("w1", "w3"), "model.layers.{i}.mlp.experts.down_proj": ("w2",)}
    megatron_parts = {row[3].name for row in NAME_TABLE if isinstance(row[3], Part)}
    assert megatron_parts == {"decoder.layers.{i}.mlp.experts.experts.linear_fc1.weight",
                              "decoder.layers.{i}.mlp.experts.experts.linear_fc2.weight",
                              "decoder.layers.{i}.mlp.shared_experts.linear_fc1.weight"}


# ---------------------------------------------------------------------------------------------- Megatron's names
GEN2_LAYER_KEYS = {
    # Miles e9e19b223 + Megatron-LM 6184c094a: DeepSeekV4Attention / DSv4HybridSelfAttention, CSA Compressor and
    # CSAIndexer, HyperConnectionModule (mapping_proj, bias, alpha_pre/post/res), TransformerBlock's hc_head_*
    "layers.1.attn.wq_a.weight": "decoder.layers.1.self_attention.linear_q_down_proj.weight",
    "layers.1.attn.q_norm.weight": "decoder.layers.1.self_attention.q_layernorm.weight",
    "layers.1.attn.wq_b.weight": "decoder.layers.1.self_attention.linear_q_up_proj.weight",
    "layers.1.attn.wkv.weight": "decoder.layers.1.self_attention.linear_kv_proj.weight",
    "layers.1.attn.kv_norm.weight": "decoder.layers.1.self_attention.kv_layernorm.weight",
    "layers.1.attn.wo_a.weight": "decoder.layers.1.self_attention.linear_o_group_proj",
    "layers.1.attn.wo_b.weight": "decoder.layers.1.self_attention.linear_proj.weight",
    "layers.1.attn.attn_sink": "decoder.layers.1.self_attention.core_attention.attn_sink",
    "layers.1.attn.compressor.wkv.weight": "decoder.layers.1.self_attention.core_attention.compressor.linear_wkv.weight",
    "layers.1.attn.compressor.wgate.weight":
        "decoder.layers.1.self_attention.core_attention.compressor.linear_wgate.weight",
    "layers.1.attn.compressor.norm.weight": "decoder.layers.1.self_attention.core_attention.compressor.norm.weight",
    "layers.1.attn.compressor.ape": "decoder.layers.1.self_attention.core_attention.compressor.ape",
    "layers.1.attn.indexer.wq_b.weight": "decoder.layers.1.self_attention.core_attention.indexer.linear_wq_b.weight",
    "layers.1.attn.indexer.weights_proj.weight":
        "decoder.layers.1.self_attention.core_attention.indexer.linear_weights_proj.weight",
    "layers.1.attn.indexer.compressor.ape": "decoder.layers.1.self_attention.core_attention.indexer.compressor.ape",
    "layers.1.hc_attn_fn": "decoder.layers.1.self_attention_hyper_connection.mapping_proj.weight",
    "layers.1.hc_attn_base": "decoder.layers.1.self_attention_hyper_connection.bias",
    "layers.1.hc_ffn_fn": "decoder.layers.1.mlp_hyper_connection.mapping_proj.weight",
    "layers.1.hc_ffn_base": "decoder.layers.1.mlp_hyper_connection.bias",
    "hc_head_fn": "decoder.hc_head_fn",
    "hc_head_base": "decoder.hc_head_base",
    "hc_head_scale": "decoder.hc_head_scale",
    "layers.1.ffn.gate.tid2eid": "decoder.layers.1.mlp.router.tid2eid",
    "layers.1.attn_norm.weight": "decoder.layers.1.input_layernorm.weight",
}


def test_megatron_names_match_miles_second_generation():
    for native, megatron in GEN2_LAYER_KEYS.items():
        assert native_to_megatron_name(native, "megatron") == megatron
        assert megatron_to_native_name(megatron, "megatron") == native
    with pytest.raises(ValueError, match=r"split into .*alpha_pre.*alpha_post.*alpha_res"):
        native_to_megatron_name("layers.1.hc_attn_scale", "megatron")
    with pytest.raises(ValueError, match=r"one block of native tensor 'layers\.1\.hc_ffn_scale'"):
        megatron_to_native_name("decoder.layers.1.mlp_hyper_connection.alpha_res", "megatron")
    with pytest.raises(ValueError, match="plugin, megatron"):
        native_to_megatron_name("embed.weight", "mcore")


def test_megatron_names_key_set_alpha_split_and_order(cfg):
    plugin, megatron = megatron_specs(cfg, "plugin"), megatron_specs(cfg, "megatron")
    # every layer's two packed scales [3] become three [1] alphas: +4 keys per layer, nothing else changes count
    assert len(megatron) == len(plugin) + 4 * cfg.num_hidden_layers
    assert not any(k in plugin for k in megatron if "self_attention." in k and "layernorm" not in k)
    native = arange_state(cfg)
    meg = native_to_megatron(native, cfg, "megatron")
    assert {k: tuple(v.shape) for k, v in meg.items()} == {k: s.shape for k, s in megatron_specs(cfg, "megatron").items()}
    for site, hc in (("attn", "self_attention_hyper_connection"), ("ffn", "mlp_hyper_connection")):
        scale = native[f"layers.2.hc_{site}_scale"]
        got = [meg[f"decoder.layers.2.{hc}.alpha_{a}"] for a in ("pre", "post", "res")]
        assert [tuple(g.shape) for g in got] == [(1,)] * 3
        assert torch.equal(torch.cat(got), scale)  # order pre, post, res = DeepSeek's packed order
    back = megatron_to_native(meg, cfg)  # names detected from the keys
    assert sorted(back) == sorted(native) and all(torch.equal(back[k], native[k]) for k in native)
    swapped = dict(meg)
    swapped["decoder.layers.2.mlp_hyper_connection.alpha_pre"], swapped["decoder.layers.2.mlp_hyper_connection.alpha_res"] = (
        meg["decoder.layers.2.mlp_hyper_connection.alpha_res"], meg["decoder.layers.2.mlp_hyper_connection.alpha_pre"])
    assert not torch.equal(megatron_to_native(swapped, cfg)["layers.2.hc_ffn_scale"], native["layers.2.hc_ffn_scale"])
    del swapped["decoder.layers.2.mlp_hyper_connection.alpha_post"]
    with pytest.raises(ValueError, match=r"mlp_hyper_connection\.alpha_post is missing"):
        megatron_to_native(swapped, cfg, "megatron")


def test_placements_agree_with_whole_state_split(cfg):
    native = arange_state(cfg)
    meg = native_to_megatron(native, cfg, "megatron")
    for name, t in native.items():
        boxes = placements(name, tuple(t.shape), "megatron2", cfg.n_routed_experts)
        for p in boxes:
            box = meg[p.name][tuple(slice(o, o + s) for o, s in zip(p.offsets, p.sizes))]
            assert torch.equal(box, p.take(t)), name
        assert sum(math.prod(p.sizes) for p in boxes) == t.numel()
    with pytest.raises(ValueError, match="use placements"):
        placement("layers.0.hc_attn_scale", (3,), "megatron2", 4)


def test_names_are_detected_from_keys(cfg):
    plugin, megatron = megatron_specs(cfg, "plugin"), megatron_specs(cfg, "megatron")
    assert detect_megatron_names(plugin) == "plugin" and detect_megatron_names(megatron) == "megatron"
    noise = ["optimizer.state.exp_avg.decoder.layers.0.x", "decoder.layers.0.self_attention.linear_proj._extra_state"]
    assert detect_megatron_names([*megatron, *noise]) == "megatron"
    with pytest.raises(ValueError, match=r"mixes Miles' plugin names .*self_attention\.wq_a"):
        detect_megatron_names([*megatron, "decoder.layers.0.self_attention.wq_a.weight"])
    with pytest.raises(ValueError, match="no DeepSeek-V4 tensor"):
        detect_megatron_names(["embedding.word_embeddings.weight", "output_layer.weight"])


def test_megatron_names_column_is_written_once_and_split_as_parts():
    splits = [row for row in NAME_TABLE if isinstance(row[4], tuple)]
    assert [row[0] for row in splits] == ["layers.{i}.hc_attn_scale", "layers.{i}.hc_ffn_scale"]
    for row in splits:
        assert [(p.name.rsplit(".", 1)[1], p.index, p.parts) for p in row[4]] == [
            ("alpha_pre", 0, 3), ("alpha_post", 1, 3), ("alpha_res", 2, 3)]
        assert all(isinstance(p, Part) for p in row[4])
    # expert stacking and fusion are the same Parts in both Megatron generations
    assert [row[3] for row in NAME_TABLE if isinstance(row[3], Part)] == [
        row[4] for row in NAME_TABLE if isinstance(row[4], Part)]
