"""The GPU kernels' CPU stand-ins (engines/upstream/probes/numeric_standins.py): every backward interface Miles'
autograd Functions call is the gradient of its forward (torch.autograd.gradcheck on tiny double inputs), and the
forwards are the softmax-with-sink / indexer math written out densely here.

    .venv/bin/python -m pytest tests/test_numeric_standins.py -q
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest
import torch

from engines.upstream.miles_model_check import NUMERIC_STANDINS


@pytest.fixture(scope="module")
def ks():
    spec = importlib.util.spec_from_file_location("numeric_standins_under_test", NUMERIC_STANDINS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not run as "numeric_standins": installs nothing into sys.modules
    return module


def _attention_inputs(B=1, S=3, H=2, D=4, Skv=5, K=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=g, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(B, Skv, D, generator=g, dtype=torch.float64, requires_grad=True)
    sink = torch.randn(H, generator=g, dtype=torch.float64, requires_grad=True)
    idx = torch.stack([torch.randperm(Skv, generator=g)[:K] for _ in range(B * S)]).view(B, S, K).int()
    idx[0, 0, -1] = -1  # a masked pick, as the indexer leaves them for early queries
    return q, kv, sink, idx.contiguous()


def _sparse_attention(ks):
    """The kernel pair as Miles' autograd Function uses it: the forward's o and lse saved, the backward interface
    called with them and the output's gradient."""

    class SparseAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, kv, sink, idx, scale):
            o, lse = ks.sparse_mqa_fwd_interface(q, kv, sink, idx, sm_scale=scale)
            ctx.save_for_backward(q, kv, sink, idx, o, lse)
            ctx.scale = scale
            return o

        @staticmethod
        def backward(ctx, do):
            q, kv, sink, idx, o, lse = ctx.saved_tensors
            dq, dkv, dsink = ks.sparse_mqa_bwd_interface(q, kv, sink, o, do, idx, lse, sm_scale=ctx.scale)
            return dq, dkv, dsink, None, None

    return SparseAttention.apply


@pytest.mark.parametrize("scale", [None, 0.3])
def test_sparse_attention_backward_is_the_gradient_of_its_forward(ks, scale):
    q, kv, sink, idx = _attention_inputs()
    assert torch.autograd.gradcheck(lambda q, kv, s: _sparse_attention(ks)(q, kv, s, idx, scale), (q, kv, sink))


def test_sparse_attention_backward_sums_a_row_picked_by_several_queries(ks):
    q, kv, sink, _ = _attention_inputs(B=2, S=2, Skv=2, K=2, seed=1)
    idx = torch.tensor([[[0, 1], [1, -1]], [[1, 0], [0, 0]]], dtype=torch.int32)  # row 0 twice for one query
    assert torch.autograd.gradcheck(lambda q, kv, s: _sparse_attention(ks)(q, kv, s, idx, None), (q, kv, sink))


def test_sparse_attention_forward_is_softmax_with_a_sink(ks):
    q, kv, sink, idx = _attention_inputs(seed=2)
    o, lse = ks.sparse_mqa_fwd_interface(q.detach(), kv.detach(), sink.detach(), idx)
    scale = q.shape[-1] ** -0.5
    for s in range(q.shape[1]):
        picks = [int(j) for j in idx[0, s] if j >= 0]
        for h in range(q.shape[2]):
            logits = torch.stack([scale * q[0, s, h] @ kv[0, j] for j in picks] + [sink[h]])
            prob = torch.softmax(logits, 0)[:-1]
            want = sum(p * kv[0, j] for p, j in zip(prob, picks))
            torch.testing.assert_close(o[0, s, h], want.detach())
            torch.testing.assert_close(lse[0, s, h], torch.logsumexp(logits, 0).detach() / torch.log(
                torch.tensor(2.0, dtype=torch.float64)))


def test_sparse_attention_keeps_the_kernels_dtypes(ks):
    q, kv, sink, idx = _attention_inputs(seed=3)
    q, kv, sink = q.detach().bfloat16(), kv.detach().bfloat16(), sink.detach().float()
    o, lse = ks.sparse_mqa_fwd_interface(q, kv, sink, idx)
    dq, dkv, dsink = ks.sparse_mqa_bwd_interface(q, kv, sink, o, torch.ones_like(o), idx, lse)
    assert (o.dtype, lse.dtype, dq.dtype, dkv.dtype, dsink.dtype) == (torch.bfloat16, torch.float32, torch.bfloat16,
                                                                      torch.bfloat16, torch.float32)
    assert dkv.shape == kv.shape and dsink.shape == sink.shape


def _indexer_inputs(S=4, B=2, H=2, D=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S, B, H, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(S, B, D, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(S, B, H, generator=g, dtype=torch.float64, requires_grad=True)
    return q, k, w


def test_indexer_backward_is_the_gradient_of_its_scores_at_the_picks(ks):
    """Miles' V4IndexerFunction: scores gathered at the top-k picks from batched_indexer_fwd, backward through
    batched_indexer_bwd."""
    q, k, w = _indexer_inputs()
    S = q.shape[0]
    ks_, ke = torch.zeros(S, dtype=torch.int32), torch.arange(1, S + 1, dtype=torch.int32)  # causal
    with torch.no_grad():
        logits = ks.batched_indexer_fwd(q, k, w, ks_, ke)
        score, picks = torch.topk(logits, 2, dim=-1)
        picks = picks.int().masked_fill(score == float("-inf"), -1)
    assert (picks == -1).any()  # the first query has one key: its second pick is masked

    class Indexer(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, w):
            logits = ks.batched_indexer_fwd(q, k, w, ks_, ke)
            ctx.save_for_backward(q, k, w)
            scores = torch.gather(logits, -1, picks.clamp_min(0).long())
            return torch.where(picks >= 0, scores, torch.zeros_like(scores))  # finite where no pick

        @staticmethod
        def backward(ctx, grad):
            q, k, w = ctx.saved_tensors
            gq, gw, gk = ks.batched_indexer_bwd(q, w, k, picks, grad)
            return gq, gk, gw

    assert torch.autograd.gradcheck(Indexer.apply, (q, k, w))


def test_indexer_forward_is_relu_weighted_dots_in_the_causal_range(ks):
    q, k, w = (t.detach() for t in _indexer_inputs(seed=4))
    S = q.shape[0]
    logits = ks.batched_indexer_fwd(q, k, w, torch.zeros(S, dtype=torch.int32), torch.arange(1, S + 1) // 2)
    for b in range(q.shape[1]):
        for s in range(S):
            for j in range(S):
                want = (torch.relu(q[s, b] @ k[j, b]) * w[s, b]).sum() if j < (s + 1) // 2 else float("-inf")
                assert float(logits[b, s, j]) == pytest.approx(float(want))


def test_miles_kernel_modules_bind_the_standins_when_imported(ks, tmp_path, monkeypatch):
    """The import hook: a module at one of Miles' kernel paths gets the stand-ins right after it executes, so a
    later `from ... import` (Miles' tilelang_indexer.py, v4_indexer.py) binds them."""
    pkg = tmp_path / "miles_plugins" / "models" / "deepseek_v4" / "ops" / "kernel"
    pkg.mkdir(parents=True)
    for d in [pkg, *pkg.parents][:5]:
        (d / "__init__.py").write_text("")
    (pkg / "tilelang_sparse_mla_bwd.py").write_text("def sparse_mqa_bwd_interface(*a):\n    raise RuntimeError\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    finder = ks._PatchOnImport()
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    for name in [m for m in sys.modules if m.startswith("miles_plugins")]:
        monkeypatch.delitem(sys.modules, name)
    module = importlib.import_module("miles_plugins.models.deepseek_v4.ops.kernel.tilelang_sparse_mla_bwd")
    assert module.sparse_mqa_bwd_interface is ks.sparse_mqa_bwd_interface
    for name in [m for m in sys.modules if m.startswith("miles_plugins")]:
        monkeypatch.delitem(sys.modules, name)


def test_te_general_gemm_layouts_are_the_routers_forward_and_backward():
    """TE's general_gemm stand-in in the three layouts Megatron's router gating Function uses (moe_utils.py):
    TN forward, NN grad input, NT grad weight, the same products as Megatron's own fp32 fallback there."""
    spec = importlib.util.spec_from_file_location(
        "te_cpp_extensions_under_test",
        NUMERIC_STANDINS.parent / "standins" / "transformer_engine" / "pytorch" / "cpp_extensions.py")
    te = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(te)
    g = torch.Generator().manual_seed(5)
    inp, weight = torch.randn(6, 4, generator=g).bfloat16(), torch.randn(3, 4, generator=g).bfloat16()
    grad_out = torch.randn(6, 3, generator=g)
    out = te.general_gemm(weight, inp, None, torch.float32, layout="TN")[0]
    torch.testing.assert_close(out, inp.float() @ weight.float().t())
    grad_in = te.general_gemm(weight.float(), grad_out, None, torch.float32, layout="NN", grad=True)[0]
    torch.testing.assert_close(grad_in, grad_out @ weight.float())
    grad_w = te.general_gemm(inp.float(), grad_out, None, torch.float32, layout="NT", grad=True)[0]
    torch.testing.assert_close(grad_w, grad_out.t() @ inp.float())
    with pytest.raises(NotImplementedError, match="got TT"):
        te.general_gemm(weight, inp, None, torch.float32, layout="TT")
