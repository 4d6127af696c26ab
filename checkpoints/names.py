"""The one DeepSeek-V4 parameter-name table: native <-> transformers <-> SGLang/Miles "HF" <-> Megatron.

Each row of `NAME_TABLE` names one native tensor in every column; `{i}` is the layer index, `{e}` the
routed-expert index. Every direction is derived from the same rows, so a name is written once.

A column holds a `Part` where that format fuses several native tensors into one: the native tensor
is block `index` of `parts` equal blocks along dim 0 of the fused tensor, and when the native name has
an `{e}` the fused tensor also stacks all routed experts along a new leading axis. So
  transformers `mlp.experts.gate_up_proj`  [E, 2I, H] = per expert cat(w1, w3)   (w2 -> down_proj [E, H, I])
  Megatron `mlp.experts.experts.linear_fc1.weight` [E, 2I, H] = per expert cat(w1, w3)   (w2 -> linear_fc2)
  Megatron `mlp.shared_experts.linear_fc1.weight` [2I, H] = cat(w1, w3) of the shared expert
Whole-state fusion (`native_to_megatron`, `native_to_transformers`), splitting, and the streaming
converters' per-tensor placement (`placement`: which fused tensor, at which offsets) all read the
same `Part`s.

A column holds a tuple of `Part`s (`Split`) where that format stores ONE native tensor as several: Megatron's
HyperConnectionModule keeps each mHC scale `hc_*_scale` [3] as `alpha_pre`, `alpha_post`, `alpha_res` [1]
(blocks 0, 1, 2, DeepSeek's packed order). `placements` gives every box of such a tensor.

Two Megatron columns, one per Miles DeepSeek-V4 generation (`MegatronNames`, engines/miles/generation.py
tells a checkout's apart): `megatron`, Miles' plugin names (Miles 31f1ca961 + Megatron-LM 2e64d788b,
`self_attention.wq_a.weight`, `hc_attn_scale`, `hc_head_params.hc_head_fn`); `megatron2`, Megatron's names
(Miles e9e19b223 + Megatron-LM 6184c094a: `self_attention.linear_q_down_proj.weight`, `linear_o_group_proj`
without `.weight`, sink/compressor/indexer under `self_attention.core_attention.`, `*_hyper_connection.
mapping_proj.weight|bias|alpha_*`, `decoder.hc_head_*`). Both follow Miles' bridge of their generation
(`miles_plugins/mbridge/deepseekv4.py`, reference/miles-sglang-megatron.md §1.5, §3) and its model's
`sharded_state_dict()` (118 keys tiny / 1242 Flash; 134 / 1414): per-layer keys `decoder.layers.<i>.…`,
routed experts stacked as torch_dist stores them; `detect_megatron_names` reads a key set's generation. Sources for the other columns: transformers' `conversion_mapping.py`
("deepseek_v4") and `modeling_deepseek_v4.py`; SGLang's `remap_weight_name_to_dpsk_hf_format`.
Scale tensors (`X.scale` native, `X.weight_scale_inv` HF-style) are not in the table:
`checkpoints/hf.py` pairs them with their weight by suffix.

    >>> native_to_transformers_name("layers.3.attn.wq_a.weight")
    'model.layers.3.self_attn.q_a_proj.weight'
    >>> native_to_megatron_name("layers.3.ffn.gate.bias")
    'decoder.layers.3.mlp.router.expert_bias'

    >>> native_to_megatron_name("layers.3.attn.wo_a.weight", "megatron")
    'decoder.layers.3.self_attention.linear_o_group_proj'

Tested by `.venv/bin/python -m pytest tests/test_hf_checkpoint.py tests/test_names_megatron.py -q -k names`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from engines.model.config import ModelConfig


@dataclass(frozen=True)
class Part:
    """A native tensor's place inside a fused tensor of another format (see module docstring)."""

    name: str
    """Name template of the fused tensor (`{i}` only: the expert index becomes an axis)."""
    index: int
    """Which of the `parts` equal blocks along dim 0 this native tensor is (gate = 0, up = 1)."""
    parts: int
    """How many native tensors are concatenated along dim 0 (2 for gate+up, 1 for a plain stack)."""


Split = tuple[Part, ...]
"""A column entry where that format stores ONE native tensor as several tensors: tensor `part.name` is block
`part.index` of `part.parts` equal blocks along dim 0 of the native tensor (the mHC scale `[3]` -> alpha_pre,
alpha_post, alpha_res `[1]` each in Megatron's names). The same `Part`, read the other way round."""
Entry = str | Part | Split
COLUMNS = ("native", "transformers", "sglang", "megatron", "megatron2")
"""`megatron`: Miles' DeepSeek-V4 plugin names (Miles 31f1ca961 + Megatron-LM 2e64d788b, the first generation);
`megatron2`: Megatron's own names (Miles e9e19b223 "DeepSeek-V4 support-v2" + Megatron-LM 6184c094a)."""
MegatronNames = Literal["plugin", "megatron"]
"""Which Megatron names a torch_dist checkpoint uses: `plugin` (Miles' first DeepSeek-V4 generation) or
`megatron` (Megatron's names, Miles' second generation); engines/miles/generation.py tells them apart."""
MEGATRON_NAMES: tuple[MegatronNames, ...] = ("plugin", "megatron")
MEGATRON_COLUMN: dict[str, str] = {"plugin": "megatron", "megatron": "megatron2"}
"""MegatronNames -> its NAME_TABLE column."""
IGNORED_NATIVE_PREFIXES = ("mtp.",)
"""Native tensors no format here carries (the MTP head): readers skip them, as transformers does."""

_A = "layers.{i}.attn."
_TA = "model.layers.{i}.self_attn."
_MA = "decoder.layers.{i}.self_attention."
_M2A = "decoder.layers.{i}.self_attention.core_attention."
_F = "layers.{i}.ffn."
_TF = "model.layers.{i}.mlp."
_MF = "decoder.layers.{i}.mlp."
_ALPHAS = ("alpha_pre", "alpha_post", "alpha_res")
"""Megatron's HyperConnectionModule scalars, in the order DeepSeek's packed `hc_*_scale` [3] holds them."""


def _compressor_rows(native: str, tf: str, sgl: str, meg: str, meg2: str) -> list[tuple[str, ...]]:
    return [
        (native + "wkv.weight", tf + "kv_proj.weight", sgl + "wkv.weight", meg + "wkv.weight",
         meg2 + "linear_wkv.weight"),
        (native + "wgate.weight", tf + "gate_proj.weight", sgl + "wgate.weight", meg + "wgate.weight",
         meg2 + "linear_wgate.weight"),
        (native + "norm.weight", tf + "kv_norm.weight", sgl + "norm.weight", meg + "norm.weight", meg2 + "norm.weight"),
        (native + "ape", tf + "position_bias", sgl + "ape", meg + "ape", meg2 + "ape"),
    ]


def _attn(native_tail: str, tf_tail: str, meg2: str) -> tuple[str, ...]:
    """A layer-level attention row whose SGLang and plugin names keep the native leaf."""
    return (_A + native_tail, _TA + tf_tail, _TA + native_tail, _MA + native_tail, meg2)


def _hc_rows(native: str, tf: str, meg2: str) -> list[tuple[Entry, ...]]:
    """One mHC site (`attn` or `ffn`): fn, base and the packed scale, split into Megatron's three alphas."""
    return [
        (f"layers.{{i}}.hc_{native}_fn", f"model.layers.{{i}}.{tf}.fn", f"model.layers.{{i}}.hc_{native}_fn",
         f"decoder.layers.{{i}}.hc_{native}_fn", meg2 + "mapping_proj.weight"),
        (f"layers.{{i}}.hc_{native}_base", f"model.layers.{{i}}.{tf}.base", f"model.layers.{{i}}.hc_{native}_base",
         f"decoder.layers.{{i}}.hc_{native}_base", meg2 + "bias"),
        (f"layers.{{i}}.hc_{native}_scale", f"model.layers.{{i}}.{tf}.scale", f"model.layers.{{i}}.hc_{native}_scale",
         f"decoder.layers.{{i}}.hc_{native}_scale",
         tuple(Part(meg2 + alpha, k, len(_ALPHAS)) for k, alpha in enumerate(_ALPHAS))),
    ]


def _fc1(prefix: str) -> tuple[Part, Part]:
    return Part(prefix + "linear_fc1.weight", 0, 2), Part(prefix + "linear_fc1.weight", 1, 2)


_GATE_UP = Part(_TF + "experts.gate_up_proj", 0, 2), Part(_TF + "experts.gate_up_proj", 1, 2)
_FC1 = _fc1(_MF + "experts.experts.")
_SHARED_FC1 = _fc1(_MF + "shared_experts.")
_FC2 = Part(_MF + "experts.experts.linear_fc2.weight", 0, 1)

NAME_TABLE: tuple[tuple[Entry, ...], ...] = tuple([
    # native / transformers / sglang (miles HF) / megatron (plugin names, Miles gen 1) / megatron2 (Megatron's, gen 2)
    ("embed.weight", "model.embed_tokens.weight", "model.embed_tokens.weight", "embedding.word_embeddings.weight",
     "embedding.word_embeddings.weight"),
    ("norm.weight", "model.norm.weight", "model.norm.weight", "decoder.final_layernorm.weight",
     "decoder.final_layernorm.weight"),
    ("head.weight", "lm_head.weight", "lm_head.weight", "output_layer.weight", "output_layer.weight"),
    ("hc_head_fn", "model.hc_head.hc_fn", "model.hc_head_fn", "decoder.hc_head_params.hc_head_fn",
     "decoder.hc_head_fn"),
    ("hc_head_base", "model.hc_head.hc_base", "model.hc_head_base", "decoder.hc_head_params.hc_head_base",
     "decoder.hc_head_base"),
    ("hc_head_scale", "model.hc_head.hc_scale", "model.hc_head_scale", "decoder.hc_head_params.hc_head_scale",
     "decoder.hc_head_scale"),
    ("layers.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight",
     "model.layers.{i}.input_layernorm.weight", "decoder.layers.{i}.input_layernorm.weight",
     "decoder.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight",
     "model.layers.{i}.post_attention_layernorm.weight", "decoder.layers.{i}.pre_mlp_layernorm.weight",
     "decoder.layers.{i}.pre_mlp_layernorm.weight"),
    *_hc_rows("attn", "attn_hc", "decoder.layers.{i}.self_attention_hyper_connection."),
    *_hc_rows("ffn", "ffn_hc", "decoder.layers.{i}.mlp_hyper_connection."),
    _attn("wq_a.weight", "q_a_proj.weight", _MA + "linear_q_down_proj.weight"),
    _attn("q_norm.weight", "q_a_norm.weight", _MA + "q_layernorm.weight"),
    _attn("wq_b.weight", "q_b_proj.weight", _MA + "linear_q_up_proj.weight"),
    _attn("wkv.weight", "kv_proj.weight", _MA + "linear_kv_proj.weight"),
    _attn("kv_norm.weight", "kv_norm.weight", _MA + "kv_layernorm.weight"),
    _attn("wo_a.weight", "o_a_proj.weight", _MA + "linear_o_group_proj"),  # a bare Parameter there: no `.weight`
    _attn("wo_b.weight", "o_b_proj.weight", _MA + "linear_proj.weight"),
    _attn("attn_sink", "sinks", _M2A + "attn_sink"),
    *_compressor_rows(_A + "compressor.", _TA + "compressor.", _TA + "compressor.", _MA + "compressor.",
                      _M2A + "compressor."),
    (_A + "indexer.wq_b.weight", _TA + "compressor.indexer.q_b_proj.weight", _TA + "indexer.wq_b.weight",
     _MA + "indexer.linear_wq_b.weight", _M2A + "indexer.linear_wq_b.weight"),
    (_A + "indexer.weights_proj.weight", _TA + "compressor.indexer.scorer.weights_proj.weight",
     _TA + "indexer.weights_proj.weight", _MA + "indexer.linear_weights_proj.weight",
     _M2A + "indexer.linear_weights_proj.weight"),
    *_compressor_rows(_A + "indexer.compressor.", _TA + "compressor.indexer.", _TA + "indexer.compressor.",
                      _MA + "indexer.compressor.", _M2A + "indexer.compressor."),
    (_F + "gate.weight", _TF + "gate.weight", _TF + "gate.weight", _MF + "router.weight", _MF + "router.weight"),
    (_F + "gate.bias", _TF + "gate.e_score_correction_bias", _TF + "gate.e_score_correction_bias",
     _MF + "router.expert_bias", _MF + "router.expert_bias"),
    (_F + "gate.tid2eid", _TF + "gate.tid2eid", _TF + "topk.tid2eid", _MF + "router.tid2eid", _MF + "router.tid2eid"),
    (_F + "experts.{e}.w1.weight", _GATE_UP[0], _TF + "experts.{e}.gate_proj.weight", _FC1[0], _FC1[0]),
    (_F + "experts.{e}.w2.weight", Part(_TF + "experts.down_proj", 0, 1), _TF + "experts.{e}.down_proj.weight",
     _FC2, _FC2),
    (_F + "experts.{e}.w3.weight", _GATE_UP[1], _TF + "experts.{e}.up_proj.weight", _FC1[1], _FC1[1]),
    (_F + "shared_experts.w1.weight", _TF + "shared_experts.gate_proj.weight", _TF + "shared_experts.gate_proj.weight",
     _SHARED_FC1[0], _SHARED_FC1[0]),
    (_F + "shared_experts.w2.weight", _TF + "shared_experts.down_proj.weight", _TF + "shared_experts.down_proj.weight",
     _MF + "shared_experts.linear_fc2.weight", _MF + "shared_experts.linear_fc2.weight"),
    (_F + "shared_experts.w3.weight", _TF + "shared_experts.up_proj.weight", _TF + "shared_experts.up_proj.weight",
     _SHARED_FC1[1], _SHARED_FC1[1]),
])


# ---------------------------------------------------------------------------------------------- name lookups
_INDEX_RE = re.compile(r"(?<=layers\.)(\d+)(?=\.)|(?<=experts\.)(\d+)(?=\.)")


def _template(name: str) -> tuple[str, dict[str, str]]:
    """`layers.3.ffn.experts.7.w1.weight` -> (`layers.{i}.ffn.experts.{e}.w1.weight`, {i: 3, e: 7})."""
    found: dict[str, str] = {}

    def sub(m: re.Match) -> str:
        key = "i" if m.group(1) is not None else "e"
        found[key] = m.group(0)
        return "{" + key + "}"

    return _INDEX_RE.sub(sub, name), found


def _column_map(src: str, dst: str) -> dict[str, Entry]:
    a, b = COLUMNS.index(src), COLUMNS.index(dst)
    out: dict[str, Entry] = {}
    for row in NAME_TABLE:
        if not isinstance(row[a], str):
            continue
        if row[a] in out:
            raise AssertionError(f"NAME_TABLE column {src} lists {row[a]} twice")
        out[row[a]] = row[b]
    return out


def _fused_rows(column: str) -> dict[str, list[tuple[str, Part]]]:
    """Fused name template -> [(native template, Part)] of the rows that feed it, in table order."""
    c = COLUMNS.index(column)
    out: dict[str, list[tuple[str, Part]]] = {}
    for row in NAME_TABLE:
        if isinstance(row[c], Part):
            out.setdefault(row[c].name, []).append((row[0], row[c]))
    for name, rows in out.items():
        got = sorted(p.index for _, p in rows)
        if got != list(range(rows[0][1].parts)) or len({"{e}" in n for n, _ in rows}) != 1:
            raise AssertionError(f"NAME_TABLE column {column}: the parts of {name} are {got}; "
                                 "each fused tensor needs every block once and all-or-none stacked experts")
    return out


def _split_rows(column: str) -> dict[str, tuple[str, Part]]:
    """Split-part name template -> (native template it is cut from, its Part)."""
    c = COLUMNS.index(column)
    out: dict[str, tuple[str, Part]] = {}
    for row in NAME_TABLE:
        if isinstance(row[c], tuple):
            parts = row[c]
            if sorted(p.index for p in parts) != list(range(len(parts))) or {p.parts for p in parts} != {len(parts)}:
                raise AssertionError(f"NAME_TABLE column {column}: the split of {row[0]} must list blocks "
                                     f"0..{len(parts) - 1} once each")
            out.update({p.name: (row[0], p) for p in parts})
    return out


_MAPS = {(s, d): _column_map(s, d) for s in COLUMNS for d in COLUMNS if s != d}
_FUSED = {c: _fused_rows(c) for c in COLUMNS[1:]}
_SPLIT = {c: _split_rows(c) for c in COLUMNS[1:]}
_NATIVE_ENTRY = {c: {row[0]: row[COLUMNS.index(c)] for row in NAME_TABLE} for c in COLUMNS[1:]}


def convert_name(name: str, src: str, dst: str) -> str:
    """Rename one tensor between columns; ValueError on an unknown name or a fused/split source or target."""
    if src not in COLUMNS or dst not in COLUMNS:
        raise ValueError(f"columns are {COLUMNS}; got {src!r} -> {dst!r}")
    template, idx = _template(name)
    if src != "native" and template in _FUSED[src]:
        raise ValueError(f"{src} tensor {name!r} is fused from several native tensors; use {src}_to_native")
    if src != "native" and template in _SPLIT[src]:
        native = _SPLIT[src][template][0].format(**idx)
        raise ValueError(f"{src} tensor {name!r} is one block of native tensor {native!r}, split into several "
                         f"tensors; use format_to_native(..., {src!r})")
    try:
        target = _MAPS[(src, dst)][template]
    except KeyError:
        raise ValueError(f"unknown {src} DeepSeek-V4 tensor name {name!r}: it has no row in "
                         "checkpoints/names.py NAME_TABLE (a different model, or a name this table lacks)") from None
    if isinstance(target, Part):
        raise ValueError(f"{src} tensor {name!r} is fused with other tensors into {target.name.format(**idx)} "
                         f"in the {dst} format; use native_to_{dst} or placement()")
    if isinstance(target, tuple):
        raise ValueError(f"{src} tensor {name!r} is split into {', '.join(p.name.format(**idx) for p in target)} "
                         f"in the {dst} format; use native_to_format(..., {dst!r}) or placements()")
    return target.format(**idx)


def megatron_column(names: str) -> str:
    """The NAME_TABLE column of a MegatronNames value (`plugin` -> megatron, `megatron` -> megatron2)."""
    try:
        return MEGATRON_COLUMN[names]
    except KeyError:
        raise ValueError(f"Megatron names must be one of {', '.join(MEGATRON_NAMES)}; got {names!r}") from None


def _known_templates(column: str) -> set[str]:
    c = COLUMNS.index(column)
    out: set[str] = set()
    for row in NAME_TABLE:
        entry = row[c]
        out.update([entry] if isinstance(entry, str) else [entry.name] if isinstance(entry, Part)
                   else [p.name for p in entry])
    return out


_KNOWN = {names: _known_templates(MEGATRON_COLUMN[names]) for names in MEGATRON_NAMES}


def detect_megatron_names(keys: Iterable[str], *, where: str = "the checkpoint",
                          default: MegatronNames | None = None) -> MegatronNames:
    """Which Megatron names a set of torch_dist keys uses, from the keys only one generation has.

    Keys neither generation knows (optimizer state, TE `_extra_state`) are ignored; a set with keys of both
    generations raises ValueError naming `where` and example keys, and so does a set with none of either
    unless `default` is given (keys both generations share read the same under either).
    """
    only: dict[str, list[str]] = {names: [] for names in MEGATRON_NAMES}
    for key in keys:
        template, _ = _template(key)
        homes = [names for names in MEGATRON_NAMES if template in _KNOWN[names]]
        if len(homes) == 1:
            only[homes[0]].append(key)
    found = [names for names in MEGATRON_NAMES if only[names]]
    if len(found) == 1:
        return found[0]  # type: ignore[return-value]
    if not found and default is not None:
        return default
    if not found:
        raise ValueError(f"{where} holds no DeepSeek-V4 tensor under either Megatron naming (Miles' plugin names "
                         "or Megatron's); is it a DeepSeek-V4 torch_dist checkpoint?")
    raise ValueError(f"{where} mixes Miles' plugin names (e.g. {only['plugin'][0]!r}) and Megatron's names (e.g. "
                     f"{only['megatron'][0]!r}); re-convert it with `v4rl convert --megatron-names plugin|megatron`")


def native_to_transformers_name(name: str) -> str:
    return convert_name(name, "native", "transformers")


def transformers_to_native_name(name: str) -> str:
    return convert_name(name, "transformers", "native")


def native_to_sglang_name(name: str) -> str:
    return convert_name(name, "native", "sglang")


def sglang_to_native_name(name: str) -> str:
    return convert_name(name, "sglang", "native")


def native_to_megatron_name(name: str, names: str = "plugin") -> str:
    return convert_name(name, "native", megatron_column(names))


def megatron_to_native_name(name: str, names: str = "plugin") -> str:
    return convert_name(name, megatron_column(names), "native")


# ---------------------------------------------------------------------------------------------- placement
@dataclass(frozen=True)
class Placement:
    """Where one native tensor (or a block of its rows) lands in another format: a box of a (possibly fused)
    tensor."""

    name: str
    """Tensor name in the target format."""
    offsets: tuple[int, ...]
    """Start of the box along every axis of the target tensor."""
    sizes: tuple[int, ...]
    """Box extent: the native shape (its `source_rows` block when split), with a leading 1 when experts are
    stacked."""
    global_shape: tuple[int, ...]
    """Full shape of the target tensor."""
    source_rows: tuple[int, int] | None = None
    """Rows `[start, stop)` along dim 0 of the native tensor this box holds when the format splits the native
    tensor into several tensors (a `Split` entry); None: the whole native tensor."""

    @property
    def whole(self) -> bool:
        return self.sizes == self.global_shape

    def take(self, native: torch.Tensor) -> torch.Tensor:
        """The part of native tensor `native` this box holds, shaped as the box."""
        part = native if self.source_rows is None else native[self.source_rows[0]:self.source_rows[1]]
        return part.reshape(self.sizes)


def placements(native_name: str, shape: tuple[int, ...], column: str, n_experts: int) -> tuple[Placement, ...]:
    """Every box of the `column` format that holds (part of) native tensor `native_name` of logical `shape`:
    one, or one per block where the format splits the tensor. `n_experts` is the routed-expert count (the
    stacked axis). Streaming converters write each native tensor as chunks of fused tensors with this, without
    ever holding a fused tensor."""
    template, idx = _template(native_name)
    try:
        entry = _NATIVE_ENTRY[column][template]
    except KeyError:
        raise ValueError(f"unknown native DeepSeek-V4 tensor name {native_name!r}: it has no row in "
                         "checkpoints/names.py NAME_TABLE") from None
    shape = tuple(int(s) for s in shape)
    if isinstance(entry, str):
        return (Placement(entry.format(**idx), (0,) * len(shape), shape, shape),)
    if isinstance(entry, tuple):
        rows, rest = shape[0] // len(entry), shape[1:]
        if rows * len(entry) != shape[0]:
            raise ValueError(f"tensor {native_name!r} has shape {shape}; the {column} format splits it into "
                             f"{len(entry)} equal row blocks")
        return tuple(Placement(p.name.format(**idx), (0,) * len(shape), (rows, *rest), (rows, *rest),
                               (p.index * rows, (p.index + 1) * rows)) for p in entry)
    rows = shape[0]
    fused = (entry.parts * rows, *shape[1:])
    offsets = (entry.index * rows,) + (0,) * (len(shape) - 1)
    if "e" in idx:
        e = int(idx["e"])
        if e >= n_experts:
            raise ValueError(f"tensor {native_name!r}: expert {e} is out of range (n_routed_experts={n_experts})")
        return (Placement(entry.name.format(**idx), (e, *offsets), (1, *shape), (n_experts, *fused)),)
    return (Placement(entry.name.format(**idx), offsets, shape, fused),)


def placement(native_name: str, shape: tuple[int, ...], column: str, n_experts: int) -> Placement:
    """The one box of `column` that holds native tensor `native_name` (see `placements`); ValueError where the
    format splits it into several tensors."""
    found = placements(native_name, shape, column, n_experts)
    if len(found) != 1:
        raise ValueError(f"the {column} format splits native tensor {native_name!r} into "
                         f"{', '.join(p.name for p in found)}; use placements()")
    return found[0]


def _box(t: torch.Tensor, p: Placement) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(p.offsets, p.sizes))]


# ---------------------------------------------------------------------------------------------- state dicts
def native_to_format(state: Mapping[str, torch.Tensor], cfg: ModelConfig, column: str) -> dict[str, torch.Tensor]:
    """Native state -> `column` names, fused tensors assembled, split ones cut; every fused tensor must be
    complete."""
    out: dict[str, torch.Tensor] = {}
    filled: dict[str, set[tuple[int, ...]]] = {}
    for name, tensor in state.items():
        for p in placements(name, tuple(tensor.shape), column, cfg.n_routed_experts):
            if p.whole:
                out[p.name] = p.take(tensor)
                continue
            if p.name not in out:
                out[p.name] = torch.empty(p.global_shape, dtype=tensor.dtype)
                filled[p.name] = set()
            _box(out[p.name], p).copy_(p.take(tensor))
            filled[p.name].add(p.offsets)
    for fused, boxes in filled.items():
        template, idx = _template(fused)
        for native_template, part in _FUSED[column][template]:
            experts = range(cfg.n_routed_experts) if "{e}" in native_template else [None]
            for e in experts:
                native = native_template.format(**idx, **({} if e is None else {"e": e}))
                rows = out[fused].shape[1 if e is not None else 0] // part.parts
                want = ((e,) if e is not None else ()) + (part.index * rows,)
                if not any(b[: len(want)] == want for b in boxes):
                    raise ValueError(f"tensor {native} is missing; {column} fuses it into {fused}, so every "
                                     f"tensor of that group is needed (n_routed_experts={cfg.n_routed_experts})")
    return out


def format_to_native(state: Mapping[str, torch.Tensor], cfg: ModelConfig, column: str) -> dict[str, torch.Tensor]:
    """`column` state -> native names, fused tensors split back (views of the inputs), split ones joined."""
    out: dict[str, torch.Tensor] = {}
    blocks: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in state.items():
        template, idx = _template(name)
        if template in _SPLIT[column]:
            native_template, part = _SPLIT[column][template]
            blocks.setdefault(native_template.format(**idx), {})[part.index] = tensor
            continue
        rows = _FUSED[column].get(template)
        if rows is None:
            out[convert_name(name, column, "native")] = tensor
            continue
        stacked = "{e}" in rows[0][0]
        parts = rows[0][1].parts
        body = tensor.shape[1:] if stacked else tensor.shape
        if (stacked and (tensor.ndim < 2 or tensor.shape[0] != cfg.n_routed_experts)) or body[0] % parts:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}; expected "
                             f"{'[n_routed_experts=' + str(cfg.n_routed_experts) + ', ' if stacked else '['}"
                             f"{parts} x rows, ...] (fused from {len(rows)} native tensors)")
        n = body[0] // parts
        for native_template, part in rows:
            for e in range(cfg.n_routed_experts) if stacked else [None]:
                sub = tensor[e] if e is not None else tensor
                native = native_template.format(**idx, **({} if e is None else {"e": e}))
                out[native] = sub[part.index * n:(part.index + 1) * n]
    for native, got in blocks.items():
        template, idx = _template(native)
        split = _NATIVE_ENTRY[column][template]
        missing = [p.name.format(**idx) for p in split if p.index not in got]  # type: ignore[union-attr]
        if missing:
            raise ValueError(f"tensor {missing[0]} is missing; {column} splits native {native!r} into "
                             f"{len(split)} tensors and every one is needed to rebuild it")
        out[native] = torch.cat([got[k].reshape(-1, *got[k].shape[1:]) for k in range(len(split))])
    return out


def native_to_transformers(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Native names -> transformers' DeepseekV4ForCausalLM state_dict names (routed experts fused)."""
    return native_to_format(state, cfg, "transformers")


def transformers_to_native(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """transformers' DeepseekV4ForCausalLM state_dict names -> native names (routed experts split)."""
    return format_to_native(state, cfg, "transformers")


def native_to_megatron(state: Mapping[str, torch.Tensor], cfg: ModelConfig,
                       names: str = "plugin") -> dict[str, torch.Tensor]:
    """Native names -> Megatron torch_dist keys under `names` (routed experts stacked, gate/up fused as
    linear_fc1; with Megatron's names each mHC scale split into its three alphas)."""
    return native_to_format(state, cfg, megatron_column(names))


def megatron_to_native(state: Mapping[str, torch.Tensor], cfg: ModelConfig,
                       names: str | None = None) -> dict[str, torch.Tensor]:
    """Megatron torch_dist keys -> native names (experts unstacked, linear_fc1 split into w1/w3, alphas joined);
    `names` None: detected from the keys (`detect_megatron_names`)."""
    names = names or detect_megatron_names(state, where="the Megatron state", default="plugin")
    return format_to_native(state, cfg, megatron_column(names))


# ---------------------------------------------------------------------------------------------- expert fusions
def fuse_gate_up(w1: list[torch.Tensor], w3: list[torch.Tensor]) -> torch.Tensor:
    """Per-expert w1 `[I, H]` and w3 `[I, H]` -> a `[E, 2I, H]` stack (w1 rows first), as the table's Parts say."""
    return torch.stack([torch.cat([a, b], dim=0) for a, b in zip(w1, w3, strict=True)])


def split_gate_up(gate_up: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Inverse of fuse_gate_up: `[E, 2I, H]` -> (w1 per expert, w3 per expert)."""
    inter = gate_up.shape[1] // 2
    return [g[:inter] for g in gate_up], [g[inter:] for g in gate_up]


def fuse_down(w2: list[torch.Tensor]) -> torch.Tensor:
    """Per-expert w2 `[H, I]` -> `[E, H, I]`."""
    return torch.stack(list(w2))


def split_down(down: torch.Tensor) -> tuple[list[torch.Tensor]]:
    """Inverse of fuse_down: `[E, H, I]` -> (w2 per expert,)."""
    return (list(down),)


def _expert_fusions(column: str) -> dict[str, tuple[tuple[str, ...], Callable[..., torch.Tensor], Callable[..., tuple]]]:
    out = {}
    for fused, rows in _FUSED[column].items():
        if "{e}" not in rows[0][0]:
            continue
        leaves = tuple(n.split(".")[-2] for n, _ in sorted(rows, key=lambda r: r[1].index))
        out[fused] = (leaves, *((fuse_gate_up, split_gate_up) if len(leaves) == 2 else (fuse_down, split_down)))
    return out


EXPERT_FUSIONS = _expert_fusions("transformers")
"""transformers name template -> (native per-expert leaves, fuse, split); derived from NAME_TABLE's Parts."""
