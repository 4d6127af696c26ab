"""Named presets. `tiny-cpu` is the embedded default: a few-million-parameter DeepSeek-V4 with every
architectural feature, in a shape real SGLang 0.5.23 serves and transformers 5.23 loads, sized so that the
synthetic math task's ~140-token sequences exercise all of it.

Why these numbers:
  - layers: sliding, CSA, HCA, CSA (`compress_ratios` 0, 4, 128, 4); hash-routed MoE in the first two, learned
    top-k after (both kinds used).
  - CSA rate 4 and HCA rate 128, DeepSeek-V4's own: SGLang's DeepSeek-V4 builds only ratios 0/1/2/4/128 (1 and
    2 are V4.1 compressors) and transformers maps only 0/4/128 to a layer type. (Until then HCA ran at rate 8
    on ~36-token prompts; a config.json saying 8 does not load in SGLang.) The math task's instruction makes
    every prompt 128-130 tokens with BOS, so the HCA layer's first entry (positions 0-127) exists for the last
    prompt positions and every answer token. CSA gives ~33 entries per sequence, far more than index_topk 4,
    so the indexer really selects; 8 indexer heads keep exact score ties (ReLU zeroing every head) rare.
  - sliding_window 24: the problem (`Compute 47+38. Answer in \\boxed{}.`) ends every prompt, so the operands
    sit 15-20 tokens before the answer, inside the window as before; everything earlier reaches the answer
    only through the compressed branches. (With window 16 the operands fell outside the window of the answer
    tokens; measured: pass@1 still 0.05 after 280 steps, too slow to bootstrap in minutes.)
  - compress RoPE YaRN x4 over 1024 original positions (max 4096), like Flash's x16 over 65536: SGLang needs
    `original_max_position_embeddings` for compressed layers (KeyError without), and a factor other than 1
    proves every reader applies the same YaRN.
  - every FP8-quantized matrix dimension is 128 or a multiple of it (transformers derives the FP8 block
    from the scale grid), every FP4 input dimension a multiple of 32.
"""

from __future__ import annotations

from engines.presets.flash import COMPRESS_RATIOS, flash_config
from engines.model.config import CSA, HASH_MOE, HCA, SLIDING, TOPK_MOE, ModelConfig
from engines.model.tokenizer import VOCAB_SIZE


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
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32.0,
                      "beta_slow": 1.0},
        layer_types=[SLIDING, CSA, HCA, CSA],
        mlp_layer_types=[HASH_MOE, HASH_MOE, TOPK_MOE, TOPK_MOE],
        compress_rates={CSA: 4, HCA: 128},
        sliding_window=24,
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


def tiny_miles_config() -> ModelConfig:
    """The Miles-legal tiny DeepSeek-V4 the rehearsal and the cluster-rehearsal preset run: Flash's per-head shapes
    (Miles' attention asserts head_dim 512, rope 64, o_lora_rank 1024, window 128, YaRN x16 over 65536, compressor
    head dims 128/512), everything else shrunk: hidden 128, 2 heads in 2 output groups, 4 layers (sliding + hash
    MoE, CSA, HCA, CSA), 4 routed experts top-2, vocab 500."""
    return ModelConfig(
        vocab_size=500, hidden_size=128, num_hidden_layers=4, num_attention_heads=2, head_dim=512, q_lora_rank=128,
        partial_rotary_factor=64 / 512, layer_types=[SLIDING, CSA, HCA, CSA],
        mlp_layer_types=[HASH_MOE, TOPK_MOE, TOPK_MOE, TOPK_MOE], o_groups=2, o_lora_rank=1024, index_n_heads=4,
        index_head_dim=128, index_topk=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                      "beta_slow": 1},
        max_position_embeddings=4096, initializer_range=0.05)


PRESETS = {"tiny-cpu": tiny_cpu_model_config}


# Miles' `--dsv4-compress-ratios` for DeepSeek-V4-Flash (scripts/models/deepseek-v4-flash.py): one entry per
# decoder layer plus the MTP layer (the trailing 0), as the release config.json lists them.
DSV4_FLASH_COMPRESS_RATIOS = tuple(COMPRESS_RATIOS)


def dsv4_flash_model_config() -> ModelConfig:
    """DeepSeek-V4-Flash (284B total, 13B active): the model the `dsv4-flash-mi355x` run trains, read from its
    release config.json (engines/presets/flash.py, the one place its values live).

    43 layers (2 sliding-only, 21 CSA at rate 4, 20 HCA at rate 128: Miles' compress ratios without the MTP
    entry), hidden 4096, 64 heads of 512 sharing one KV head, q_lora 1024, 8 output groups of rank 1024,
    256 routed experts top-6 of width 2048 (3 hash-routed layers first), indexer 64 x 128 keeping 512,
    window 128, vocab 129280, compress RoPE YaRN x16 over 65536 positions. Shape only: never build it on CPU.
    """
    return ModelConfig.from_hf_dict(flash_config())
