"""The CPU stand-in of TE's FusedAdam (engines/upstream/probes/standins/transformer_engine/pytorch/optimizers.py):
the kernel's update (AdamW and L2 mode) equals torch's AdamW / Adam step for step, its state is TE's (moments per
parameter, `step` in the param group, absent before the first step), and it survives a state-dict round trip.

    .venv/bin/python -m pytest tests/test_fused_adam_standin.py -q
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from engines.upstream.miles_model_check import STANDINS


def _fused_adam():
    spec = importlib.util.spec_from_file_location(
        "te_optimizers_standin", STANDINS / "transformer_engine" / "pytorch" / "optimizers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FusedAdam


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(7, 5, generator=g)), torch.nn.Parameter(torch.randn(3, generator=g))]


def _grads(params, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


@pytest.mark.parametrize("adam_w_mode,reference", [(True, torch.optim.AdamW), (False, torch.optim.Adam)])
def test_update_equals_torchs_adam(adam_w_mode, reference):
    ours, theirs = _params(0), _params(0)
    kw = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    opt, ref = _fused_adam()(ours, adam_w_mode=adam_w_mode, **kw), reference(theirs, **kw)
    for step in range(5):
        _grads(ours, step)
        _grads(theirs, step)
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert not torch.equal(a, _params(0)[0] if a.shape == (7, 5) else _params(0)[1])  # it moved


def test_state_is_tes_and_round_trips():
    params = _params(1)
    opt = _fused_adam()(params, lr=1e-2)
    assert "step" not in opt.param_groups[0] and len(opt.state) == 0  # TE: nothing before the first step
    _grads(params, 0)
    opt.step()
    assert opt.param_groups[0]["step"] == 1 and set(opt.state[params[0]]) == {"exp_avg", "exp_avg_sq"}
    saved = copy.deepcopy(opt.state_dict())  # as written to disk (torch's state_dict holds the live tensors)
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = _fused_adam()(fresh_params, lr=1e-2)
    fresh.load_state_dict(saved)
    for opt_, ps in ((opt, params), (fresh, fresh_params)):
        _grads(ps, 1)
        opt_.step()
    assert fresh.param_groups[0]["step"] == 2
    for a, b in zip(params, fresh_params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_precision_aware_options_are_refused_in_one_line():
    with pytest.raises(RuntimeError, match="master_weights not supported; turn off --use-precision-aware-optimizer"):
        _fused_adam()(_params(2), master_weights=True)
