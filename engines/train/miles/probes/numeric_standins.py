"""Numeric stand-ins for the GPU kernels Miles' DeepSeek-V4 model calls in its forward, written from their math.

Run (runpy) inside the model probe's subprocess (model_probe.py beside this file, request key `kernels`) BEFORE
Miles is imported, so the model's own modules bind these. Each keeps the kernel's name, signature and
values (the math the kernel computes, including where it rounds to bf16), so a difference from v4rl's model is a
difference of Miles' model code or of the weights, not of a stand-in:

  tile_kernels.modeling.mhc.ops   TileKernels' mHC ops, from the package's OWN pure-torch references
                                  (tile_kernels/torch/mhc.py of the tile-kernels 2.1.0 wheel, file path in
                                  $V4RL_TILE_KERNELS_MHC, fetched by engines/train/miles/model_check.py
                                  `tile_kernels_mhc_reference`; only that file is loaded, never the package);
                                  `mhc_pre_big_fuse` is the composition TileKernels fuses (norm_fn -> split_mixes ->
                                  sinkhorn -> apply_mix).
  fast_hadamard_transform         hadamard_transform(x, scale) = (x @ H) * scale with H the Sylvester-Hadamard
                                  matrix, in fp32, cast back to x's dtype (what the CUDA kernel computes).
  sparse MQA with sinks           Miles' tilelang `sparse_mqa_fwd_interface`: per query, softmax over the gathered
                                  KV rows (index -1 = masked) with the head's sink logit added to the denominator;
                                  probabilities rounded to bf16 before the P.V product, as the kernel's shared-memory
                                  copy does; output bf16, LSE fp32.
  lightning indexer               Miles' tilelang `batched_indexer_fwd`: logits[b, s, j] = sum_h relu(q.k_j) * w_h
                                  for j in [ks[s], ke[s]), -inf elsewhere; fp32 accumulation of bf16 inputs.
  torch.mm(out_dtype=fp32)        bf16 inputs, fp32 matmul (what Miles' ROCm branch does; CPU torch lacks the op).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

import torch

_mm = torch.mm


def _mm_out_dtype(a, b, *args, out_dtype=None, **kwargs):
    if out_dtype is None:
        return _mm(a, b, *args, **kwargs)
    return _mm(a.to(out_dtype), b.to(out_dtype), *args, **kwargs)


def _load_mhc_reference():
    path = os.environ.get("V4RL_TILE_KERNELS_MHC")
    if not path or not os.path.isfile(path):
        raise RuntimeError("$V4RL_TILE_KERNELS_MHC must name tile_kernels/torch/mhc.py of the tile-kernels 2.1.0 "
                           "wheel (engines/train/miles/model_check.py tile_kernels_mhc_reference downloads it)")
    spec = importlib.util.spec_from_file_location("tile_kernels_torch_mhc_reference", path)
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    return ref


def _mhc_ops(ref) -> types.ModuleType:
    ops = types.ModuleType("tile_kernels.modeling.mhc.ops")

    def mhc_pre_norm_fn(x, fn, norm_weight, eps, fuse_grad_acc=False, **kwargs):
        return ref.mhc_pre_norm_fn_ref(x, fn, norm_weight, eps)

    def mhc_pre_split_mixes(mixes, scale, base, mult, post_mult_value, pre_eps):
        return ref.mhc_pre_split_mixes_ref(mixes, scale, base, mult, post_mult_value, pre_eps)

    def sinkhorn_normalize(comb, repeat=10, eps=1e-6):
        return ref.sinkhorn_normalize_ref(comb, repeat, eps)

    def mhc_pre_apply_mix(x, mix):
        return ref.mhc_pre_apply_mix_ref(x, mix)

    def mhc_post(x, residual, post, comb):
        return ref.mhc_post_ref(x, residual, post, comb)

    def mhc_head_compute_mix(mix, scale, base, eps):
        return ref.mhc_head_compute_mix_ref(mix, scale, base, eps)

    def mhc_pre_big_fuse(x, fn, scale, base, *, rms_eps, mhc_pre_eps, mhc_sinkhorn_eps, mhc_post_mult_value,
                         sinkhorn_repeat, n_splits=16):
        mult = x.shape[-2]
        mixes = mhc_pre_norm_fn(x, fn, None, rms_eps)
        pre, post, comb = mhc_pre_split_mixes(mixes, scale, base, mult, mhc_post_mult_value, mhc_pre_eps)
        comb = sinkhorn_normalize(comb, sinkhorn_repeat, mhc_sinkhorn_eps)
        return post, comb, mhc_pre_apply_mix(x, pre)

    for fn in (mhc_pre_norm_fn, mhc_pre_split_mixes, sinkhorn_normalize, mhc_pre_apply_mix, mhc_post,
               mhc_head_compute_mix, mhc_pre_big_fuse):
        setattr(ops, fn.__name__, fn)
    return ops


def _sylvester(n: int) -> torch.Tensor:
    if n & (n - 1):
        raise ValueError(f"hadamard_transform needs a power-of-two width; got {n}")
    h = torch.ones(1, 1, dtype=torch.float32)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_transform(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    return ((x.float() @ _sylvester(x.shape[-1])) * scale).to(x.dtype)


def sparse_mqa_fwd_interface(q, kv, attn_sink, topk_idxs, sm_scale=None, **kwargs):
    """q [B,S,H,D] bf16, kv [B,Skv,D] bf16, attn_sink [H] fp32, topk_idxs [B,S,K] int32 -> (o bf16, lse fp32)."""
    B, S, H, D = q.shape
    scale = sm_scale if sm_scale is not None else D ** -0.5
    idx = topk_idxs.long()
    valid = idx >= 0
    gathered = torch.gather(kv.unsqueeze(1).expand(B, S, *kv.shape[1:]), 2,
                            idx.clamp_min(0).unsqueeze(-1).expand(B, S, idx.shape[-1], D))  # [B,S,K,D]
    scores = torch.einsum("bshd,bskd->bshk", q.float(), gathered.float())
    scores = scores.masked_fill(~valid.unsqueeze(2), float("-inf")) * scale
    m = scores.amax(-1, keepdim=True).clamp_min(-(2.0 ** 30) * scale)
    p = torch.exp(scores - m)
    denom = p.sum(-1) + torch.exp(attn_sink.float().view(1, 1, H) - m.squeeze(-1))
    o = torch.einsum("bshk,bskd->bshd", p.bfloat16().float(), gathered.float()) / denom.unsqueeze(-1)
    lse = (torch.log(denom) + m.squeeze(-1)) / torch.log(torch.tensor(2.0))
    return o.bfloat16(), lse


def batched_indexer_fwd(q, k, weights, cu_seqlen_ks, cu_seqlen_ke):
    """q [S,B,H,D] bf16, k [Skv,B,D] bf16, weights [S,B,H] fp32 -> logits [B,S,Skv] fp32 (causal range only)."""
    S, B, H, D = q.shape
    scores = torch.einsum("sbhd,jbd->bshj", q.float(), k.float()).clamp_min(0)
    logits = (scores * weights.float().permute(1, 0, 2).unsqueeze(-1)).sum(2)  # [B,S,Skv]
    j = torch.arange(k.shape[0]).view(1, 1, -1)
    inside = (j >= cu_seqlen_ks.long().view(1, -1, 1)) & (j < cu_seqlen_ke.long().view(1, -1, 1))
    return logits.masked_fill(~inside, float("-inf"))


def install() -> None:
    torch.mm = _mm_out_dtype
    ref = _load_mhc_reference()
    for name in ("tile_kernels", "tile_kernels.modeling", "tile_kernels.modeling.mhc"):
        module = sys.modules.get(name) or types.ModuleType(name)
        module.__path__ = []
        sys.modules[name] = module
    sys.modules["tile_kernels.modeling.mhc.ops"] = _mhc_ops(ref)
    fht = types.ModuleType("fast_hadamard_transform")
    fht.hadamard_transform = hadamard_transform
    sys.modules["fast_hadamard_transform"] = fht


def patch_miles_kernels() -> list[str]:
    """After Miles' model modules are imported: point their tilelang entry points at the references above.
    Returns the patched `module.attribute` names (the probe reports them)."""
    patched = []
    for module_name, attr, fn in [
        ("miles_plugins.models.deepseek_v4.ops.kernel.tilelang_sparse_mla_fwd", "sparse_mqa_fwd_interface",
         sparse_mqa_fwd_interface),
        ("miles_plugins.models.deepseek_v4.ops.kernel.tilelang_indexer_fwd", "batched_indexer_fwd",
         batched_indexer_fwd),
        ("miles_plugins.models.deepseek_v4.ops.v4_indexer", "batched_indexer_fwd", batched_indexer_fwd),
    ]:
        module = sys.modules.get(module_name)
        if module is not None and hasattr(module, attr):
            setattr(module, attr, fn)
            patched.append(f"{module_name}.{attr}")
    return patched


if __name__ == "numeric_standins":  # run by the probe through runpy
    install()
