"""DeepSeek-V4-Flash's `config.json` in DeepSeek's release format, as a plain dict (stdlib only, no torch).

The Miles job needs the model's architecture before a checkpoint is at hand (a launch plan shows
`${HF_CHECKPOINT}`), and the planner must stay torch-free, so the preset carries this dict. The values are
the ones Miles' `scripts/models/deepseek-v4-flash.py` and SGLang 0.5.23's `DeepSeekV4Config` encode for Flash
(284B total, 13B active): 43 layers (+1 MTP layer), hidden 4096, 64 query heads of 512 sharing one KV head,
q_lora 1024, 8 output groups of rank 1024, 256 routed experts top-6 of width 2048 plus one shared expert,
sqrtsoftplus routing scaled by 1.5, 3 hash-routed layers, SwiGLU clamp 10, window 128, CSA rate 4 / HCA rate
128, indexer 64 x 128 keeping 512, YaRN x16 over 65536 positions for the compressed branches.
`tests/test_miles_job.py` pins it to `engines.presets.models.dsv4_flash_model_config()` and `dsv4_flash_shape()`;
`tests/conformance/test_miles_model_args.py` to Miles' own model script.

    from engines.presets.flash import flash_config
    flash_config()["compress_ratios"][:4]   # [0, 0, 4, 128]
"""

from __future__ import annotations

import copy
from typing import Any

COMPRESS_RATIOS = [0, 0] + [4, 128] * 20 + [4, 0]
"""Per layer: 0 sliding-only, 4 CSA, 128 HCA; 43 decoder layers plus the MTP layer (the trailing 0)."""

_FLASH: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_hidden_layers": 43,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "kv_lora_rank": 512,
    "v_head_dim": 512,
    "q_lora_rank": 1024,
    "qk_rope_head_dim": 64,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "compress_ratios": COMPRESS_RATIOS,
    "compress_rope_theta": 160000.0,
    "num_hash_layers": 3,
    "sliding_window": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048,
    "first_k_dense_replace": 0,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "norm_topk_prob": True,
    "swiglu_limit": 10.0,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 1048576,
    "rope_scaling": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                     "beta_fast": 32.0, "beta_slow": 1.0},
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128], "scale_fmt": "ue8m0"},
}


def flash_config() -> dict[str, Any]:
    """A fresh copy of Flash's config.json (callers may edit it)."""
    return copy.deepcopy(_FLASH)
