"""The fused kernels' check (engines/model/fused_check.py): judged once per model config on synthetic weights against
a float64 run of the torch ops, on the torch ops' own float32 error scale. Trained weights pass (they never enter),
a planted kernel error fails with one warning and falls back to the torch ops, and the check runs once per config.

    .venv/bin/python -m pytest tests/test_fused_check.py -q                  # default: three checks
    .venv/bin/python -m pytest tests/test_fused_check.py -q -m slow          # every kernel, 0.1% and 1e-5 errors
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import threading

import pytest
import torch

from engines.model import fused, fused_check, kernels
from engines.model.fused_check import ERROR_FACTOR, Float64Reference, check_config
from tests.test_kernels import _generation  # prefill then cached decode, logits per step

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")


@pytest.fixture(autouse=True)
def fresh_kernel_state(monkeypatch):
    """No verdict kept by an earlier process (fused.saved_check): every check here runs, on the kernels as patched."""
    monkeypatch.setenv("V4RL_FUSED_CHECK_CACHE", "0")
    kernels.reset()
    yield
    kernels.reset()


@pytest.fixture
def check_calls(monkeypatch) -> list:
    """Every config fused_check.check_config is run on (the check itself, counted)."""
    calls, real = [], fused_check.check_config
    monkeypatch.setattr(fused_check, "check_config", lambda cfg, **kw: calls.append(cfg) or real(cfg, **kw))
    return calls


def _trained_base(tiny_base):
    from checkpoints.hf import load_hf_checkpoint
    from engines.model import DeepseekV4

    cfg, state = load_hf_checkpoint(tiny_base)
    model = DeepseekV4(cfg).eval().requires_grad_(False)
    model.load_state_dict(state, strict=False)
    model.fused_kernels = True
    return model


def _planted(name: str, relative: float):
    """fused.<name> with every value it produces off by `relative`, the sign alternating along the last axis (a
    uniform scale would vanish in the norms that follow some kernels); in-place kernels: the rows they write."""
    real = getattr(fused, name)

    def off(t: torch.Tensor) -> torch.Tensor:
        sign = torch.ones(t.shape[-1])
        sign[1::2] = -1
        return t * (1 + relative * sign)

    if name == "hc_pre":
        def planted(*a, **k):
            post, comb, x = real(*a, **k)
            return post, comb, off(x)
    elif name == "kv_store":
        def planted(x, w, eps, cos, sin, positions, window):
            real(x, w, eps, cos, sin, positions, window)
            rows, slots = torch.arange(window.shape[0]), positions % window.shape[1]
            window[rows, slots] = off(window[rows, slots])
    elif name == "compress_step":
        def planted(kv, gate, positions, slots, compressor):
            real(kv, gate, positions, slots, compressor)
            closing = (positions % compressor.rate == compressor.rate - 1).nonzero()[:, 0]
            index = positions[closing] // compressor.rate
            slots.entries[closing, index] = off(slots.entries[closing, index])
    else:
        def planted(*a, **k):
            return off(real(*a, **k))
    return planted


# ---------------------------------------------------------------------------------------------- the reference
def test_float64_reference_promotes_every_float32_operand_and_cast():
    x = torch.randn(5, 7)
    with Float64Reference():
        assert (x.float() * 3).dtype == torch.float64  # .float() means float64 inside
        assert x.softmax(-1, dtype=torch.float32).dtype == torch.float64
        assert torch.zeros(3).dtype == torch.float64  # factories too
        assert torch.nn.functional.linear(x, torch.randn(2, 7)).dtype == torch.float64
        assert torch.arange(3).dtype == torch.int64  # integers stay
    assert x.dtype == torch.float32  # inputs are promoted where read, not changed


def test_float64_reference_records_near_ties_of_top_k_decisions():
    scores = torch.tensor([[3.0, 1.0, 2.0, 0.0], [1.0, 1.0 + 1e-6, 0.0, -1.0], [5.0, 4.0, 3.0, 3.0]])
    with Float64Reference(index_topk=2) as reference:
        torch.topk(scores, 1, dim=-1)  # row 1: first vs second within NEAR_TIE
        torch.sort(scores, dim=-1, descending=True, stable=True)  # row 2: 2nd vs 3rd are apart (4 vs 3); none
        torch.sort(scores[2:, 1:], dim=-1, descending=True)  # keeps 2 of [4, 3, 3]: 3 vs 3, a tie (row 0 here)
    assert reference.near_ties == [1, 0]


@needs_compiler
def test_the_torch_ops_run_under_the_reference_are_float64_and_near_float32():
    """The reference is a float64 run of the very torch ops (a model bug would be in both paths), within float32
    rounding of the float32 run."""
    from engines.presets.models import tiny_cpu_model_config

    model = fused_check.synthetic_model(tiny_cpu_model_config())
    ids = torch.randint(3, model.cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        with Float64Reference():
            ref = model(ids)
        want = model(ids)
    assert ref.dtype == torch.float64 and want.dtype == torch.float32
    assert 0 < (ref - want).abs().max() < 1e-4


# ---------------------------------------------------------------------------------------------- the verdicts
@needs_compiler
def test_the_check_passes_for_the_committed_trained_base_and_the_engine_runs_fused(tiny_base, check_calls,
                                                                                  monkeypatch):
    """The trained base (sharp distributions that made the old check on live weights fall back) runs on the fused
    kernels in the rollout engine; the check ran once, at engine start, and its numbers are reported."""
    from engines.model.fused_model import FusedModel, shape_signature
    from engines.rollout.api import RequestSpec
    from engines.rollout.sampling import SamplingParams
    from engines.rollout.engine import RolloutEngine

    fused_steps = []
    real_decode = FusedModel.decode
    monkeypatch.setattr(FusedModel, "decode", lambda self, *a, **k: fused_steps.append(1) or real_decode(self, *a, **k))
    engine = RolloutEngine(tiny_base)
    try:
        assert len(check_calls) == 1  # at start, before any request
        state = engine.status()["native_kernels"]["fused_decode"]
        signature = shape_signature(engine.cfg)
        assert state["checked"] == {signature: True}
        details = state["check_details"][signature]
        assert details["passed"] and details["worst_ratio"] <= ERROR_FACTOR and details["seconds"] > 0
        [out] = engine.generate([RequestSpec(rid="a", input_ids=[0, 5, 9, 11], seed=1,
                                             sampling=SamplingParams(max_new_tokens=4, ignore_eos=True))])
        assert len(out.output_ids) == 4 and len(fused_steps) >= 3  # decode steps ran fused
        assert len(check_calls) == 1
    finally:
        engine.shutdown()


@needs_compiler
def test_a_planted_kernel_error_fails_the_check_with_one_warning_and_falls_back(tiny_base, monkeypatch, caplog,
                                                                               check_calls):
    """0.1% relative on each value of sink attention's output: far outside the torch ops' float32 error; the run
    uses the torch ops (exactly their numbers), warned about once however many models of the config ask."""
    monkeypatch.setattr(fused, "attend", _planted("attend", 1e-3))
    model = _trained_base(tiny_base)
    with caplog.at_level(logging.WARNING, logger="v4rl.kernels"):
        assert not model.fused.usable()
        assert not _trained_base(tiny_base).fused.usable()  # a second model of the config: the verdict is kept
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "differ from the torch ops" in warnings[0]
    assert "from float64" in warnings[0] and "Report this with your compiler and CPU" in warnings[0]
    assert len(check_calls) == 1
    assert list(kernels.status()["fused_decode"]["checked"].values()) == [False]
    ids = torch.randint(3, model.cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(4))
    out = _generation(model, ids, 3)
    model.fused_kernels = False
    assert all(torch.equal(a, b) for a, b in zip(out, _generation(model, ids, 3)))


def test_the_check_runs_once_per_config_not_per_model_or_thread(tiny_base, monkeypatch):
    """Counted with a stand-in verdict (the real check's cost is not the point here): three models of one config
    (trained and synthetic weights) asking at once from three threads get one check; another config its own."""
    import time

    from engines.model import DeepseekV4
    from engines.model.fused_check import CheckResult
    from engines.model.fused_model import FusedModel

    calls = []

    def counted(cfg, **kw):
        calls.append(cfg)
        time.sleep(0.2)  # long enough for the other threads to ask meanwhile
        return CheckResult(True, None, 1.0, "stand-in", "all rows", 0.2)

    monkeypatch.setattr(fused_check, "check_config", counted)
    monkeypatch.setattr(fused, "library", lambda: object())  # no build needed for a stand-in verdict
    trained = _trained_base(tiny_base)
    synthetic = fused_check.synthetic_model(trained.cfg, seed=5)  # other weights, same config
    results = []
    threads = [threading.Thread(target=lambda m=m: results.append(FusedModel(m).usable()))
               for m in (trained, synthetic, trained)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 3 and len(calls) == 1
    other = dataclasses.replace(trained.cfg, sliding_window=16)  # another config: checked on its own
    assert DeepseekV4(other).eval().fused.usable()
    assert len(calls) == 2 and len(fused.status()["checked"]) == 2


# ---------------------------------------------------------------------------------------------- every kernel
KERNELS = ("hc_pre", "hc_post", "rms_norm", "heads_norm_rope", "kv_store", "compress_step", "attend", "linear", "moe")


@needs_compiler
@pytest.mark.slow
@pytest.mark.parametrize("relative", [1e-3, 1e-5])
@pytest.mark.parametrize("kernel", KERNELS)
def test_an_error_in_any_kernel_fails_the_check(monkeypatch, kernel, relative):
    from engines.presets.models import tiny_cpu_model_config

    monkeypatch.setattr(fused, kernel, _planted(kernel, relative))
    result = check_config(tiny_cpu_model_config())
    assert not result.passed and result.worst_ratio > ERROR_FACTOR, result
