"""The two `config.json` forms of a DeepSeek-V4 model: v4rl writes DeepSeek's release form and reads both.

  release       what DeepSeek's released checkpoints carry and what the engines read from config.json:
                SGLang 0.5.23 (`configs/model_config.py`, `models/deepseek_v4.py`, `models/deepseek_v2.py`, which
                load it as a DeepSeek-V3 config), Miles' mbridge bridge (`miles_plugins/mbridge/deepseekv4.py` on
                mbridge's DeepSeek-V3 bridge) and transformers 5.23, which folds the legacy keys into its own.
                Per-layer `compress_ratios` (0 sliding, 4 CSA, 128 HCA), `num_hash_layers`, `qk_rope_head_dim`,
                a flat `rope_scaling` (YaRN with `original_max_position_embeddings`) and V3-template keys.
  transformers  transformers 5.23's DeepseekV4Config fields: `layer_types`, `compress_rates`, `mlp_layer_types`,
                `partial_rotary_factor`, nested `rope_parameters` {main, compress}. SGLang reads none of these:
                a config with only them fails there (`compress_ratios`) or silently takes V3 defaults
                (`num_hash_layers` 0, `qk_rope_head_dim` 64, YaRN factor 1).

A model the release form cannot say (compress rates other than CSA 4 / HCA 128, hash layers that are not the
first ones; such models exist only in tests, and SGLang could not serve them) is written with the
transformers keys for that part, and without `compress_ratios` so that SGLang refuses it loudly.

    >>> raw = release_config_dict(cfg)          # what v4rl writes (no storage fields)
    >>> fields = model_fields_from_json(raw)    # ModelConfig keyword arguments, from either form

Tests: `.venv/bin/python -m pytest tests/test_model_config.py -q`; against SGLang's and transformers' own
readers: `tests/conformance/test_sglang_checkpoints.py`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engines.model.config import ModelConfig

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
HASH_MOE = "hash_moe"
TOPK_MOE = "moe"

RELEASE_RATIO_OF = {SLIDING: 0, CSA: 4, HCA: 128}
"""Attention type -> its `compress_ratios` entry: the only rates SGLang (0/1/2/4/128) and transformers (0/4/128)
both map to a layer type (1 and 2 are DeepSeek-V4.1 compressors)."""
LAYER_TYPE_OF_RATIO = {ratio: kind for kind, ratio in RELEASE_RATIO_OF.items()}

ALIASES = {"window_size": "sliding_window", "n_hash_layers": "num_hash_layers"}
"""Second names of a release key, written beside it: Miles' bridge reads `window_size` and `n_hash_layers` (with
defaults 128 and 3, right for Flash only), SGLang and transformers read `sliding_window` and `num_hash_layers`."""

CONSTANTS: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "num_key_value_heads": 1,  # shared-KV MQA; SGLang asserts it
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "num_nextn_predict_layers": 0,  # v4rl's checkpoints carry no MTP layer (native `mtp.*` is skipped)
    "first_k_dense_replace": 0,  # every layer is MoE; the V3 template's default is 3 dense layers
    "n_group": 1,  # no group-limited routing (V3 default 8 groups, topk_group 4)
    "topk_group": 1,
    "topk_method": "noaux_tc",  # SGLang builds the selection bias (`e_score_correction_bias`) from it
}
"""Keys with one value for every DeepSeek-V4 v4rl writes (SGLang reads each; most are V3-template keys whose
V3 defaults are wrong for V4)."""

TRANSFORMERS_ONLY = ("layer_types", "compress_rates", "mlp_layer_types", "partial_rotary_factor", "rope_parameters")
"""transformers-form keys; written only for what the release form cannot say (see the module docstring)."""

_YARN_BOOKKEEPING = ("rope_theta", "partial_rotary_factor", "rope_type", "type")
"""Keys transformers adds to a RoPE sub-dict that are not scaling parameters (the type is kept as `type`)."""


# ================================================================================================ writing
def release_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """The model part of config.json in the release form, keys sorted (storage fields are checkpoints/hf.py's)."""
    d = dataclasses.asdict(cfg)
    for key in ("layer_types", "mlp_layer_types", "compress_rates", "partial_rotary_factor", "rope_scaling"):
        d.pop(key)
    d.update(CONSTANTS)
    d.update(qk_rope_head_dim=cfg.rope_head_dim, qk_nope_head_dim=cfg.head_dim - cfg.rope_head_dim,
             v_head_dim=cfg.head_dim, kv_lora_rank=cfg.head_dim)  # V3-template MLA keys (Miles' bridge reads them)
    d["window_size"] = cfg.sliding_window
    if cfg.rope_scaling:
        d["rope_scaling"] = dict(cfg.rope_scaling)
    if all(cfg.compress_rates.get(kind) == RELEASE_RATIO_OF[kind] for kind in set(cfg.layer_types) - {SLIDING}):
        d["compress_ratios"] = [RELEASE_RATIO_OF[kind] for kind in cfg.layer_types]
    else:
        d.update(layer_types=list(cfg.layer_types), compress_rates=dict(cfg.compress_rates))
    n_hash = _hash_prefix(cfg.mlp_layer_types)
    if n_hash is not None:
        d["num_hash_layers"] = d["n_hash_layers"] = n_hash
    else:
        d["mlp_layer_types"] = list(cfg.mlp_layer_types)
    return dict(sorted(d.items()))


def _hash_prefix(mlp_layer_types: list[str]) -> int | None:
    """How many leading hash-MoE layers, if the rest are all top-k MoE (what `num_hash_layers` can say)."""
    n = mlp_layer_types.count(HASH_MOE)
    return n if mlp_layer_types == [HASH_MOE] * n + [TOPK_MOE] * (len(mlp_layer_types) - n) else None


# ================================================================================================ reading
def model_fields_from_json(raw: dict[str, Any], field_names: set[str]) -> dict[str, Any]:
    """ModelConfig keyword arguments from a config.json of either form (or a mix, which must agree with itself).

    Where a key is absent the defaults are transformers' (which equal DeepSeek-V4-Flash's). Raises ValueError
    naming the keys that disagree or the value that is not understood, and how to fix it.
    """
    d = dict(raw)
    _check_aliases(d)
    n = int(d.get("num_hidden_layers", 43))
    fields = {k: v for k, v in d.items() if k in field_names}
    layer_types, rates = _attention_types(d, n)
    fields.update(layer_types=layer_types, compress_rates=rates, mlp_layer_types=_mlp_types(d, n),
                  partial_rotary_factor=_rotary_factor(d), rope_scaling=_compress_rope_scaling(d))
    return fields


def _check_aliases(d: dict[str, Any]) -> None:
    for alias, key in ALIASES.items():
        if alias in d and key in d and d[alias] != d[key]:
            raise ValueError(f"config.json has {alias}={d[alias]} but {key}={d[key]}; they name the same value "
                             f"(Miles' bridge reads {alias}, SGLang and transformers {key}): make them equal")
        if alias in d and key not in d:
            d[key] = d[alias]


def _attention_types(d: dict[str, Any], n: int) -> tuple[list[str], dict[str, int]]:
    """(layer_types, compress_rates) from `layer_types` + `compress_rates` or the per-layer `compress_ratios`."""
    rates = dict(d.get("compress_rates") or {CSA: RELEASE_RATIO_OF[CSA], HCA: RELEASE_RATIO_OF[HCA]})
    for kind, legacy in ((CSA, "compress_rate_csa"), (HCA, "compress_rate_hca")):
        if d.get(legacy) is not None:
            rates[kind] = int(d[legacy])
    ratios = d.get("compress_ratios")
    if ratios is not None:
        ratios = [int(r) for r in list(ratios)[:n]]  # the release lists the MTP layer's ratio after the last layer
        if len(ratios) < n:
            raise ValueError(f"config.json compress_ratios has {len(ratios)} entries but num_hidden_layers is {n}; "
                             "give one ratio per layer (0 sliding, 4 CSA, 128 HCA)")
    layer_types = d.get("layer_types")
    if layer_types is not None:
        layer_types = list(layer_types)[:n]
        if ratios is not None:
            implied = [0 if t == SLIDING else rates.get(t) for t in layer_types]
            if implied != ratios:
                raise ValueError(f"config.json compress_ratios {ratios} disagree with layer_types + compress_rates "
                                 f"(which give {implied}); drop one of the two or make them agree")
        return layer_types, rates
    if ratios is None:  # transformers' default: 2x HCA, then CSA/HCA interleaved
        return [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))], rates
    unknown = sorted({r for r in ratios if r not in LAYER_TYPE_OF_RATIO})
    if unknown:
        raise ValueError(f"config.json compress_ratios has values {unknown}; DeepSeek-V4 knows 0 (sliding), 4 (CSA) "
                         "and 128 (HCA) only (for other rates give layer_types + compress_rates)")
    return [LAYER_TYPE_OF_RATIO[r] for r in ratios], {CSA: RELEASE_RATIO_OF[CSA], HCA: RELEASE_RATIO_OF[HCA]}


def _mlp_types(d: dict[str, Any], n: int) -> list[str]:
    n_hash = d.get("num_hash_layers")
    types = d.get("mlp_layer_types")
    if types is not None:
        types = list(types)[:n]
        if n_hash is not None and types.count(HASH_MOE) != int(n_hash):
            raise ValueError(f"config.json num_hash_layers={n_hash} disagrees with mlp_layer_types ({types.count(HASH_MOE)} "
                             "hash_moe entries); drop one of the two or make them agree")
        return types
    n_hash = 3 if n_hash is None else int(n_hash)  # transformers' and Flash's default
    return [HASH_MOE] * min(n, n_hash) + [TOPK_MOE] * max(0, n - n_hash)


def _rotary_factor(d: dict[str, Any]) -> float:
    head_dim = int(d.get("head_dim", 512))
    factor = d.get("partial_rotary_factor")
    rope_dim = d.get("qk_rope_head_dim")
    if factor is None:
        return float(rope_dim) / head_dim if rope_dim else 64 / 512
    if rope_dim is not None and int(head_dim * float(factor)) != int(rope_dim):
        raise ValueError(f"config.json qk_rope_head_dim={rope_dim} disagrees with partial_rotary_factor={factor} x "
                         f"head_dim={head_dim}; drop one of the two or make them agree")
    return float(factor)


def _compress_rope_scaling(d: dict[str, Any]) -> dict[str, Any] | None:
    """The compressed layers' RoPE scaling: nested `rope_parameters.compress` or the flat `rope_scaling`."""
    nested = d.get("rope_parameters")
    if isinstance(nested, dict) and isinstance(nested.get("compress"), dict):
        return canonical_rope_scaling(nested["compress"])
    if isinstance(d.get("rope_scaling"), dict):
        return canonical_rope_scaling(d["rope_scaling"])
    return None


def canonical_rope_scaling(params: dict[str, Any] | None) -> dict[str, Any] | None:
    """One spelling of a RoPE scaling dict, whichever form it came in: None for plain RoPE, else the release's
    flat form (`type` plus the scaling parameters; transformers' bookkeeping keys and its forced YaRN
    `attention_factor` 1.0 dropped)."""
    if not params:
        return None
    kind = params.get("rope_type", params.get("type"))
    if kind in (None, "default"):
        return None
    out = {k: v for k, v in params.items() if k not in _YARN_BOOKKEEPING}
    if kind == "yarn" and out.get("attention_factor") == 1.0:
        del out["attention_factor"]
    return dict(sorted({"type": kind, **out}.items()))
