"""config.json forms (engines/model/config_format.py): v4rl writes DeepSeek's release form, reads it and
transformers' form back to the same ModelConfig, and refuses a config whose two forms disagree, naming the keys.

What SGLang and transformers themselves resolve from these files is tests/conformance/test_sglang_checkpoints.py.

    .venv/bin/python -m pytest tests/test_model_config.py -q        (CPU, seconds)
"""

from __future__ import annotations

import pytest
from transformers import DeepseekV4Config

from checkpoints.hf import hf_config_dict, with_release_model_keys
from engines.model.config import CSA, HASH_MOE, HCA, SLIDING, TOPK_MOE, ModelConfig
from engines.model.config_format import TRANSFORMERS_ONLY
from engines.presets.models import dsv4_flash_model_config, tiny_cpu_model_config


def _release() -> ModelConfig:
    """A small model the release form says completely: CSA 4 / HCA 128, hash layers first, YaRN."""
    return ModelConfig(vocab_size=61, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, head_dim=32,
                       q_lora_rank=32, partial_rotary_factor=0.25, layer_types=[SLIDING, CSA, HCA, CSA],
                       mlp_layer_types=[HASH_MOE, HASH_MOE, TOPK_MOE, TOPK_MOE], compress_rates={CSA: 4, HCA: 128},
                       sliding_window=24, o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16,
                       index_topk=3, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       max_position_embeddings=4096,
                       rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024})


def _odd() -> ModelConfig:
    """A model the release form cannot say: HCA rate 8, hash layer after a top-k layer."""
    return ModelConfig(vocab_size=61, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, head_dim=32,
                       q_lora_rank=32, partial_rotary_factor=0.25, layer_types=[SLIDING, CSA, HCA, CSA],
                       mlp_layer_types=[TOPK_MOE, HASH_MOE, TOPK_MOE, TOPK_MOE], compress_rates={CSA: 4, HCA: 8},
                       sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16,
                       index_topk=3, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


PRESETS = {"tiny-cpu": tiny_cpu_model_config, "dsv4-flash": dsv4_flash_model_config, "release": _release,
           "odd": _odd}


def test_a_release_model_is_written_in_the_release_form_only():
    cfg = _release()
    raw = cfg.to_hf_dict()
    assert not set(TRANSFORMERS_ONLY) & set(raw)
    assert raw["compress_ratios"] == [{SLIDING: 0, CSA: 4, HCA: 128}[t] for t in cfg.layer_types]
    assert raw["num_hash_layers"] == raw["n_hash_layers"] == cfg.mlp_layer_types.count(HASH_MOE)
    assert raw["qk_rope_head_dim"] == cfg.rope_head_dim and raw["qk_nope_head_dim"] == cfg.head_dim - cfg.rope_head_dim
    assert raw["sliding_window"] == raw["window_size"] == cfg.sliding_window
    assert raw["rope_scaling"]["type"] == "yarn" and raw["rope_scaling"]["original_max_position_embeddings"] > 0
    assert (raw["first_k_dense_replace"], raw["n_group"], raw["topk_group"], raw["topk_method"]) == (0, 1, 1, "noaux_tc")
    assert list(raw) == sorted(raw)


def test_flash_preset_matches_miles_compress_ratios():
    from engines.presets.models import DSV4_FLASH_COMPRESS_RATIOS

    raw = dsv4_flash_model_config().to_hf_dict()
    assert raw["compress_ratios"] == list(DSV4_FLASH_COMPRESS_RATIOS[:43])  # the 44th entry is the MTP layer's
    assert raw["rope_scaling"] == {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                                   "beta_fast": 32.0, "beta_slow": 1.0}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_both_forms_read_back_to_the_same_config(name):
    """The release form we write, and transformers' own form of it (DeepseekV4Config.to_dict), read back equal."""
    cfg = PRESETS[name]()
    raw = cfg.to_hf_dict()
    assert ModelConfig.from_hf_dict(raw) == cfg
    theirs = DeepseekV4Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")}).to_dict()
    assert "layer_types" in theirs and "rope_parameters" in theirs
    assert ModelConfig.from_hf_dict(theirs) == cfg


def test_a_model_the_release_form_cannot_say_keeps_transformers_keys_and_no_ratios():
    raw = _odd().to_hf_dict()
    assert "compress_ratios" not in raw and raw["compress_rates"] == {CSA: 4, HCA: 8}  # SGLang must refuse it loudly
    assert raw["mlp_layer_types"] == [TOPK_MOE, HASH_MOE, TOPK_MOE, TOPK_MOE] and "num_hash_layers" not in raw


def test_rope_scaling_spellings_fold_into_one():
    base = _release().to_hf_dict()
    flat = dict(base["rope_scaling"])
    as_rope_type = {**{k: v for k, v in flat.items() if k != "type"}, "rope_type": "yarn"}
    nested = {"main": {"rope_type": "default", "rope_theta": 10000.0},
              "compress": {**as_rope_type, "rope_theta": 160000.0, "partial_rotary_factor": 0.25,
                           "attention_factor": 1.0}}
    want = ModelConfig.from_hf_dict(base)
    assert ModelConfig.from_hf_dict({**base, "rope_scaling": as_rope_type}) == want
    assert ModelConfig.from_hf_dict({**{k: v for k, v in base.items() if k != "rope_scaling"},
                                     "rope_parameters": nested}) == want


@pytest.mark.parametrize("change, message", [
    ({"compress_ratios": [0, 4, 4, 4]}, "compress_ratios .* disagree with layer_types"),
    ({"qk_rope_head_dim": 32}, "qk_rope_head_dim=32 disagrees with partial_rotary_factor"),
    ({"window_size": 16}, "window_size=16 but sliding_window=24"),
    ({"num_hash_layers": 1, "n_hash_layers": 1}, "num_hash_layers=1 disagrees with mlp_layer_types"),
    ({"n_hash_layers": 1}, "n_hash_layers=1 but num_hash_layers=2"),
])
def test_forms_that_disagree_are_refused_naming_both_keys(change, message):
    cfg = _release()
    mixed = {**cfg.to_hf_dict(), "layer_types": cfg.layer_types, "mlp_layer_types": cfg.mlp_layer_types,
             "partial_rotary_factor": cfg.partial_rotary_factor, "compress_rates": cfg.compress_rates}
    assert ModelConfig.from_hf_dict(mixed) == cfg
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict({**mixed, **change})


@pytest.mark.parametrize("change, message", [
    ({"compress_ratios": [0, 7, 4, 4]}, "compress_ratios has values \\[7\\]; DeepSeek-V4 knows 0 .* 4 .* 128"),
    ({"compress_ratios": [0, 4]}, "compress_ratios has 2 entries but num_hidden_layers is 4"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "lacks \\['original_max_position_embeddings'\\]"),
    ({"rope_scaling": {"type": "linear", "factor": 4.0}}, "rope_scaling type 'linear' is not supported"),
])
def test_bad_release_values_say_how_to_fix(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict({**_release().to_hf_dict(), **change})


def test_layer_types_with_a_wrong_length_say_so():
    with pytest.raises(ValueError, match="layer_types has 3 entries but num_hidden_layers is 4"):
        ModelConfig(**{**_odd().__dict__, "layer_types": [SLIDING, CSA, HCA]})


def test_a_source_config_keeps_what_v4rl_does_not_model_and_loses_its_old_form():
    """An export rewrites a legacy (transformers-form) source config in the release form, extra keys kept."""
    cfg = _release()
    legacy = {**cfg.to_hf_dict(), "layer_types": cfg.layer_types, "compress_rates": cfg.compress_rates,
              "rope_parameters": {"main": {}, "compress": {}}, "torch_dtype": "float32", "use_cache": True,
              "transformers_version": "4.57.1", "compress_ratios": [0, 4, 128, 4, 0]}
    out = hf_config_dict(cfg, weight_format="fp8", expert_dtype="fp8", scale_fmt="ue8m0", base=legacy)
    assert out == {**hf_config_dict(cfg, weight_format="fp8", expert_dtype="fp8", scale_fmt="ue8m0"),
                   "use_cache": True, "transformers_version": "4.57.1"}
    stored = with_release_model_keys(legacy, cfg)  # what `v4rl convert` keeps in common.pt: storage fields too
    assert stored == {**cfg.to_hf_dict(), "torch_dtype": "float32", "use_cache": True, "transformers_version": "4.57.1"}
