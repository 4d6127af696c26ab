"""The one DeepSeek-V4 parameter-name table: native <-> transformers <-> SGLang/Miles "HF" names.

Each row of `NAME_TABLE` names one tensor in every column; `{i}` is the layer index, `{e}` the
routed-expert index. Every direction is derived from the same rows, so a name is written once.
A column can hold `FUSED` where that format merges several native tensors into one: transformers
keeps the routed experts of a layer as two stacked tensors, built by `fuse_gate_up` / `fuse_down`
(and split back by `split_gate_up` / `split_down`), see `EXPERT_FUSIONS`. A Megatron column is
added the same way (one more entry per row, one more name in `COLUMNS`).

Sources: transformers' `conversion_mapping.py` ("deepseek_v4") and `modeling_deepseek_v4.py` module
names; SGLang's `DeepseekV4ForCausalLM.remap_weight_name_to_dpsk_hf_format` (what Miles calls).
Scale tensors (`X.scale` native, `X.weight_scale_inv` in HF-style checkpoints) are not in the table:
`checkpoints/hf.py` pairs them with their weight by suffix.

    >>> native_to_transformers_name("layers.3.attn.wq_a.weight")
    'model.layers.3.self_attn.q_a_proj.weight'

Tested by `.venv/bin/python -m pytest tests/test_hf_checkpoint.py -q -k names`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import torch

from engines.model.config import ModelConfig

COLUMNS = ("native", "transformers", "sglang")
FUSED = "<fused>"
"""Marks a column where several native tensors become one (see EXPERT_FUSIONS)."""
IGNORED_NATIVE_PREFIXES = ("mtp.",)
"""Native tensors no format here carries (the MTP head): readers skip them, as transformers does."""

_A = "layers.{i}.attn."
_TA = "model.layers.{i}.self_attn."
_F = "layers.{i}.ffn."
_TF = "model.layers.{i}.mlp."


def _compressor_rows(native: str, tf: str, sgl: str) -> list[tuple[str, str, str]]:
    return [
        (native + "wkv.weight", tf + "kv_proj.weight", sgl + "wkv.weight"),
        (native + "wgate.weight", tf + "gate_proj.weight", sgl + "wgate.weight"),
        (native + "norm.weight", tf + "kv_norm.weight", sgl + "norm.weight"),
        (native + "ape", tf + "position_bias", sgl + "ape"),
    ]


NAME_TABLE: tuple[tuple[str, ...], ...] = tuple([
    # native                            transformers                                  sglang / miles
    ("embed.weight",                     "model.embed_tokens.weight",                  "model.embed_tokens.weight"),
    ("norm.weight",                      "model.norm.weight",                          "model.norm.weight"),
    ("head.weight",                      "lm_head.weight",                             "lm_head.weight"),
    ("hc_head_fn",                       "model.hc_head.hc_fn",                        "model.hc_head_fn"),
    ("hc_head_base",                     "model.hc_head.hc_base",                      "model.hc_head_base"),
    ("hc_head_scale",                    "model.hc_head.hc_scale",                     "model.hc_head_scale"),
    ("layers.{i}.attn_norm.weight",      "model.layers.{i}.input_layernorm.weight",    "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.ffn_norm.weight",       "model.layers.{i}.post_attention_layernorm.weight",
                                         "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.hc_attn_fn",            "model.layers.{i}.attn_hc.fn",                "model.layers.{i}.hc_attn_fn"),
    ("layers.{i}.hc_attn_base",          "model.layers.{i}.attn_hc.base",              "model.layers.{i}.hc_attn_base"),
    ("layers.{i}.hc_attn_scale",         "model.layers.{i}.attn_hc.scale",             "model.layers.{i}.hc_attn_scale"),
    ("layers.{i}.hc_ffn_fn",             "model.layers.{i}.ffn_hc.fn",                 "model.layers.{i}.hc_ffn_fn"),
    ("layers.{i}.hc_ffn_base",           "model.layers.{i}.ffn_hc.base",               "model.layers.{i}.hc_ffn_base"),
    ("layers.{i}.hc_ffn_scale",          "model.layers.{i}.ffn_hc.scale",              "model.layers.{i}.hc_ffn_scale"),
    (_A + "wq_a.weight",                 _TA + "q_a_proj.weight",                      _TA + "wq_a.weight"),
    (_A + "q_norm.weight",               _TA + "q_a_norm.weight",                      _TA + "q_norm.weight"),
    (_A + "wq_b.weight",                 _TA + "q_b_proj.weight",                      _TA + "wq_b.weight"),
    (_A + "wkv.weight",                  _TA + "kv_proj.weight",                       _TA + "wkv.weight"),
    (_A + "kv_norm.weight",              _TA + "kv_norm.weight",                       _TA + "kv_norm.weight"),
    (_A + "wo_a.weight",                 _TA + "o_a_proj.weight",                      _TA + "wo_a.weight"),
    (_A + "wo_b.weight",                 _TA + "o_b_proj.weight",                      _TA + "wo_b.weight"),
    (_A + "attn_sink",                   _TA + "sinks",                                _TA + "attn_sink"),
    *_compressor_rows(_A + "compressor.", _TA + "compressor.", _TA + "compressor."),
    (_A + "indexer.wq_b.weight",         _TA + "compressor.indexer.q_b_proj.weight",   _TA + "indexer.wq_b.weight"),
    (_A + "indexer.weights_proj.weight", _TA + "compressor.indexer.scorer.weights_proj.weight",
                                         _TA + "indexer.weights_proj.weight"),
    *_compressor_rows(_A + "indexer.compressor.", _TA + "compressor.indexer.", _TA + "indexer.compressor."),
    (_F + "gate.weight",                 _TF + "gate.weight",                          _TF + "gate.weight"),
    (_F + "gate.bias",                   _TF + "gate.e_score_correction_bias",         _TF + "gate.e_score_correction_bias"),
    (_F + "gate.tid2eid",                _TF + "gate.tid2eid",                         _TF + "topk.tid2eid"),
    (_F + "experts.{e}.w1.weight",       FUSED,                                        _TF + "experts.{e}.gate_proj.weight"),
    (_F + "experts.{e}.w2.weight",       FUSED,                                        _TF + "experts.{e}.down_proj.weight"),
    (_F + "experts.{e}.w3.weight",       FUSED,                                        _TF + "experts.{e}.up_proj.weight"),
    (_F + "shared_experts.w1.weight",    _TF + "shared_experts.gate_proj.weight",      _TF + "shared_experts.gate_proj.weight"),
    (_F + "shared_experts.w2.weight",    _TF + "shared_experts.down_proj.weight",      _TF + "shared_experts.down_proj.weight"),
    (_F + "shared_experts.w3.weight",    _TF + "shared_experts.up_proj.weight",        _TF + "shared_experts.up_proj.weight"),
])


# ---------------------------------------------------------------------------------------------- expert fusions
def fuse_gate_up(w1: list[torch.Tensor], w3: list[torch.Tensor]) -> torch.Tensor:
    """Per-expert w1 `[I, H]` and w3 `[I, H]` -> transformers' `gate_up_proj` `[E, 2I, H]` (w1 rows first)."""
    return torch.stack([torch.cat([a, b], dim=0) for a, b in zip(w1, w3, strict=True)])


def split_gate_up(gate_up: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Inverse of fuse_gate_up: `[E, 2I, H]` -> (w1 per expert, w3 per expert)."""
    inter = gate_up.shape[1] // 2
    return [g[:inter] for g in gate_up], [g[inter:] for g in gate_up]


def fuse_down(w2: list[torch.Tensor]) -> torch.Tensor:
    """Per-expert w2 `[H, I]` -> transformers' `down_proj` `[E, H, I]`."""
    return torch.stack(list(w2))


def split_down(down: torch.Tensor) -> tuple[list[torch.Tensor]]:
    """Inverse of fuse_down: `[E, H, I]` -> (w2 per expert,)."""
    return (list(down),)


# transformers name -> (native per-expert leaf names, fuse, split)
EXPERT_FUSIONS: dict[str, tuple[tuple[str, ...], Callable[..., torch.Tensor], Callable[..., tuple]]] = {
    _TF + "experts.gate_up_proj": (("w1", "w3"), fuse_gate_up, split_gate_up),
    _TF + "experts.down_proj": (("w2",), fuse_down, split_down),
}


# ---------------------------------------------------------------------------------------------- lookups
_INDEX_RE = re.compile(r"(?<=layers\.)(\d+)(?=\.)|(?<=experts\.)(\d+)(?=\.)")


def _template(name: str) -> tuple[str, dict[str, str]]:
    """`layers.3.ffn.experts.7.w1.weight` -> (`layers.{i}.ffn.experts.{e}.w1.weight`, {i: 3, e: 7})."""
    found: dict[str, str] = {}

    def sub(m: re.Match) -> str:
        key = "i" if m.group(1) is not None else "e"
        found[key] = m.group(0)
        return "{" + key + "}"

    return _INDEX_RE.sub(sub, name), found


def _column_map(src: str, dst: str) -> dict[str, str]:
    a, b = COLUMNS.index(src), COLUMNS.index(dst)
    out: dict[str, str] = {}
    for row in NAME_TABLE:
        if row[a] == FUSED:
            continue
        if row[a] in out:
            raise AssertionError(f"NAME_TABLE column {src} lists {row[a]} twice")
        out[row[a]] = row[b]
    return out


_MAPS = {(s, d): _column_map(s, d) for s in COLUMNS for d in COLUMNS if s != d}


def convert_name(name: str, src: str, dst: str) -> str:
    """Rename one tensor between columns; ValueError on an unknown name or a fused target."""
    template, idx = _template(name)
    if src == "transformers" and template in EXPERT_FUSIONS:
        raise ValueError(f"transformers tensor {name!r} is fused from all routed experts of a layer; "
                         "use transformers_to_native")
    try:
        target = _MAPS[(src, dst)][template]
    except KeyError:
        raise ValueError(f"unknown {src} DeepSeek-V4 tensor name {name!r}: it has no row in "
                         "checkpoints/names.py NAME_TABLE (a different model, or a name this table lacks)") from None
    if target == FUSED:
        raise ValueError(f"{src} tensor {name!r} is fused with the other experts in the {dst} format; "
                         f"use native_to_{dst}")
    return target.format(**idx)


def native_to_transformers_name(name: str) -> str:
    return convert_name(name, "native", "transformers")


def transformers_to_native_name(name: str) -> str:
    return convert_name(name, "transformers", "native")


def native_to_sglang_name(name: str) -> str:
    return convert_name(name, "native", "sglang")


def sglang_to_native_name(name: str) -> str:
    return convert_name(name, "sglang", "native")


# ---------------------------------------------------------------------------------------------- state dicts
_EXPERT_RE = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")


def native_to_transformers(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Native names -> transformers' DeepseekV4ForCausalLM state_dict names (routed experts fused)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, tensor in state.items():
        m = _EXPERT_RE.match(name)
        if m:
            layer, e, leaf = int(m.group(1)), int(m.group(2)), m.group(3)
            if e >= cfg.n_routed_experts:
                raise ValueError(f"tensor {name!r}: expert {e} is out of range, the config has "
                                 f"n_routed_experts={cfg.n_routed_experts}")
            experts.setdefault((layer, leaf), {})[e] = tensor
            continue
        out[native_to_transformers_name(name)] = tensor
    layers = sorted({layer for layer, _ in experts})
    for layer in layers:
        for fused_template, (leaves, fuse, _split) in EXPERT_FUSIONS.items():
            per_leaf = []
            for leaf in leaves:
                got = experts.pop((layer, leaf), {})
                missing = [e for e in range(cfg.n_routed_experts) if e not in got]
                if missing:
                    raise ValueError(f"tensor layers.{layer}.ffn.experts.{missing[0]}.{leaf}.weight is missing; "
                                     f"transformers fuses all {cfg.n_routed_experts} experts of a layer")
                per_leaf.append([got[e] for e in range(cfg.n_routed_experts)])
            out[fused_template.format(i=layer)] = fuse(*per_leaf)
    return out


def transformers_to_native(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """transformers' DeepseekV4ForCausalLM state_dict names -> native names (routed experts split)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        template, idx = _template(name)
        fusion = EXPERT_FUSIONS.get(template)
        if fusion is None:
            out[transformers_to_native_name(name)] = tensor
            continue
        leaves, _fuse, split = fusion
        if tensor.ndim != 3 or tensor.shape[0] != cfg.n_routed_experts:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}; expected [n_routed_experts="
                             f"{cfg.n_routed_experts}, ...] stacked experts")
        for leaf, per_expert in zip(leaves, split(tensor), strict=True):
            for e, t in enumerate(per_expert):
                out[f"layers.{idx['i']}.ffn.experts.{e}.{leaf}.weight"] = t
    return out
