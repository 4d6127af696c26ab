"""Miles' DeepSeek-V4 forward vs v4rl's own model, layer by layer, within bounds measured from bf16 noise.

Miles' model runs in BF16 (as on the cluster); v4rl's model runs the same tokens twice, in fp32 (the reference)
and in bf16. For every layer and sub-block (engines/align/layerwise.py SUB_BLOCKS: attention, mhc_attn, router,
moe, mhc_ffn) the error of Miles against v4rl-fp32 is compared with v4rl's own bf16-vs-fp32 error on the same
tokens, the noise that BF16 alone makes:

  tensors   mean over tokens of ||x - ref|| / ||ref||;  diverged when > NOISE_FACTOR * noise + TENSOR_FLOOR
  router    fraction of tokens whose expert set differs; diverged when > NOISE_FACTOR * noise + ROUTER_FLOOR
  logprobs  mean |Δ logprob| of the next token;         within bound when <= NOISE_FACTOR * noise + LOGPROB_FLOOR

The result is v4rl's own align Localisation (per_layer rows, first_divergence {layer, block, sub_block, metric,
value, tolerance, first_position}), so a Miles/v4rl disagreement is named the way `v4rl align` names one.

    loc, logprobs = compare_forward(miles_trace, miles_logits, ours_fp32, ours_bf16, tokens, cfg)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engines.align.layerwise import BLOCK_OF, SUB_BLOCKS, Localisation, compare_sub_block
from engines.model.config import HASH_MOE

NOISE_FACTOR = 3.0
"""A disagreement counts when it exceeds this many times what BF16 rounding alone makes on the same tokens."""
TENSOR_FLOOR = 2e-3
"""Added to tensor bounds: a sub-block bf16 leaves bit-exact (noise 0) still tolerates rounding of its inputs."""
ROUTER_FLOOR = 0.02
"""Added to router bounds: near-tied experts flip under any rounding; a few tokens may differ."""
LOGPROB_FLOOR = 1e-3
"""Added to the logprob bound (nats)."""


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logprob of each next token: logits [B, S, V] (any dtype) and tokens [B, S] -> [B, S-1] fp64."""
    lp = torch.log_softmax(logits.double(), -1)[:, :-1]
    return lp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


def _error(key: str, entry: dict) -> float:
    return entry["mismatch_frac"] if key == "router" else entry["mean_rel"]


def compare_traces(miles: Sequence[dict], ours_fp32: Sequence[dict], ours_bf16: Sequence[dict],
                   mlp_layer_types: Sequence[str]) -> Localisation:
    """Per layer and sub-block: Miles vs v4rl-fp32 against v4rl-bf16 vs v4rl-fp32 (module docstring)."""
    if not (len(miles) == len(ours_fp32) == len(ours_bf16)):
        raise ValueError(f"layer counts differ: Miles {len(miles)}, v4rl fp32 {len(ours_fp32)}, "
                         f"v4rl bf16 {len(ours_bf16)}")
    per_layer, first = [], None
    for i, (m, ref, noisy) in enumerate(zip(miles, ours_fp32, ours_bf16)):
        row: dict = {"layer": i, "hash_routed": mlp_layer_types[i] == HASH_MOE}
        for key in SUB_BLOCKS:
            got = compare_sub_block(key, m[key], ref[key])
            noise = _error(key, compare_sub_block(key, noisy[key], ref[key]))
            floor = ROUTER_FLOOR if key == "router" else TENSOR_FLOOR
            bound = NOISE_FACTOR * noise + floor
            value = _error(key, got)
            row[key] = {**got, "bf16_noise": noise, "bound": bound, "diverged": value > bound}
            if first is None and value > bound:
                first = {"layer": i, "block": BLOCK_OF[key], "sub_block": key,
                         "metric": "mismatch_frac" if key == "router" else "mean_rel", "value": value,
                         "tolerance": bound, "first_position": got["first_position"]}
        per_layer.append(row)
    return Localisation(per_layer, first, {"noise_factor": NOISE_FACTOR, "tensor_floor": TENSOR_FLOOR,
                                           "router_floor": ROUTER_FLOOR})


def compare_logprobs(miles_logits: torch.Tensor, fp32_logits: torch.Tensor, bf16_logits: torch.Tensor,
                     tokens: torch.Tensor) -> dict:
    """Mean/p99/max |Δ logprob| of Miles vs v4rl-fp32, the bf16 noise, and whether Miles is within the bound."""
    ref = token_logprobs(fp32_logits, tokens)
    diff = (token_logprobs(miles_logits, tokens) - ref).abs().flatten()
    noise = (token_logprobs(bf16_logits, tokens) - ref).abs().flatten()
    bound = NOISE_FACTOR * float(noise.mean()) + LOGPROB_FLOOR
    return {"mean": float(diff.mean()), "p99": float(diff.quantile(0.99)), "max": float(diff.max()),
            "bf16_noise_mean": float(noise.mean()), "bf16_noise_p99": float(noise.quantile(0.99)),
            "bound": bound, "within_bound": float(diff.mean()) <= bound, "tokens": int(diff.numel())}


def ours_forward(model, tokens: torch.Tensor) -> tuple[list[dict], torch.Tensor]:
    """v4rl's model on tokens [B, S] (torch ops, no fused kernels): (per-layer trace, logits)."""
    trace: list[dict] = []
    with torch.no_grad():
        logits = model(tokens, trace=trace)  # a trace runs the torch ops (the fused kernels take no trace)
    return trace, logits
