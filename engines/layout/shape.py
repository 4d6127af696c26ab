"""DeepSeek-V4 model shape for the planner: parameter counts, KV bytes per token, activation bytes per token.

Closed forms, no torch: the planner must answer in milliseconds. `layer_params` agrees exactly with the
native tensor table (engines/model/params.py) and `ModelShape` with engines.model.config.ModelConfig; the
tests pin both, so the two never drift.

KV cache (rollout side), derived from the architecture rather than from per-head MLA formulas:
DeepSeek-V4 attention is shared-KV MQA: one `head_dim`=512 vector per position serves as both K and V for
all 64 heads. Every layer has a sliding branch over the last `sliding_window`=128 tokens, which is a
fixed-size ring per running request, not per pooled token. CSA layers (rate 4) add one compressed entry of
`head_dim` plus one indexer key of `index_head_dim`=128 per 4 tokens; HCA layers (rate 128) one entry of
`head_dim` per 128 tokens. So a pooled token costs sum over layers of (512+128)/4 or 512/128 elements
(Flash: 21 CSA + 20 HCA layers = 3440 elements, 6.9 KB in BF16), and each running request adds the
sliding windows and the compressors' not-yet-pooled tails. The single KV head cannot be split over
attention TP, so every attention-TP rank of an engine holds the whole pool (DP attention splits it).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
HASH_MOE, TOPK_MOE = "hash_moe", "moe"
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
DSV4_FLASH_COMPRESS_RATIOS = (0, 0) + (4, 128) * 20 + (4, 0)
"""Miles' `--dsv4-compress-ratios` for Flash (scripts/models/deepseek-v4-flash.py): 43 layers + the MTP layer."""


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The parts of a DeepSeek-V4 config that size memory and traffic.

    Fields mean what ModelConfig's do (num_layers = num_hidden_layers, num_heads = num_attention_heads,
    top_k = num_experts_per_tok, compress_rates as sorted pairs so the shape is hashable).
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    compress_rates: tuple[tuple[str, int], ...]
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    n_routed_experts: int
    top_k: int
    moe_intermediate_size: int
    hc_mult: int

    @classmethod
    def from_config(cls, cfg: Any) -> "ModelShape":
        """From an engines.model.config.ModelConfig (or anything with its attribute names)."""
        return cls(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers,
                   num_heads=cfg.num_attention_heads, head_dim=cfg.head_dim, q_lora_rank=cfg.q_lora_rank,
                   o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank, layer_types=tuple(cfg.layer_types),
                   mlp_layer_types=tuple(cfg.mlp_layer_types), compress_rates=tuple(sorted(cfg.compress_rates.items())),
                   sliding_window=cfg.sliding_window, index_n_heads=cfg.index_n_heads,
                   index_head_dim=cfg.index_head_dim, n_routed_experts=cfg.n_routed_experts,
                   top_k=cfg.num_experts_per_tok, moe_intermediate_size=cfg.moe_intermediate_size,
                   hc_mult=cfg.hc_mult)

    @classmethod
    def from_hf_config(cls, path: str) -> "ModelShape":
        """From a HF `config.json` in either form (release or transformers'); imports the model package (torch)."""
        from engines.model.config import ModelConfig

        return cls.from_config(ModelConfig.from_json_file(path))

    def rate(self, kind: str) -> int:
        return dict(self.compress_rates)[kind]


def dsv4_flash_shape() -> ModelShape:
    """DeepSeek-V4-Flash (284B, 13B active): equals engines.presets.models.dsv4_flash_model_config() (tested)."""
    n = 43
    return ModelShape(vocab_size=129280, hidden_size=4096, num_layers=n, num_heads=64, head_dim=512,
                      q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
                      layer_types=tuple(_RATIO_TO_TYPE[r] for r in DSV4_FLASH_COMPRESS_RATIOS[:n]),
                      mlp_layer_types=(HASH_MOE,) * 3 + (TOPK_MOE,) * (n - 3), compress_rates=((CSA, 4), (HCA, 128)),
                      sliding_window=128, index_n_heads=64, index_head_dim=128, n_routed_experts=256, top_k=6,
                      moe_intermediate_size=2048, hc_mult=4)


def tiny_cpu_shape() -> ModelShape:
    """The tiny-cpu preset's shape: equals engines.presets.models.tiny_cpu_model_config() (tested)."""
    return ModelShape(vocab_size=128, hidden_size=128, num_layers=4, num_heads=4, head_dim=64, q_lora_rank=128,
                      o_groups=2, o_lora_rank=64, layer_types=(SLIDING, CSA, HCA, CSA),
                      mlp_layer_types=(HASH_MOE, HASH_MOE, TOPK_MOE, TOPK_MOE), compress_rates=((CSA, 4), (HCA, 128)),
                      sliding_window=24, index_n_heads=8, index_head_dim=16, n_routed_experts=8, top_k=2,
                      moe_intermediate_size=128, hc_mult=4)


class LayerParams(NamedTuple):
    """Parameter counts of one decoder layer by storage kind (rollout format: FP8 linears, BF16/fp32 rest)."""

    fp8: int
    """FP8-stored dense linears: wq_a, wq_b, wkv, wo_a, wo_b, indexer wq_b, shared expert."""
    other: int
    """BF16/fp32 dense tensors: norms, mHC, sinks, compressors, indexer weights_proj, router."""
    experts: int
    """Routed experts (w1, w2, w3 of every expert)."""

    @property
    def dense(self) -> int:
        return self.fp8 + self.other


@lru_cache(maxsize=64)
def layer_params(shape: ModelShape, layer: int) -> LayerParams:
    """Closed-form parameter count of one layer; agrees exactly with engines.model.params (tested)."""
    H, hc, hd, ql, nh = shape.hidden_size, shape.hc_mult, shape.head_dim, shape.q_lora_rank, shape.num_heads
    inter, E, kind = shape.moe_intermediate_size, shape.n_routed_experts, shape.layer_types[layer]
    og_width = shape.o_groups * shape.o_lora_rank
    fp8 = ql * H + nh * hd * ql + hd * H + og_width * (nh * hd // shape.o_groups) + H * og_width + 3 * inter * H
    other = 2 * H + 2 * ((2 + hc) * hc * hc * H + (2 + hc) * hc + 3) + ql + hd + nh + E * H
    other += E if shape.mlp_layer_types[layer] != HASH_MOE else 0  # selection bias (hash layers: tid2eid buffer)
    if kind != SLIDING:
        width = 2 * hd if kind == CSA else hd
        other += 2 * width * H + hd + shape.rate(kind) * width
    if kind == CSA:
        ih, idim = shape.index_n_heads, shape.index_head_dim
        fp8 += ih * idim * ql
        other += ih * H + 2 * (2 * idim) * H + idim + shape.rate(CSA) * 2 * idim
    return LayerParams(fp8=fp8, other=other, experts=E * 3 * inter * H)


def embedding_params(shape: ModelShape) -> tuple[int, int]:
    """(first-stage params: embed, last-stage params: head + final norm + mHC head)."""
    H, hc = shape.hidden_size, shape.hc_mult
    return shape.vocab_size * H, shape.vocab_size * H + H + hc * hc * H + hc + 1


def total_params(shape: ModelShape) -> int:
    """Every trainable parameter (buffers such as tid2eid excluded)."""
    first, last = embedding_params(shape)
    return first + last + sum(sum(layer_params(shape, i)[:3]) for i in range(shape.num_layers))


def kv_bytes_per_token(shape: ModelShape, bytes_per_elem: float) -> float:
    """Pool bytes one cached token costs: CSA (head_dim + indexer_head_dim)/4, HCA head_dim/128, sliding 0."""
    elems = sum((shape.head_dim + shape.index_head_dim) / shape.rate(CSA) if t == CSA
                else shape.head_dim / shape.rate(HCA) if t == HCA else 0.0 for t in shape.layer_types)
    return elems * bytes_per_elem


def request_state_bytes(shape: ModelShape, bytes_per_elem: float) -> float:
    """Per running request: the 128-token sliding window of every layer + compressor tails not yet pooled."""
    hd, idim = shape.head_dim, shape.index_head_dim
    elems = 0.0
    for t in shape.layer_types:
        elems += shape.sliding_window * hd
        if t == CSA:  # overlapping windows: two series of 2*rate rows, for the KV and the indexer compressor
            elems += 2 * shape.rate(CSA) * (2 * hd + 2 * idim)
        elif t == HCA:
            elems += shape.rate(HCA) * hd
    return elems * bytes_per_elem


def activation_bytes_per_token(shape: ModelShape, layer: int) -> tuple[float, float]:
    """(all saved activations, the attention-core part selective recompute drops) per token, one layer.

    BF16 (2 B) unless noted: mHC streams 2 sites x hc x H x (fp32 + bf16); attention inputs/outputs of every
    projection (norm out, q_a, q, kv, attn out, wo_a out, wo_b out) + fp32 softmax stats per head; CSA adds
    the indexer queries/weights and compressor inputs, HCA the compressor input; MoE saves the router's
    fp32 scores, top_k dispatched copies of (input, fc1 out 2I, act I, output) and the shared expert's.
    """
    H, hc, hd, nh, ql, k = (shape.hidden_size, shape.hc_mult, shape.head_dim, shape.num_heads, shape.q_lora_rank,
                            shape.top_k)
    inter, og_width = shape.moe_intermediate_size, shape.o_groups * shape.o_lora_rank
    mhc = 2 * hc * H * (4 + 2)
    core = 2 * (2 * nh * hd) + 4 * nh
    attn = 2 * (H + ql + hd + og_width + H) + core
    kind = shape.layer_types[layer]
    if kind == CSA:
        attn += 2 * (shape.index_n_heads * shape.index_head_dim + shape.index_n_heads) + 2 * 2 * (2 * hd)
    elif kind == HCA:
        attn += 2 * 2 * hd
    moe = 2 * H + 4 * shape.n_routed_experts + 2 * k * (H + 3 * inter + H) + 2 * (3 * inter + H)
    return float(mhc + attn + moe), float(core)

