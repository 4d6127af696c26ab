"""Named presets. `tiny-cpu` is the embedded default: a few-million-parameter DeepSeek-V4 with every
architectural feature, sized so that the synthetic math task's ~35-token sequences exercise all of it.

Why these numbers:
  - layers: sliding, CSA, HCA, CSA; hash-routed MoE in the first two, learned top-k after (both kinds used).
  - sliding_window 16 < sequence length (~35): the answer tokens cannot see the operands through the
    window alone, so the compressed branches carry real information.
  - CSA rate 4 gives ~8 entries per sequence, more than index_topk 4, so the indexer really selects;
    HCA rate 8 gives ~4 entries. 8 indexer heads keep exact score ties (ReLU zeroing every
    head) rare.
  - every FP8-quantized matrix dimension is 128 or a multiple of it (transformers derives the FP8 block
    from the scale grid), every FP4 input dimension a multiple of 32.
"""

from __future__ import annotations

from engines.model.config import CSA, HASH_MOE, HCA, SLIDING, TOPK_MOE, ModelConfig
from engines.tokenizer import VOCAB_SIZE


def tiny_cpu_model_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        head_dim=64,
        q_lora_rank=128,
        partial_rotary_factor=0.25,
        max_position_embeddings=4096,
        layer_types=[SLIDING, CSA, HCA, CSA],
        mlp_layer_types=[HASH_MOE, HASH_MOE, TOPK_MOE, TOPK_MOE],
        compress_rates={CSA: 4, HCA: 8},
        sliding_window=16,
        o_groups=2,
        o_lora_rank=64,
        index_n_heads=8,
        index_head_dim=16,
        index_topk=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )


PRESETS = {"tiny-cpu": tiny_cpu_model_config}
