"""Native kernels (engines/model/kernels.py): bit-identical to the torch ops they replace, built once and
atomically, and a clean fall-back to the torch ops (with a warning) when they cannot be built.

    .venv/bin/python -m pytest tests/test_kernels.py -q
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from engines.model import kernels
from engines.model.layers import sinkhorn, sinkhorn_torch

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")


@pytest.fixture(autouse=True)
def fresh_kernel_state():
    kernels.reset()
    yield
    kernels.reset()


def _matrices(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(4 * torch.randn(shape, generator=g), dim=-1) + 1e-6


@needs_compiler
@pytest.mark.parametrize("shape", [(4, 4), (64, 1, 4, 4), (2, 29, 4, 4), (1000, 4, 4)])
def test_native_sinkhorn_equals_the_torch_ops_bit_for_bit(shape):
    comb = _matrices(*shape, seed=len(shape))
    assert kernels.sinkhorn_applies(comb, sinkhorn_torch), kernels.status()
    for iters, eps in ((20, 1e-6), (1, 1e-6), (7, 1e-2)):
        before = comb.clone()
        assert torch.equal(sinkhorn(comb, iters, eps), sinkhorn_torch(comb, iters, eps))
        assert torch.equal(comb, before)  # the input is left alone


@needs_compiler
def test_native_sinkhorn_takes_non_contiguous_and_empty_inputs():
    comb = _matrices(8, 4, 4).transpose(-1, -2)
    assert not comb.is_contiguous()
    assert torch.equal(sinkhorn(comb, 20, 1e-6), sinkhorn_torch(comb, 20, 1e-6))
    empty = torch.empty(0, 4, 4)
    assert sinkhorn(empty, 20, 1e-6).shape == (0, 4, 4)


@needs_compiler
@pytest.mark.parametrize("shape", [(4, 4), (16, 40, 4, 4)])
def test_native_sinkhorn_gradient_equals_autograd_of_the_torch_ops_bit_for_bit(shape):
    comb = _matrices(*shape, seed=3).requires_grad_()
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(4))
    want = torch.autograd.grad(sinkhorn_torch(comb, 20, 1e-6), comb, grad_out)[0]
    assert kernels.sinkhorn_applies(comb, sinkhorn_torch)
    got = torch.autograd.grad(sinkhorn(comb, 20, 1e-6), comb, grad_out)[0]
    assert torch.equal(got, want)
    # through a non-contiguous upstream gradient and the rest of a graph as well
    upstream = torch.randn(shape[:-2] + (4, 4)).transpose(-1, -2)
    a = torch.autograd.grad((sinkhorn_torch(comb * 2, 20, 1e-6) * upstream).sum(), comb)[0]
    b = torch.autograd.grad((sinkhorn(comb * 2, 20, 1e-6) * upstream).sum(), comb)[0]
    assert torch.equal(a, b)


@needs_compiler
def test_the_first_check_may_happen_under_inference_mode_and_autocast():
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        comb = _matrices(2, 4, 4)
        assert kernels.sinkhorn_applies(comb, sinkhorn_torch)
        assert torch.equal(sinkhorn(comb, 20, 1e-6), sinkhorn_torch(comb, 20, 1e-6))


def test_zero_iterations_use_the_torch_ops():  # the torch loop still normalises the columns once
    comb = _matrices(3, 4, 4)
    assert torch.equal(sinkhorn(comb, 0, 1e-6), sinkhorn_torch(comb, 0, 1e-6))
    assert not torch.equal(sinkhorn(comb, 0, 1e-6), comb)


def test_other_dtypes_and_shapes_use_the_torch_ops():
    assert not kernels.sinkhorn_applies(_matrices(3, 4, 4).double(), sinkhorn_torch)
    assert not kernels.sinkhorn_applies(_matrices(3, 4, 3), sinkhorn_torch)  # not square


@needs_compiler
def test_a_trainer_model_with_native_mhc_equals_stock_transformers(tiny_checkpoint):
    """use_native_mhc (what the trainer and the bootstrap run) changes no logit and no gradient, under BF16 autocast."""
    from checkpoints.hf import load_hf_checkpoint
    from engines.train.hf_model import reference_from_native, use_native_mhc

    cfg, native = load_hf_checkpoint(tiny_checkpoint)
    stock = reference_from_native(cfg, {k: v.clone() for k, v in native.items()}).train()
    patched = use_native_mhc(reference_from_native(cfg, {k: v.clone() for k, v in native.items()}).train(), cfg)
    ids = torch.randint(3, cfg.vocab_size, (4, 19), generator=torch.Generator().manual_seed(1))

    def step(model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids).logits
        logits.float().log_softmax(-1)[..., 7].mean().backward()
        return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    (a, grads_a), (b, grads_b) = step(stock), step(patched)
    assert torch.equal(a, b)
    assert grads_a.keys() == grads_b.keys() and any("hc" in k for k in grads_a)
    assert all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)


@needs_compiler
def test_model_logits_are_identical_with_and_without_native_kernels(monkeypatch, tiny_checkpoint):
    from engines.model import DecodeBatch
    from engines.score import load_ours

    model = load_ours(tiny_checkpoint)
    ids = torch.randint(3, model.cfg.vocab_size, (6, 11), generator=torch.Generator().manual_seed(0))

    def run() -> list[torch.Tensor]:
        with torch.inference_mode():
            logits, caches = model.prefill(ids)
            batch, out = DecodeBatch.from_caches(model.cfg, caches), [logits]
            for step in range(9):  # past a compressed window (rates 4 and 8), so entries are emitted
                out.append(model.decode(ids[:, step], batch))
            return out

    native = run()
    assert kernels.status()["verified"] == {model.cfg.hc_mult: True}
    monkeypatch.setenv("V4RL_NATIVE_KERNELS", "0")
    kernels.reset()
    torch_ops = run()
    assert kernels.status()["verified"] == {}
    assert all(torch.equal(a, b) for a, b in zip(native, torch_ops))


@needs_compiler
def test_build_is_cached_and_leaves_no_partial_file(tmp_path):
    first = kernels.build(tmp_path)
    mtime = first.stat().st_mtime_ns
    assert kernels.build(tmp_path) == first and first.stat().st_mtime_ns == mtime  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]


@pytest.mark.parametrize("compiler, message", [("false", "failed to compile"),
                                               ("v4rl-no-such-compiler", "no C compiler")])
def test_an_unusable_compiler_falls_back_to_the_torch_ops_with_a_warning(monkeypatch, tmp_path, caplog, compiler,
                                                                         message):
    monkeypatch.setenv("CC", compiler)
    monkeypatch.setenv("V4RL_KERNEL_CACHE", str(tmp_path))
    comb = _matrices(5, 4, 4)
    with caplog.at_level(logging.WARNING, logger="v4rl.kernels"):
        assert not kernels.sinkhorn_applies(comb, sinkhorn_torch)
        assert torch.equal(sinkhorn(comb, 20, 1e-6), sinkhorn_torch(comb, 20, 1e-6))
    assert message in kernels.status()["error"]
    assert any("using torch ops" in r.getMessage() and message in r.getMessage() for r in caplog.records)
    assert not list(tmp_path.iterdir())  # no half-written library left behind


@needs_compiler
def test_concurrent_builds_into_one_cache_all_load_the_same_library(tmp_path):
    """Ray actors and server processes start together on a fresh machine: each may compile, none may load a
    half-written file, and one library is left."""
    import subprocess
    import sys

    code = ("import ctypes, sys; from engines.model import kernels; "
            "lib = kernels.build(sys.argv[1]); ctypes.CDLL(str(lib)).v4rl_sinkhorn; print(lib)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
             for _ in range(4)]
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(outputs)) == 1 and [p.name for p in tmp_path.iterdir()] == [Path(outputs[0]).name]
