"""Building blocks of our DeepSeek-V4: norms, interleaved partial RoPE, mHC, hash/top-k MoE.

Numerics follow transformers' `modeling_deepseek_v4.py` op for op (fp32 norms, fp32 mHC with Sinkhorn,
fp32 softmax in pooling), so that with the same fp32 weights the two agree to ~1e-6; module names
follow the native checkpoint (`attn_norm`, `ffn.experts.3.w1`, ...) so `state_dict()` is native-named.
Nothing here knows about parallelism, caches or serving.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engines.model import kernels
from engines.model.config import HASH_MOE, ModelConfig


class RMSNorm(nn.Module):
    """Weighted RMSNorm computed in fp32; the weight stays fp32 (as DeepSeek-V4 keeps norms)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


# ---------------------------------------------------------------------------------------------- RoPE
def _yarn_inv_freq(base: float, dim: int, scaling: dict) -> torch.Tensor:
    """YaRN-interpolated inverse frequencies (the `compress` RoPE of the real model; attention factor 1)."""
    factor = float(scaling["factor"])
    original = float(scaling.get("original_max_position_embeddings", 4096))
    beta_fast, beta_slow = float(scaling.get("beta_fast", 32)), float(scaling.get("beta_slow", 1))

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = math.floor(correction_dim(beta_fast)) if scaling.get("truncate", True) else correction_dim(beta_fast)
    high = math.ceil(correction_dim(beta_slow)) if scaling.get("truncate", True) else correction_dim(beta_slow)
    low, high = max(low, 0), min(high, dim - 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def rope_inv_freq(cfg: ModelConfig, kind: str) -> torch.Tensor:
    """One inverse frequency per interleaved channel pair, for `main` or `compress` RoPE."""
    dim = cfg.rope_head_dim
    if kind == "main":
        return 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    if cfg.rope_scaling and cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type")) == "yarn":
        return _yarn_inv_freq(cfg.compress_rope_theta, dim, cfg.rope_scaling)
    return 1.0 / (cfg.compress_rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [..., rope_dim/2] for integer `positions` of any shape, cast to the compute dtype."""
    freqs = positions[..., None].float() * inv_freq.to(positions.device)
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the trailing `2*cos.shape[-1]` channels of x; cos/sin broadcast over x's middle dims.

    x is [..., T, D] and cos/sin are [..., T, rope/2] with matching leading dims (callers unsqueeze heads).
    """
    cos = cos.repeat_interleave(2, dim=-1)
    sin = sin.repeat_interleave(2, dim=-1)
    rd = cos.shape[-1]
    nope, rope = x[..., :-rd], x[..., -rd:]
    rotated = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    out = (rope.float() * cos) + (rotated.float() * sin)
    return torch.cat([nope, out.to(x.dtype)], dim=-1)


# ---------------------------------------------------------------------------------------------- mHC
def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Alternating column/row normalisation towards a doubly-stochastic matrix (first step: columns).

    One native call where kernels.py has its bit-identical kernel (117 torch ops fewer per call), else the
    torch ops of `sinkhorn_torch`.
    """
    if iters >= 1 and kernels.sinkhorn_applies(comb, sinkhorn_torch):  # the kernels assume one step at least
        return kernels.sinkhorn(comb, iters, eps)
    return sinkhorn_torch(comb, iters, eps)


def sinkhorn_torch(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_weights(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC mixing weights from the streams [..., hc, D]: returns (post [..., hc], comb [..., hc, hc], collapsed)."""
    hc = cfg.hc_mult
    flat = unweighted_rms_norm(streams.flatten(-2).float(), cfg.rms_norm_eps)
    mixes = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + cfg.hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb_logits = comb_w.view(*comb_w.shape[:-1], hc, hc) * scale[2] + comb_b.view(hc, hc)
    comb = sinkhorn(torch.softmax(comb_logits, dim=-1) + cfg.hc_eps, cfg.hc_sinkhorn_iters, cfg.hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)
    return post, comb, collapsed


def hc_merge(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams = post ⊗ block_out + combᵀ @ streams (comb mixes along its first axis)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


def hc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Final collapse of the hc streams into one hidden state before the last norm."""
    flat = unweighted_rms_norm(streams.flatten(-2).float(), cfg.rms_norm_eps)
    pre = torch.sigmoid(F.linear(flat, fn.float()) * scale.float() + base.float()) + cfg.hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)


# ---------------------------------------------------------------------------------------------- MoE
class Expert(nn.Module):
    """SwiGLU expert with DeepSeek-V4's clamp (gate <= limit, |up| <= limit): w2(silu(w1 x) * w3 x)."""

    def __init__(self, hidden: int, inter: int, limit: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x).clamp(max=self.limit)
        up = self.w3(x).clamp(min=-self.limit, max=self.limit)
        return self.w2(F.silu(gate) * up)


class Gate(nn.Module):
    """Router: sqrtsoftplus scores; hash layers select by a frozen tid2eid table, others by top-k of score+bias.

    The bias only steers selection; the weights are the unbiased scores, normalised, times routed_scaling.
    """

    def __init__(self, cfg: ModelConfig, is_hash: bool) -> None:
        super().__init__()
        self.cfg, self.is_hash = cfg, is_hash
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long))
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sqrt(F.softplus(F.linear(x, self.weight)))
        if self.is_hash:
            indices = self.tid2eid[token_ids].long()
        else:
            indices = torch.topk(scores + self.bias, self.cfg.num_experts_per_tok, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.cfg.routed_scaling_factor, indices


class MoE(nn.Module):
    """Routed experts (hash or top-k) plus the shared expert, on flattened tokens."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.gate = Gate(cfg, cfg.mlp_layer_types[layer] == HASH_MOE)
        self.experts = nn.ModuleList(
            Expert(cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit) for _ in range(cfg.n_routed_experts))
        self.shared_experts = Expert(cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor, routes: list[torch.Tensor] | None = None
                ) -> torch.Tensor:
        """`routes`, if given, gets this layer's chosen experts appended: int64 [tokens, top_k], tokens flattened."""
        shape = x.shape
        flat, ids = x.reshape(-1, shape[-1]), token_ids.reshape(-1)
        weights, indices = self.gate(flat, ids)
        if routes is not None:
            routes.append(indices)
        # One output row per (token, slot) pair, summed over slots afterwards (index_add_ costs ~0.3 ms a call on
        # CPU). A stable sort groups the pairs by expert: each expert gets its rows in ascending order, as a
        # per-expert mask would give them, with one sort and one count instead of a mask and a nonzero per expert.
        k = indices.shape[-1]
        pair_experts, pair_weights = indices.reshape(-1), weights.reshape(-1, 1)
        order = torch.argsort(pair_experts, stable=True)
        per_slot = flat.new_empty(pair_experts.shape[0], shape[-1])
        start = 0
        for e, n in enumerate(torch.bincount(pair_experts, minlength=len(self.experts)).tolist()):
            if n:
                pairs = order[start:start + n]
                per_slot[pairs] = (self.experts[e](flat[pairs // k]) * pair_weights[pairs]).to(per_slot.dtype)
            start += n
        routed = per_slot.view(-1, k, shape[-1]).sum(dim=1)
        return (routed + self.shared_experts(flat)).view(shape)

    def route(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Expert ids chosen per token (for alignment localisation)."""
        return self.gate(x.reshape(-1, x.shape[-1]), token_ids.reshape(-1))[1].view(*x.shape[:-1], -1)
