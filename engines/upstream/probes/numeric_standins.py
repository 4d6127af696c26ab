"""Numeric stand-ins for the GPU kernels Miles' DeepSeek-V4 model calls in its forward, written from their math.

Run (runpy) inside the model probe's subprocess (model_probe.py beside this file, request key `kernels`) BEFORE
Miles is imported, so the model's own modules bind these. Each keeps the kernel's name, signature and
values (the math the kernel computes, including where it rounds to bf16), so a difference from v4rl's model is a
difference of Miles' model code or of the weights, not of a stand-in:

  tile_kernels.modeling.mhc.ops   TileKernels' mHC ops, from the package's OWN pure-torch references
                                  (tile_kernels/torch/mhc.py of the tile-kernels 2.1.0 wheel, file path in
                                  $V4RL_TILE_KERNELS_MHC, fetched by engines/upstream/miles_model_check.py
                                  `tile_kernels_mhc_reference`; only that file is loaded, never the package);
                                  `mhc_pre_big_fuse` is the composition TileKernels fuses (norm_fn -> split_mixes ->
                                  sinkhorn -> apply_mix).
  fast_hadamard_transform         hadamard_transform(x, scale) = (x @ H) * scale with H the Sylvester-Hadamard
                                  matrix, in fp32, cast back to x's dtype (what the CUDA kernel computes).
  sparse MQA with sinks           Miles' tilelang `sparse_mqa_fwd_interface`: per query, softmax over the gathered
                                  KV rows (index -1 = masked) with the head's sink logit added to the denominator;
                                  probabilities rounded to the input dtype (bf16) before the P.V product, as the
                                  kernel's shared-memory copy does; output bf16, LSE fp32 (base 2, as the kernel's).
                                  Its backward `sparse_mqa_bwd_interface` (Miles' autograd Function
                                  DeepSeekV4SparseAttention calls it with the saved o and lse): the softmax gradient
                                  written from the math (docstring), dq bf16, dkv bf16, d_attn_sink fp32.
  lightning indexer               Miles' tilelang `batched_indexer_fwd`: logits[b, s, j] = sum_h relu(q.k_j) * w_h
                                  for j in [ks[s], ke[s]), -inf elsewhere; fp32 accumulation of bf16 inputs. Its
                                  backward `batched_indexer_bwd` (Miles' V4IndexerFunction) at the top-k picks.

Miles' kernel modules bind these when they are imported (`install` puts an import hook in place), so Miles' own
autograd Functions run with them unchanged. Accumulation is fp32 for bf16/fp32 inputs and fp64 for fp64 ones (the
unit tests gradcheck the forward/backward pairs in double: tests/test_numeric_standins.py).
  torch.mm(out_dtype=fp32)        bf16 inputs, fp32 matmul (what Miles' ROCm branch does; CPU torch lacks the op).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import math
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
                           "wheel (engines/upstream/miles_model_check.py tile_kernels_mhc_reference downloads it)")
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


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The kernels accumulate bf16 inputs in fp32; fp64 inputs (the gradchecks) stay fp64."""
    return torch.promote_types(dtype, torch.float32)


def _flat_rows(idx: torch.Tensor, rows_per_batch: int) -> torch.Tensor:
    """idx [B,S,K] (>= 0) into each batch's rows -> the same picks as indices into the [B * rows, D] flattening."""
    offsets = torch.arange(idx.shape[0], device=idx.device).view(-1, 1, 1) * rows_per_batch
    return (idx + offsets).reshape(-1)


def _gather_rows(kv: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """kv [B,Skv,D], idx [B,S,K] (>= 0) -> the rows kv[b, idx[b,s,k]] as [B,S,K,D]. One index_select over the
    flattened rows: a torch.gather over kv expanded to [B,S,Skv,D] reads the same rows but costs S x Skv x D on the
    CPU (it dominated Miles' train step in the rehearsal)."""
    B, S, K = idx.shape
    D = kv.shape[-1]
    return kv.reshape(-1, D).index_select(0, _flat_rows(idx, kv.shape[1])).view(B, S, K, D)


def sparse_mqa_fwd_interface(q, kv, attn_sink, topk_idxs, sm_scale=None, **kwargs):
    """q [B,S,H,D] bf16, kv [B,Skv,D] bf16, attn_sink [H] fp32, topk_idxs [B,S,K] int32 -> (o bf16, lse fp32)."""
    B, S, H, D = q.shape
    acc = _acc(q.dtype)
    scale = sm_scale if sm_scale is not None else D ** -0.5
    idx = topk_idxs.long()
    valid = idx >= 0
    gathered = _gather_rows(kv, idx.clamp_min(0)).to(acc)  # [B,S,K,D]
    scores = torch.einsum("bshd,bskd->bshk", q.to(acc), gathered)
    scores = scores.masked_fill(~valid.unsqueeze(2), float("-inf")) * scale
    m = scores.amax(-1, keepdim=True).clamp_min(-(2.0 ** 30) * scale)
    p = torch.exp(scores - m)
    denom = p.sum(-1) + torch.exp(attn_sink.to(acc).view(1, 1, H) - m.squeeze(-1))
    o = torch.einsum("bshk,bskd->bshd", p.to(q.dtype).to(acc), gathered) / denom.unsqueeze(-1)
    lse = (torch.log(denom) + m.squeeze(-1)) / math.log(2.0)
    return o.to(q.dtype), lse


def sparse_mqa_bwd_interface(q, kv, attn_sink, o, do, topk_idxs, lse, sm_scale=None):
    """The backward of sparse_mqa_fwd_interface, from the math. With s_j = scale * q.k_j over the picked rows
    (k = v = kv, one KV head), Z = sum_j exp(s_j) + exp(sink), p_j = exp(s_j) / Z = exp(s_j - lse * ln 2) (lse is
    log2 Z, as the forward returns it), o = sum_j p_j kv_j and delta = do.o (per query and head):
      ds_j = p_j (do.kv_j - delta)       dq = scale * sum_j ds_j kv_j
      dkv[idx_j] += sum_h (scale * ds_j q_h + p_j do_h)      d_sink[h] = -sum_{b,s} exp(sink_h - lse ln 2) delta
    Masked picks (index -1) have p_j = 0. Returns (dq like q, dkv like kv, d_attn_sink like attn_sink)."""
    B, S, H, D = q.shape
    acc = _acc(q.dtype)
    scale = sm_scale if sm_scale is not None else D ** -0.5
    idx = topk_idxs.long()
    valid = idx >= 0
    safe = idx.clamp_min(0)
    rows = _gather_rows(kv, safe).to(acc)  # [B,S,K,D]
    qa, doa, lse_e = q.to(acc), do.to(acc), lse.to(acc) * math.log(2.0)
    scores = torch.einsum("bshd,bskd->bshk", qa, rows) * scale
    p = torch.exp(scores - lse_e.unsqueeze(-1)).masked_fill(~valid.unsqueeze(2), 0.0)
    delta = (o.to(acc) * doa).sum(-1)  # [B,S,H]
    ds = p * (torch.einsum("bshd,bskd->bshk", doa, rows) - delta.unsqueeze(-1))
    dq = scale * torch.einsum("bshk,bskd->bshd", ds, rows)
    d_rows = scale * torch.einsum("bshk,bshd->bskd", ds, qa) + torch.einsum("bshk,bshd->bskd", p, doa)
    dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
    dkv.view(-1, D).index_add_(0, _flat_rows(safe, kv.shape[1]), d_rows.reshape(-1, D))
    p_sink = torch.exp(attn_sink.to(acc).view(1, 1, H) - lse_e)
    d_sink = -(p_sink * delta).sum((0, 1))
    return dq.to(q.dtype), dkv.to(kv.dtype), d_sink.to(attn_sink.dtype)


def batched_indexer_fwd(q, k, weights, cu_seqlen_ks, cu_seqlen_ke):
    """q [S,B,H,D] bf16, k [Skv,B,D] bf16, weights [S,B,H] fp32 -> logits [B,S,Skv] fp32 (causal range only)."""
    S, B, H, D = q.shape
    acc = _acc(q.dtype)
    scores = torch.einsum("sbhd,jbd->bshj", q.to(acc), k.to(acc)).clamp_min(0)
    logits = (scores * weights.to(acc).permute(1, 0, 2).unsqueeze(-1)).sum(2)  # [B,S,Skv]
    j = torch.arange(k.shape[0]).view(1, 1, -1)
    inside = (j >= cu_seqlen_ks.long().view(1, -1, 1)) & (j < cu_seqlen_ke.long().view(1, -1, 1))
    return logits.masked_fill(~inside, float("-inf"))


def batched_indexer_bwd(index_q, weights, index_k, topk_indices, grad_scores):
    """The backward of the indexer's scores at its top-k picks, from the math: score[b,s,t] =
    sum_h relu(q[s,b,h].k[j,b]) w[s,b,h] with j = topk_indices[b,s,t] (-1: no pick, no gradient), so with
    g = grad_scores and r = relu'(q.k_j) g w:  dq[s,b,h] = sum_t r k_j,  dw[s,b,h] = sum_t g relu(q.k_j),
    dk[j,b] += sum_h r q[s,b,h]. Returns (grad_q like index_q, grad_w fp32, grad_k fp32), as Miles' kernel."""
    S, B, H, D = index_q.shape
    acc = _acc(index_q.dtype)
    idx = topk_indices.long()
    valid = idx >= 0
    safe = idx.clamp_min(0)
    keys = _gather_rows(index_k.to(acc).transpose(0, 1), safe)  # [B,S,T,D]
    q = index_q.to(acc).transpose(0, 1)  # [B,S,H,D]
    w = weights.to(acc).transpose(0, 1)  # [B,S,H]
    g = grad_scores.to(acc).masked_fill(~valid, 0.0)  # [B,S,T]
    dots = torch.einsum("bshd,bstd->bsht", q, keys)
    r = (dots > 0).to(acc) * g.unsqueeze(2) * w.unsqueeze(-1)  # [B,S,H,T]
    grad_q = torch.einsum("bsht,bstd->bshd", r, keys).transpose(0, 1)
    grad_w = (dots.clamp_min(0) * g.unsqueeze(2)).sum(-1).transpose(0, 1)
    d_keys = torch.einsum("bsht,bshd->bstd", r, q)
    grad_k = torch.zeros(B, index_k.shape[0], D, dtype=acc, device=index_k.device)
    grad_k.view(-1, D).index_add_(0, _flat_rows(safe, index_k.shape[0]), d_keys.reshape(-1, D))
    return grad_q.to(index_q.dtype), grad_w.to(_acc(weights.dtype)), grad_k.transpose(0, 1)


_MILES_KERNELS = "miles_plugins.models.deepseek_v4.ops.kernel."
MILES_KERNEL_NAMES = {
    _MILES_KERNELS + "tilelang_sparse_mla_fwd": {"sparse_mqa_fwd_interface": sparse_mqa_fwd_interface},
    _MILES_KERNELS + "tilelang_sparse_mla_bwd": {"sparse_mqa_bwd_interface": sparse_mqa_bwd_interface},
    _MILES_KERNELS + "tilelang_indexer_fwd": {"batched_indexer_fwd": batched_indexer_fwd},
    _MILES_KERNELS + "tilelang_indexer_bwd": {"batched_indexer_bwd": batched_indexer_bwd},
    _MILES_KERNELS + "tilelang_indexer": {"batched_indexer_fwd": batched_indexer_fwd,
                                          "batched_indexer_bwd": batched_indexer_bwd},
    "miles_plugins.models.deepseek_v4.ops.v4_indexer": {"batched_indexer_fwd": batched_indexer_fwd},
}
"""Miles' modules (both generations) that define or bind (`from ... import`) a tilelang entry point, and the
stand-in each name gets. The kernel modules are patched as they are imported, so a later `from ... import` binds
the stand-in; the binding modules are listed for a caller that imported them first (patch_miles_kernels)."""


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Right after one of MILES_KERNEL_NAMES' modules has executed (found as usual), its names get the stand-ins."""

    def find_spec(self, name, path, target=None):
        if name not in MILES_KERNEL_NAMES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            for attr, fn in MILES_KERNEL_NAMES[name].items():
                setattr(module, attr, fn)

        spec.loader.exec_module = exec_module
        return spec


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
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


def patch_miles_kernels() -> list[str]:
    """For Miles' modules imported before `install` (none where it ran first): point their tilelang entry points
    at the stand-ins above. Returns the `module.attribute` names that now hold a stand-in (the probe reports them)."""
    patched = []
    for module_name, names in MILES_KERNEL_NAMES.items():
        module = sys.modules.get(module_name)
        for attr, fn in names.items():
            if module is not None and hasattr(module, attr):
                setattr(module, attr, fn)
                patched.append(f"{module_name}.{attr}")
    return patched


if __name__ == "numeric_standins":  # run by the probe through runpy
    install()
