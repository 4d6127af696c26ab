"""Layer-by-layer localisation: the same tokens through our DeepSeek-V4 and transformers', block by block.

For every decoder layer, in forward order, five sub-blocks are compared:

  attention   the attention block's output                     [B, S, D]
  mhc_attn    the hc streams after the attention-side mHC merge [B, S, hc, D]   (block "mhc")
  router      the experts each token is routed to               [B, S, k]      (compared as sets)
  moe         the MoE block's output (routed + shared)          [B, S, D]
  mhc_ffn     the streams after the FFN-side mHC merge = the layer's output     (block "mhc")

Ours comes from `DeepseekV4.forward(ids, trace=...)`; transformers' from forward hooks on
`self_attn` (output), `ffn_hc` (its input is the streams after the attention merge), `mlp.gate`
(the indices it returns), `mlp` (output) and the decoder layer (output).

Both models run in fp32 here, whatever dtype the engines use, so that BF16 rounding noise (~1e-2
relative) cannot mask a real mismatch, nor look like one: with equal weights the two implementations
agree to ~1e-6, and a sub-block diverges when some token's relative L2 error
`||ours - theirs|| / ||theirs||` exceeds `rel_tol` (routers: when the fraction of tokens whose
expert set differs exceeds `router_tol`). The first diverging sub-block is where they part; later
ones inherit the error.

    loc = localise(our_fp32_model, transformers_fp32_model, [ids, ...], rel_tol=1e-3, router_tol=0.0)
    loc.first_divergence   # {"layer": 0, "block": "mhc", "sub_block": "mhc_attn", ...} or None
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engines.model import DeepseekV4
from engines.model.config import HASH_MOE

SUB_BLOCKS: tuple[str, ...] = ("attention", "mhc_attn", "router", "moe", "mhc_ffn")
"""Sub-blocks of one decoder layer in forward order."""
BLOCK_OF = {"attention": "attention", "mhc_attn": "mhc", "router": "router", "moe": "moe", "mhc_ffn": "mhc"}
"""Sub-block -> the block name the report uses."""


@dataclass
class _Stats:
    """Running comparison of one sub-block of one layer over all sequences."""

    tokens: int = 0
    bad_tokens: int = 0
    max_rel: float = 0.0
    sum_rel: float = 0.0
    max_abs: float = 0.0
    non_finite: int = 0
    first_position: int | None = None


@dataclass
class Localisation:
    per_layer: list[dict]
    """One entry per layer: {"layer", "hash_routed", <sub-block>: {...metrics, "diverged"}} in forward order."""
    first_divergence: dict | None
    """{"layer", "block", "sub_block", "metric", "value", "tolerance", "first_position"} or None."""
    tolerances: dict = field(default_factory=dict)


def our_trace(model: DeepseekV4, ids: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Per-layer sub-block outputs of our model on ids [B, S]."""
    trace: list[dict[str, torch.Tensor]] = []
    model(ids, trace=trace)
    return trace


def transformers_trace(model, ids: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """The same sub-block outputs from transformers' DeepseekV4ForCausalLM, captured with forward hooks."""
    layers = model.model.layers
    trace: list[dict[str, torch.Tensor]] = [{} for _ in layers]
    B, S = ids.shape

    def keep(i: int, key: str, pick):
        def hook(module, args, output=None):
            trace[i][key] = pick(args, output).detach()
        return hook

    handles = []
    for i, layer in enumerate(layers):
        handles += [
            layer.self_attn.register_forward_hook(keep(i, "attention", lambda a, o: o[0])),
            layer.ffn_hc.register_forward_pre_hook(keep(i, "mhc_attn", lambda a, o: a[0])),
            layer.mlp.gate.register_forward_hook(keep(i, "router", lambda a, o: o[2].view(B, S, -1))),
            layer.mlp.register_forward_hook(keep(i, "moe", lambda a, o: o)),
            layer.register_forward_hook(keep(i, "mhc_ffn", lambda a, o: o)),
        ]
    try:
        model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    for i, t in enumerate(trace):
        if set(t) != set(SUB_BLOCKS):
            raise RuntimeError(f"transformers layer {i}: hooks captured {sorted(t)}, expected {SUB_BLOCKS}; "
                               "has DeepseekV4DecoderLayer changed its structure?")
    return trace


def _compare(stats: _Stats, ours: torch.Tensor, theirs: torch.Tensor, key: str, tol: float) -> None:
    """Fold one batch of one sub-block into its stats (per-token errors; position = dim 1)."""
    if ours.shape != theirs.shape:
        raise RuntimeError(f"{key}: our shape {tuple(ours.shape)} != transformers' {tuple(theirs.shape)}")
    B, S = ours.shape[:2]
    if key == "router":
        a, b = ours.long().sort(-1).values, theirs.long().sort(-1).values
        bad = (a != b).any(-1)  # top-k order is arbitrary (sorted=False): compare the sets
    else:
        a, b = ours.double().reshape(B, S, -1), theirs.double().reshape(B, S, -1)
        diff = a - b
        err = diff.norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)
        finite = torch.isfinite(err)
        bad = ~finite | (err > tol)  # a NaN/inf on either side is a divergence, never "within tolerance"
        stats.non_finite += int((~finite).sum())
        if finite.any():
            stats.max_abs = max(stats.max_abs, float(diff.abs()[finite].max()))
            stats.max_rel = max(stats.max_rel, float(err[finite].max()))
            stats.sum_rel += float(err[finite].sum())
    stats.tokens += B * S
    stats.bad_tokens += int(bad.sum())
    if bad.any():
        pos = int(bad.nonzero()[:, 1].min())
        stats.first_position = pos if stats.first_position is None else min(stats.first_position, pos)


def _entry(key: str, s: _Stats, rel_tol: float, router_tol: float) -> dict:
    if key == "router":
        frac = s.bad_tokens / max(s.tokens, 1)
        return {"mismatch_frac": frac, "mismatched_tokens": s.bad_tokens, "tokens": s.tokens,
                "first_position": s.first_position, "diverged": frac > router_tol}
    return {"max_rel": s.max_rel, "mean_rel": s.sum_rel / max(s.tokens - s.non_finite, 1), "max_abs": s.max_abs,
            "tokens_over_tol": s.bad_tokens, "non_finite_tokens": s.non_finite, "tokens": s.tokens,
            "first_position": s.first_position, "diverged": s.bad_tokens > 0}


def compare_sub_block(key: str, got: torch.Tensor, ref: torch.Tensor) -> dict:
    """One sub-block's comparison of `got` against `ref` with no tolerance applied: the same per-token errors
    and metrics as a `localise` row (mean_rel / max_rel / ... for tensors, mismatch_frac for the router). For
    callers that set their own bounds (engines/align/model_compare.py bounds by measured BF16 noise)."""
    stats = _Stats()
    _compare(stats, got, ref, key, float("inf"))
    return _entry(key, stats, float("inf"), float("inf"))


@torch.no_grad()
def localise(ours: DeepseekV4, theirs, sequences: Sequence[Sequence[int]], *, rel_tol: float = 1e-3,
             router_tol: float = 0.0) -> Localisation:
    """Compare every sub-block of every layer on the given token sequences (grouped by length, no padding).

    `ours` and `theirs` (transformers' DeepseekV4ForCausalLM) should both hold fp32 weights; they are run
    in fp32 without autocast.
    """
    if not sequences:
        raise ValueError("localise() needs at least one token sequence")
    n_layers = len(ours.layers)
    if len(theirs.model.layers) != n_layers:
        raise ValueError(f"our model has {n_layers} layers, transformers' {len(theirs.model.layers)}")
    was_training = theirs.training
    theirs.eval()
    stats: dict[tuple[int, str], _Stats] = defaultdict(_Stats)
    by_length: dict[int, list[Sequence[int]]] = defaultdict(list)
    for s in sequences:
        by_length[len(s)].append(s)
    try:
        for _, group in sorted(by_length.items()):
            ids = torch.tensor([list(s) for s in group], dtype=torch.long)
            mine = our_trace(ours, ids)
            other = transformers_trace(theirs, ids)
            for i in range(n_layers):
                for key in SUB_BLOCKS:
                    _compare(stats[(i, key)], mine[i][key], other[i][key], key, rel_tol)
            del mine, other
    finally:
        theirs.train(was_training)
    per_layer, first = [], None
    for i in range(n_layers):
        row: dict = {"layer": i, "hash_routed": ours.cfg.mlp_layer_types[i] == HASH_MOE}
        for key in SUB_BLOCKS:
            row[key] = _entry(key, stats[(i, key)], rel_tol, router_tol)
            if first is None and row[key]["diverged"]:
                metric, tol = ("mismatch_frac", router_tol) if key == "router" else ("max_rel", rel_tol)
                if key != "router" and row[key]["max_rel"] <= rel_tol:  # diverged by NaN/inf alone
                    metric, tol = "non_finite_tokens", 0
                first = {"layer": i, "block": BLOCK_OF[key], "sub_block": key, "metric": metric,
                         "value": row[key][metric], "tolerance": tol, "first_position": row[key]["first_position"]}
        per_layer.append(row)
    return Localisation(per_layer, first, {"rel_tol": rel_tol, "router_tol": router_tol})
