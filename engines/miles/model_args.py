"""The Megatron model-architecture flags of a DeepSeek-V4 Miles job, derived from the checkpoint's config.json.

Miles' launcher takes these from a hand-written model script (`scripts/models/deepseek-v4-flash.py`); v4rl
derives them from the `config.json` Miles' bridge and SGLang read (DeepSeek's release format), so a pruned or
re-shaped checkpoint gets matching flags. For the real Flash config they equal Miles' script flag by flag
(tests/conformance/test_miles_model_args.py runs Miles' own `load_model_args`), and Miles' `parse_args`
cross-checks hidden size, heads, layers, MoE width, norm epsilon and RoPE base against the same config.

    from engines.presets.flash import flash_config
    model_args(flash_config())[:4]   # ['--disable-bias-linear', '--num-layers', '43', '--hidden-size']

One table (`_FROM_CONFIG`): Megatron flag -> the config.json keys it reads (first present wins) and how.
Missing keys fail naming the key and the fix; nothing falls back to a silent default.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

DSV4_SPEC = ("miles_plugins.models.deepseek_v4.deepseek_v4", "get_dsv4_spec")
"""--spec: Miles' DeepSeek-V4 layer spec (module, function)."""


class ModelConfigError(ValueError):
    """config.json lacks a key (or holds a value) the Miles job needs; the message names it and the fix."""


def num(value: float | int) -> str:
    """A number as Miles' launcher writes it: integral floats without the point, `1e-6` not `1e-06`."""
    if isinstance(value, bool):
        raise TypeError("a bool is not a number here")
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return re.sub(r"e([+-])0*(\d)", lambda m: f"e{'-' if m.group(1) == '-' else ''}{m.group(2)}", repr(float(value)))


class _Config:
    """Key lookup over a config.json dict that fails naming the key (and where it came from)."""

    def __init__(self, raw: Mapping[str, Any], source: str) -> None:
        self.raw, self.source = raw, source

    def get(self, *keys: str, default: Any = ...) -> Any:
        for key in keys:
            if self.raw.get(key) is not None:
                return self.raw[key]
        if default is not ...:
            return default
        raise ModelConfigError(f"{self.source} has no {' / '.join(keys)}; Miles needs it for the model flags. "
                               "Give the checkpoint's config.json in DeepSeek's release format (the keys SGLang and "
                               "Miles' bridge read), e.g. re-export it with `v4rl export`")

    def rope(self, key: str) -> Any:
        scaling = self.get("rope_scaling")
        if not isinstance(scaling, Mapping) or scaling.get(key) is None:
            raise ModelConfigError(f"{self.source} rope_scaling has no {key!r}; DeepSeek-V4's compressed branches "
                                   "use YaRN (rope_scaling: {rope_type: yarn, factor, original_max_position_embeddings, "
                                   "beta_fast, beta_slow})")
        return scaling[key]


def _compress_ratios(c: _Config) -> list[str]:
    ratios = list(c.get("compress_ratios"))
    layers = int(c.get("num_hidden_layers"))
    mtp = int(c.get("num_nextn_predict_layers", default=0))
    if len(ratios) not in (layers, layers + mtp):
        raise ModelConfigError(f"{c.source} compress_ratios has {len(ratios)} entries; expected one per layer "
                               f"({layers}) plus one per MTP layer ({mtp})")
    return [num(r) for r in ratios]


def _moe_layer_freq(c: _Config) -> str:
    layers, dense = int(c.get("num_hidden_layers")), int(c.get("first_k_dense_replace", default=0))
    return "[" + ",".join(["0"] * min(dense, layers) + ["1"] * max(layers - dense, 0)) + "]"


def _shared_expert_size(c: _Config) -> str:
    return num(int(c.get("n_shared_experts")) * int(c.get("moe_intermediate_size")))


_Rule = Callable[[_Config], "str | list[str] | None"]
# Megatron flag -> value from config.json (None: a bare flag). Order = Miles' model script's order.
_FROM_CONFIG: list[tuple[str, _Rule | None]] = [
    ("--disable-bias-linear", None),
    ("--num-layers", lambda c: num(c.get("num_hidden_layers"))),
    ("--hidden-size", lambda c: num(c.get("hidden_size"))),
    # every DeepSeek-V4 layer is MoE, so the dense FFN width is unused; Miles' scripts set it to the expert width
    ("--ffn-hidden-size", lambda c: num(c.get("moe_intermediate_size"))),
    ("--num-attention-heads", lambda c: num(c.get("num_attention_heads"))),
    ("--normalization", lambda c: "RMSNorm"),
    ("--position-embedding-type", lambda c: "rope"),
    ("--norm-epsilon", lambda c: num(c.get("rms_norm_eps"))),
    ("--swiglu", None),
    ("--untie-embeddings-and-output-weights", None),
    ("--vocab-size", lambda c: num(c.get("vocab_size"))),
    ("--hidden-dropout", lambda c: "0.0"),
    ("--attention-dropout", lambda c: "0.0"),
    ("--multi-latent-attention", None),
    ("--q-lora-rank", lambda c: num(c.get("q_lora_rank"))),
    # DeepSeek-V4's single shared KV head is head_dim wide: MLA's kv_lora_rank, qk and v head dims all equal it
    ("--kv-lora-rank", lambda c: num(c.get("kv_lora_rank", "head_dim"))),
    ("--qk-head-dim", lambda c: num(c.get("head_dim"))),
    ("--qk-pos-emb-head-dim", lambda c: num(c.get("qk_rope_head_dim"))),
    ("--v-head-dim", lambda c: num(c.get("v_head_dim", "head_dim"))),
    ("--qk-layernorm", None),
    ("--rotary-scaling-factor", lambda c: num(c.rope("factor"))),
    ("--rotary-base", lambda c: num(c.get("rope_theta"))),
    ("--original-max-position-embeddings", lambda c: num(c.rope("original_max_position_embeddings"))),
    ("--beta-fast", lambda c: num(c.rope("beta_fast"))),
    ("--beta-slow", lambda c: num(c.rope("beta_slow"))),
    ("--attention-softmax-in-fp32", None),
    ("--no-rope-fusion", None),
    ("--num-experts", lambda c: num(c.get("n_routed_experts"))),
    ("--moe-layer-freq", _moe_layer_freq),
    ("--moe-ffn-hidden-size", lambda c: num(c.get("moe_intermediate_size"))),
    ("--moe-router-topk", lambda c: num(c.get("num_experts_per_tok"))),
    ("--moe-shared-expert-intermediate-size", _shared_expert_size),
    ("--moe-router-pre-softmax", None),
    ("--moe-router-score-function", lambda c: str(c.get("scoring_func"))),
    ("--moe-router-enable-expert-bias", None),
    ("--moe-router-load-balancing-type", lambda c: "seq_aux_loss"),
    ("--moe-token-dispatcher-type", lambda c: "alltoall"),
    ("--moe-aux-loss-coeff", lambda c: "0"),
    ("--moe-grouped-gemm", None),
    ("--moe-router-topk-scaling-factor", lambda c: num(c.get("routed_scaling_factor"))),
    ("--experimental-attention-variant", lambda c: "dsv4"),
    ("--dsv4-hc-mult", lambda c: num(c.get("hc_mult"))),
    ("--dsv4-hc-sinkhorn-iters", lambda c: num(c.get("hc_sinkhorn_iters"))),
    ("--dsv4-compress-ratios", _compress_ratios),
    ("--dsv4-compress-rope-theta", lambda c: num(c.get("compress_rope_theta"))),
    ("--dsv4-o-groups", lambda c: num(c.get("o_groups"))),
    ("--dsv4-o-lora-rank", lambda c: num(c.get("o_lora_rank"))),
    ("--dsv4-n-hash-layers", lambda c: num(c.get("num_hash_layers", "n_hash_layers"))),
    ("--dsv4-window-size", lambda c: num(c.get("sliding_window", "window_size"))),
    ("--dsa-indexer-n-heads", lambda c: num(c.get("index_n_heads"))),
    ("--dsa-indexer-head-dim", lambda c: num(c.get("index_head_dim"))),
    ("--dsa-indexer-topk", lambda c: num(c.get("index_topk"))),
    ("--spec", lambda c: list(DSV4_SPEC)),
]
# the SwiGLU clamp (swiglu_limit > 0) needs the unfused activation and leaves the shared expert unclamped
_SWIGLU_LIMIT = ("--activation-func-clamp-value", "--no-bias-swiglu-fusion", "--no-activation-func-clamp-shared-expert")


GEN2_DROPPED = ("--experimental-attention-variant",)
"""Flags Miles' second DeepSeek-V4 generation no longer takes from the model script: its `normalize_dsv4_args`
sets the attention variant from `--dsv4-impl` (dsv4 / dsv4_hybrid), so passing one is ignored at best."""


def model_args(config: Mapping[str, Any], *, source: str = "config.json", generation: int = 1) -> list[str]:
    """The architecture flags of `train.py` for this DeepSeek-V4 config.json dict (release format), as the model
    script of Miles' DeepSeek-V4 `generation` (1 or 2, engines/miles/generation.py) writes them."""
    if generation not in (1, 2):
        raise ModelConfigError(f"Miles DeepSeek-V4 generation must be 1 or 2; got {generation!r}")
    c = _Config(config, source)
    if c.get("model_type", default="deepseek_v4") != "deepseek_v4":
        raise ModelConfigError(f"{source} has model_type {config.get('model_type')!r}; the Miles job is built for "
                               "DeepSeek-V4 (model_type deepseek_v4)")
    if c.get("tie_word_embeddings", default=False):
        raise ModelConfigError(f"{source} ties embeddings; DeepSeek-V4 keeps head and embed apart "
                               "(--untie-embeddings-and-output-weights); set tie_word_embeddings false")
    args: list[str] = []
    for flag, rule in _FROM_CONFIG:
        if generation == 2 and flag in GEN2_DROPPED:
            continue
        value = rule(c) if rule else None
        args += [flag] + ([] if value is None else value if isinstance(value, list) else [value])
    limit = float(c.get("swiglu_limit", default=0.0))
    if limit > 0:
        args += [_SWIGLU_LIMIT[0], num(limit), *_SWIGLU_LIMIT[1:]]
    return args


def read_config(hf_checkpoint: str | Path) -> dict[str, Any]:
    """`<hf_checkpoint>/config.json` as a dict; ModelConfigError naming the file when it is absent or bad."""
    path = Path(hf_checkpoint) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelConfigError(f"{path} does not exist; --hf-checkpoint must be the FP8 HF checkpoint directory "
                               "(config.json, tokenizer, safetensors) SGLang serves") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"cannot read {path}: {exc}") from None
