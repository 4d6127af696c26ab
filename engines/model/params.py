"""The native DeepSeek-V4 parameter set: every tensor name, its shape, and how the real checkpoint stores it.

Native names are DeepSeek's own (`layers.3.attn.wq_a.weight`, `layers.0.ffn.experts.7.w2.weight`), the
form `deepseek-ai/DeepSeek-V4-Flash` ships and transformers' conversion mapping reads. Our model, the
HF checkpoint writer/reader and the converters all take this table as the single source of truth.

Storage kinds follow the real checkpoint (reference/miles-sglang-megatron.md §4.1):
  fp8   FP8 E4M3 weight + 128x128 block `.scale` (every linear except those listed as bf16 below)
  fp4   FP4 E2M1 packed two per byte + UE8M0 `.scale` per 1x32 along the input dim (routed experts)
  bf16  compressor / indexer-compressor wkv and wgate, indexer weights_proj, router gate, embed, head, norms
  fp32  hc_*, attn_sink, ape, the router's selection bias
  int64 tid2eid (hash-routed layers)

    python -c "from engines.model.params import native_param_specs; ..."
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from engines.model.config import CSA, HASH_MOE, SLIDING, ModelConfig

StorageKind = Literal["fp8", "fp4", "bf16", "fp32", "int64"]


@dataclass(frozen=True)
class ParamSpec:
    """One native tensor: its logical (dequantized) shape and its on-disk storage kind."""

    shape: tuple[int, ...]
    kind: StorageKind


def native_param_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """All native tensors of a model with this config, in a stable order (embed, layers, head)."""
    H, hc = cfg.hidden_size, cfg.hc_mult
    nh, hd, ql = cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    inter, E = cfg.moe_intermediate_size, cfg.n_routed_experts
    specs: dict[str, ParamSpec] = {"embed.weight": ParamSpec((cfg.vocab_size, H), "bf16")}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        specs[p + "attn_norm.weight"] = ParamSpec((H,), "bf16")
        specs[p + "ffn_norm.weight"] = ParamSpec((H,), "bf16")
        for site in ("attn", "ffn"):
            specs[p + f"hc_{site}_fn"] = ParamSpec(((2 + hc) * hc, hc * H), "fp32")
            specs[p + f"hc_{site}_base"] = ParamSpec(((2 + hc) * hc,), "fp32")
            specs[p + f"hc_{site}_scale"] = ParamSpec((3,), "fp32")
        a = p + "attn."
        specs[a + "wq_a.weight"] = ParamSpec((ql, H), "fp8")
        specs[a + "q_norm.weight"] = ParamSpec((ql,), "bf16")
        specs[a + "wq_b.weight"] = ParamSpec((nh * hd, ql), "fp8")
        specs[a + "wkv.weight"] = ParamSpec((hd, H), "fp8")
        specs[a + "kv_norm.weight"] = ParamSpec((hd,), "bf16")
        specs[a + "wo_a.weight"] = ParamSpec((cfg.o_groups * cfg.o_lora_rank, nh * hd // cfg.o_groups), "fp8")
        specs[a + "wo_b.weight"] = ParamSpec((H, cfg.o_groups * cfg.o_lora_rank), "fp8")
        specs[a + "attn_sink"] = ParamSpec((nh,), "fp32")
        kind = cfg.layer_types[i]
        if kind != SLIDING:
            rate = cfg.compress_rate(i)
            width = 2 * hd if kind == CSA else hd  # CSA pools two overlapping series (Ca, Cb)
            specs.update(_compressor_specs(a + "compressor.", H, width, hd, rate))
        if kind == CSA:
            ih, idim = cfg.index_n_heads, cfg.index_head_dim
            specs[a + "indexer.wq_b.weight"] = ParamSpec((ih * idim, ql), "fp8")
            specs[a + "indexer.weights_proj.weight"] = ParamSpec((ih, H), "bf16")
            specs.update(_compressor_specs(a + "indexer.compressor.", H, 2 * idim, idim, cfg.compress_rate(i)))
        f = p + "ffn."
        specs[f + "gate.weight"] = ParamSpec((E, H), "bf16")
        if cfg.mlp_layer_types[i] == HASH_MOE:
            specs[f + "gate.tid2eid"] = ParamSpec((cfg.vocab_size, cfg.num_experts_per_tok), "int64")
        else:
            specs[f + "gate.bias"] = ParamSpec((E,), "fp32")
        for e in range(E):
            specs[f + f"experts.{e}.w1.weight"] = ParamSpec((inter, H), "fp4")
            specs[f + f"experts.{e}.w2.weight"] = ParamSpec((H, inter), "fp4")
            specs[f + f"experts.{e}.w3.weight"] = ParamSpec((inter, H), "fp4")
        specs[f + "shared_experts.w1.weight"] = ParamSpec((inter, H), "fp8")
        specs[f + "shared_experts.w2.weight"] = ParamSpec((H, inter), "fp8")
        specs[f + "shared_experts.w3.weight"] = ParamSpec((inter, H), "fp8")
    specs["norm.weight"] = ParamSpec((H,), "bf16")
    specs["hc_head_fn"] = ParamSpec((hc, hc * H), "fp32")
    specs["hc_head_base"] = ParamSpec((hc,), "fp32")
    specs["hc_head_scale"] = ParamSpec((1,), "fp32")
    specs["head.weight"] = ParamSpec((cfg.vocab_size, H), "bf16")
    return specs


def _compressor_specs(prefix: str, hidden: int, width: int, out_dim: int, rate: int) -> dict[str, ParamSpec]:
    return {
        prefix + "wkv.weight": ParamSpec((width, hidden), "bf16"),
        prefix + "wgate.weight": ParamSpec((width, hidden), "bf16"),
        prefix + "norm.weight": ParamSpec((out_dim,), "bf16"),
        prefix + "ape": ParamSpec((rate, width), "fp32"),
    }
