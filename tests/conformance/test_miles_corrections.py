"""v4rl's rollout corrections (rl/corrections.py) against Miles' own functions, run on CPU in a subprocess on the
same random tensors:

  - tis / icepop: `vanilla_tis_function` / `icepop_function` (miles/backends/training_utils/loss_hub/corrections.py)
    and their `tis`, `tis_clipfrac`, `tis_abs` metrics, in both Miles generations;
  - OPSM: `compute_opsm_mask` (loss_hub/math_utils.py) with the rollout logprobs as the old policy (Miles with
    --use-rollout-logprobs), and `train/train_rollout_kl` as Miles computes it (`compute_approx_kl`);
  - seq-is / geo-mask / seq-mask: `compute_mis_weights` of Miles' MIS example
    (examples/infra_features/train_infer_mismatch_helper/mis.py), weights times its rejection masks, and its
    mask / veto metrics. The vendor tarballs carry no examples/, so this one runs only against a Miles checkout
    in $V4RL_MILES_DIR (31f1ca961 has the file) and skips otherwise.

    .venv/bin/python -m pytest tests/conformance/test_miles_corrections.py -q
"""

from __future__ import annotations

import math

import pytest
import torch

from engines.upstream.sources import engine_python
from rl.corrections import RolloutCorrection, apply_correction, opsm_keep, train_rollout_kl

MIS_EXAMPLE = "examples/infra_features/train_infer_mismatch_helper/mis.py"
GENERATIONS = {1: ("miles_tree", "megatron_tree"), 2: ("miles_gen2_tree", "megatron_gen2_tree")}

# The child gets per-sequence 1-D tensors, as Miles' loss hands them over, and returns per-sequence results.
MILES_CODE = r"""
import sys, importlib.util
from argparse import Namespace
import torch
from miles.backends.training_utils.loss_hub.corrections import icepop_function, vanilla_tis_function
from miles.backends.training_utils.loss_hub.math_utils import compute_approx_kl, compute_opsm_mask

data = torch.load(sys.argv[1])
train, rollout, masks, adv = data["train"], data["rollout"], data["masks"], data["advantages"]
lengths = [len(t) for t in train]
out = {}

def split(flat):
    return list(torch.split(flat, lengths))

for name, fn in (("tis", vanilla_tis_function), ("icepop", icepop_function)):
    low, high = data["bounds"][name]
    args = Namespace(tis_clip_low=low, tis_clip=high)
    pg, _, metrics = fn(args, pg_loss=torch.ones(sum(lengths)), train_log_probs=train, rollout_log_probs=rollout,
                        loss_masks=masks)
    out[name] = {"weights": split(pg), **{k: split(v) for k, v in metrics.items()}}

args = Namespace(opsm_delta=data["opsm_delta"])
keep, count = compute_opsm_mask(args, full_log_probs=train, full_old_log_probs=rollout,
                                advantages=[torch.full((n,), a) for n, a in zip(lengths, adv)], loss_masks=masks)
out["opsm"] = {"keep": split(keep), "count": float(count)}
out["train_rollout_kl"] = split(compute_approx_kl(torch.cat(rollout), torch.cat(train), kl_loss_type="low_var_kl"))

if len(sys.argv) > 3:
    spec = importlib.util.spec_from_file_location("miles_mis_example", sys.argv[3])
    mis = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mis)
    for name, config in data["mis"].items():
        weights, modified, metrics = mis.compute_mis_weights(Namespace(**config), train_log_probs=train,
                                                             rollout_log_probs=rollout, loss_masks=masks)
        out["mis:" + name] = {"weights": [w * m for w, m in zip(weights, modified)],
                              **{k: v for k, v in metrics.items()}}
torch.save(out, sys.argv[2])
"""

# Miles' MIS example configuration of each v4rl mode (mis.yaml's keys; bounds as rl/corrections.py defaults).
_MIS_COMMON = dict(use_tis=True, tis_mode="truncate", tis_lower_bound=0.5, tis_upper_bound=2.0, rs_veto_threshold=1e-4,
                   tis_batch_normalize=False)
MIS_CONFIGS = {
    "seq-is": dict(_MIS_COMMON, use_rs=False, tis_level="sequence", rs_level="sequence", rs_lower_bound=None,
                   rs_upper_bound=None),
    "geo-mask": dict(_MIS_COMMON, use_rs=True, tis_level="token", rs_level="geometric", rs_lower_bound=0.9999,
                     rs_upper_bound=1.0001),
    "seq-mask": dict(_MIS_COMMON, use_rs=True, tis_level="token", rs_level="sequence", rs_lower_bound=0.5,
                     rs_upper_bound=2.0),
}
MIS_METRICS = {"mis_rs_mask_fraction_low": "rs_mask_fraction_low", "mis_rs_mask_fraction_high": "rs_mask_fraction_high",
               "mis_rs_catastrophic_token_fraction": "rs_catastrophic_token_fraction",
               "mis_tis_truncate_fraction": "tis_truncate_fraction"}


def _batch(seed: int = 0):
    """Sequences of different lengths and mismatch scales: near-identical ones (for geo-mask's 1e-4 band), FP8-like
    noise, one with a catastrophic token (ratio 1e-6, below the veto), and interior loss-mask zeros."""
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 9, 3, 12, 7, 1, 10, 6, 8, 4, 11, 2]
    scales = [1e-5, 0.05, 0.3, 1e-6, 0.8, 0.1, 2e-5, 0.02, 0.5, 1e-4, 0.2, 1.0]
    train, rollout, masks = [], [], []
    for i, (n, scale) in enumerate(zip(lengths, scales)):
        r = -torch.rand(n, generator=g) * 3
        t = r + torch.randn(n, generator=g) * scale
        if i == 6:
            t[2] = r[2] + math.log(1e-6)
        m = torch.ones(n)
        if n > 6:
            m[n // 2] = 0.0  # a tool-response token inside the response
        train.append(t), rollout.append(r), masks.append(m)
    advantages = torch.randn(len(lengths), generator=g).tolist()
    return train, rollout, masks, advantages


def _padded(seqs: list[torch.Tensor]) -> torch.Tensor:
    out = torch.zeros(len(seqs), max(len(s) for s in seqs))
    for b, s in enumerate(seqs):
        out[b, :len(s)] = s
    return out


def _run_miles(request, generation: int, tmp_path, with_mis: bool):
    miles, megatron = (request.getfixturevalue(name) for name in GENERATIONS[generation])
    train, rollout, masks, advantages = _batch()
    data = {"train": train, "rollout": rollout, "masks": masks, "advantages": advantages, "opsm_delta": 1e-4,
            "bounds": {"tis": RolloutCorrection(mode="tis").clip_bounds,
                       "icepop": RolloutCorrection(mode="icepop").clip_bounds}, "mis": MIS_CONFIGS}
    torch.save(data, tmp_path / "in.pt")
    args = [str(tmp_path / "in.pt"), str(tmp_path / "out.pt")]
    if with_mis:
        example = miles / MIS_EXAMPLE
        if not example.is_file():
            pytest.skip(f"Miles' MIS example {MIS_EXAMPLE} is not in {miles} (the vendor tarballs carry no "
                        "examples/); set V4RL_MILES_DIR to a Miles checkout (31f1ca961 has it) to compare seq-is, "
                        "geo-mask and seq-mask with Miles' own compute_mis_weights")
        args.append(str(example))
    # Miles wraps some of these in torch.compile, whose inductor needs triton (stubbed here): run them eagerly
    engine_python(MILES_CODE, [miles, megatron], args=args, env={"TORCHDYNAMO_DISABLE": "1"}, timeout=600)
    theirs = torch.load(tmp_path / "out.pt")
    return theirs, (_padded(train), _padded(rollout), _padded(masks).bool(), torch.tensor(advantages), masks)


def _valid(per_seq: list[torch.Tensor], masks: list[torch.Tensor]) -> torch.Tensor:
    """Miles' per-sequence values at loss-mask tokens, in v4rl's row-major order."""
    return torch.cat([v.float()[m.bool()] for v, m in zip(per_seq, masks)])


def _token_mean(per_seq: list[torch.Tensor], masks: list[torch.Tensor]) -> float:
    return float(_valid(per_seq, masks).mean())


@pytest.mark.parametrize("generation", [1, 2])
def test_tis_icepop_opsm_and_kl_equal_miles(request, generation, tmp_path):
    theirs, (train, rollout, mask, advantages, masks) = _run_miles(request, generation, tmp_path, with_mis=False)
    for mode in ("tis", "icepop"):
        ours = apply_correction(RolloutCorrection(mode=mode), train, rollout, mask)
        torch.testing.assert_close(ours.weights[mask], _valid(theirs[mode]["weights"], masks), rtol=1e-6, atol=1e-7)
        assert 0 < ours.token_metrics["tis_clipfrac"] < 1, mode  # the batch exercises the bounds
        for key in ("tis", "tis_clipfrac", "tis_abs"):
            assert ours.token_metrics[key] == pytest.approx(_token_mean(theirs[mode][key], masks), rel=1e-5), (mode,
                                                                                                               key)
    keep = opsm_keep(train, rollout, advantages, mask, delta=1e-4)
    assert keep[mask].tolist() == _valid(theirs["opsm"]["keep"], masks).bool().tolist()
    assert 0 < (~keep[mask]).sum() < mask.sum()
    # Miles' opsm_clipfrac adds up per-token masks divided by the sequence's loss-mask count: the number of masked
    # sequences when every token is in the loss (here the interior zeros make it a bit larger), never a share
    assert theirs["opsm"]["count"] >= int((~keep & mask).any(dim=1).sum())
    torch.testing.assert_close(train_rollout_kl(train, rollout, mask)[mask],
                               _valid(theirs["train_rollout_kl"], masks), rtol=1e-5, atol=1e-7)


def test_sequence_modes_equal_miles_mis_example(request, tmp_path):
    theirs, (train, rollout, mask, _, masks) = _run_miles(request, 1, tmp_path, with_mis=True)
    for mode in MIS_CONFIGS:
        ours = apply_correction(RolloutCorrection(mode=mode), train, rollout, mask)
        mis = theirs[f"mis:{mode}"]
        torch.testing.assert_close(ours.weights[mask], _valid(mis["weights"], masks), rtol=1e-5, atol=1e-7)
        for key, miles_key in MIS_METRICS.items():
            if key in ours.token_metrics:
                assert ours.token_metrics[key] == pytest.approx(_token_mean(mis[miles_key], masks), abs=1e-6), (mode,
                                                                                                                key)
        if mode != "seq-is":
            masked = float(ours.sequence_metrics["correction_masked_seq_frac"])
            assert 0 < masked < 1, mode  # some sequences rejected, some kept
