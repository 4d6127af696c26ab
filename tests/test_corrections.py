"""Rollout-correction modes (rl/corrections.py) on hand-computable cases; Miles' own functions are compared in
tests/conformance/test_miles_corrections.py.

    .venv/bin/python -m pytest tests/test_corrections.py -q
"""

from __future__ import annotations

import math

import pytest
import torch

from rl.corrections import (MODES, RolloutCorrection, apply_correction, opsm_keep, rejection_keep,
                            sequence_is, token_mask, token_truncate, train_rollout_kl)
from rl.grpo import GRPOConfig, policy_loss

LN2 = math.log(2.0)


def lp(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype))


def test_token_truncate_is_todays_tis() -> None:
    w, clipped = token_truncate(lp([LN2 * 2, -LN2, 0.0]), torch.zeros(1, 3), clip_low=0.0, clip_high=2.0)
    close(w, [[2.0, 0.5, 1.0]])
    assert clipped.tolist() == [[True, False, False]]


def test_icepop_zeroes_out_of_range_and_passes_the_ratio_through() -> None:
    train = lp([LN2 * 2, -LN2 * 2, math.log(1.5), -LN2])
    w, rejected = token_mask(train, torch.zeros(1, 4), torch.tensor([[1, 1, 1, 0]]), clip_low=0.5, clip_high=2.0)
    close(w, [[0.0, 0.0, 1.5, 0.0]])  # 4 and 0.25 out; the padded token is 0, not rejected
    assert rejected.tolist() == [[True, True, False, False]]


def test_sequence_is_one_clamped_product_per_sequence() -> None:
    train = lp([0.1, 0.2, 0.0], [LN2, LN2, 0.0], [-LN2, 0.0, 0.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1]])
    w, clipped = sequence_is(train, torch.zeros(3, 3), mask, clip_high=2.0)
    close(w[0], [math.exp(0.3), math.exp(0.3), 0.0])
    close(w[1], [2.0] * 3)  # product 4, truncated
    close(w[2], [0.5] * 3)  # no lower bound by default (Miles' truncate)
    assert clipped.tolist() == [[False, False, False], [True] * 3, [False] * 3]


def test_geometric_and_sequence_rejection_and_the_veto() -> None:
    # row 0: mean log-ratio 0.00005 (geometric 1.00005, kept); row 1: mean 0.001 (masked above);
    # row 2: one token at ratio 1e-5 below the veto; row 3: -0.001 (masked below)
    train = lp([0.0001, 0.0], [0.002, 0.0], [math.log(1e-5), -math.log(1e-5)], [-0.002, 0.0])
    mask = torch.ones(4, 2)
    keep, why = rejection_keep(train, torch.zeros(4, 2), mask, level="geometric", reject_low=0.9999,
                               reject_high=1.0001, veto_threshold=1e-4)
    assert keep.tolist() == [[True, True], [False, False], [False, False], [False, False]]
    assert why["high"][1].all() and why["low"][3].all() and why["catastrophic_token"][2].tolist() == [True, False]
    assert why["catastrophic_seq"][2].all() and not why["catastrophic_seq"][[0, 1, 3]].any()
    keep, _ = rejection_keep(train, torch.zeros(4, 2), mask, level="sequence", reject_low=0.5, reject_high=2.0,
                             veto_threshold=None)
    assert keep.all()  # products within [0.5, 2]; row 2's product is exactly 1 and nothing vetoes


def test_opsm_masks_negative_advantage_sequences_past_delta_only() -> None:
    current = torch.zeros(3, 2)
    behaviour = lp([0.001, 0.001], [0.001, 0.001], [0.00005, 0.00005])  # seq KL 1e-3, 1e-3, 5e-5
    keep = opsm_keep(current, behaviour, torch.tensor([-1.0, 1.0, -1.0]), torch.ones(3, 2), delta=1e-4)
    assert keep.tolist() == [[False, False], [True, True], [True, True]]


def test_train_rollout_kl_is_k3_of_rollout_against_train() -> None:
    kl = train_rollout_kl(lp([0.5, -1.0]), torch.zeros(1, 2))
    close(kl, [[math.exp(0.5) - 1.5, math.exp(-1.0)]])


def test_apply_correction_metrics_per_mode() -> None:
    train = lp([LN2 * 2, 0.0], [0.0, 0.0])
    rollout, mask = torch.zeros(2, 2), torch.ones(2, 2)
    tis = apply_correction(RolloutCorrection(), train, rollout, mask)
    close(tis.weights, [[2.0, 1.0], [1.0, 1.0]])
    assert tis.token_metrics["tis_clipfrac"] == 0.25 and tis.token_metrics["tis"] == pytest.approx(7 / 4)
    assert tis.token_metrics["train_rollout_kl"] == pytest.approx((4 - 1 - 2 * LN2) / 4)
    icepop = apply_correction(RolloutCorrection(mode="icepop"), train, rollout, mask)
    close(icepop.weights, [[0.0, 1.0], [1.0, 1.0]])
    assert icepop.token_metrics["correction_masked_token_frac"] == 0.25
    assert icepop.sequence_metrics["correction_masked_seq_frac"] == 0.0
    geo = apply_correction(RolloutCorrection(mode="geo-mask"), train, rollout, mask)
    close(geo.weights, [[0.0, 0.0], [1.0, 1.0]])  # row 0's geometric mean is 2
    assert geo.token_metrics["mis_rs_mask_fraction_high"] == 0.5
    assert geo.sequence_metrics["correction_masked_seq_frac"] == 0.5
    assert apply_correction(RolloutCorrection(mode="none"), train, rollout, mask).weights is None


def test_opsm_combines_with_any_mode_and_needs_advantages() -> None:
    train, rollout = torch.zeros(2, 2), torch.full((2, 2), 0.01)  # the rollout engine was surer: seq KL 0.01
    setting = RolloutCorrection(mode="none", opsm=True)
    result = apply_correction(setting, train, rollout, torch.ones(2, 2), torch.tensor([-1.0, 1.0]))
    assert result.weights.tolist() == [[0.0, 0.0], [1.0, 1.0]]
    assert result.sequence_metrics["opsm_clipfrac"] == 0.5
    with pytest.raises(ValueError, match="OPSM needs the advantages"):
        apply_correction(setting, train, rollout, torch.ones(2, 2))


def test_masked_tokens_keep_their_place_in_the_denominator() -> None:
    """A rejected token contributes 0 to the loss but still counts in D (Miles: masks correct the numerator)."""
    logprobs = torch.zeros(1, 2, requires_grad=True)
    weights = apply_correction(RolloutCorrection(mode="icepop"), lp([LN2 * 2, 0.0]), torch.zeros(1, 2),
                               torch.ones(1, 2)).weights
    loss, _ = policy_loss(logprobs, logprobs.detach(), torch.tensor([1.0]), torch.ones(1, 2), tis_weights=weights)
    loss.backward()
    assert logprobs.grad.tolist() == [[0.0, -0.5]]


def test_padding_garbage_never_reaches_a_weight() -> None:
    train = lp([0.0, float("inf")], [0.0, float("nan")])
    mask = torch.tensor([[1, 0], [1, 0]])
    for mode in MODES:
        result = apply_correction(RolloutCorrection(mode=mode, opsm=True), train, torch.zeros(2, 2), mask,
                                  torch.tensor([-1.0, 1.0]))
        assert result.weights.tolist() == [[1.0, 0.0], [1.0, 0.0]], mode


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"mode": "tls"}, r"'tls' is not one of none, tis, icepop, seq-is, geo-mask, seq-mask"),
    ({"mode": "icepop", "clip_low": 1.2}, r"must contain 1 .* icepop's defaults \(0.5, 2.0\)"),
    ({"mode": "tis", "reject_low": 0.9}, "apply to geo-mask and seq-mask only"),
    ({"mode": "geo-mask", "reject_high": 0.99}, r"geo-mask's defaults \(0.9999, 1.0001\)"),
    ({"veto_threshold": 0.0}, "leave it empty to disable the veto"),
    ({"opsm_delta": -1.0}, "opsm_delta=-1.0 must be a finite number >= 0"),
])
def test_invalid_settings_say_the_fix(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RolloutCorrection(**kwargs)


def test_setting_round_trips_through_its_dict_and_a_mode_name() -> None:
    setting = RolloutCorrection(mode="seq-mask", opsm=True, opsm_delta=1e-3)
    assert RolloutCorrection.coerce(setting.to_dict()) == setting
    assert RolloutCorrection.coerce("icepop").clip_bounds == (0.5, 2.0)
    assert GRPOConfig(rollout_correction={"mode": "icepop"}).rollout_correction.mode == "icepop"
    with pytest.raises(ValueError, match=r"rollout_correction: unknown field 'use_tis'"):
        RolloutCorrection.coerce({"use_tis": True})


def test_every_field_has_the_docstring_the_cli_and_the_flow_show() -> None:
    from rl.field_docs import field_docs

    docs = field_docs("rl.correction_setting", "RolloutCorrection")
    assert set(docs) == set(RolloutCorrection.__dataclass_fields__)
    assert docs["opsm_delta"].startswith("OPSM's threshold")


def test_cli_flags_reach_the_training_config(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import engines.train.run as run_module
    from v4rl.cli import app

    seen = []
    monkeypatch.setattr(run_module, "run_training", lambda out, config, **kw: seen.append(config) or {"evals": []})
    result = CliRunner().invoke(app, ["train", "--out", str(tmp_path / "run"), "--rollout-correction", "geo-mask",
                                      "--opsm", "--opsm-delta", "0.001"])
    assert result.exit_code == 0, result.output
    assert seen[0].rollout_correction == RolloutCorrection(mode="geo-mask", opsm=True, opsm_delta=0.001)
    assert seen[0].to_dict()["rollout_correction"]["mode"] == "geo-mask"  # what config.json records


def test_cli_bad_mode_is_one_line_and_leaves_no_run_directory(tmp_path):
    from typer.testing import CliRunner

    from v4rl.cli import app

    result = CliRunner().invoke(app, ["train", "--out", str(tmp_path / "run"), "--rollout-correction", "tls"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "error: --rollout-correction / --opsm-delta: rollout correction mode 'tls' is not one of none, tis, icepop, "
        "seq-is, geo-mask, seq-mask; use tis (the seed's token TIS) or none"]
    assert not (tmp_path / "run").exists()


def test_flow_parameters_reach_the_trainer_and_the_miles_job():
    from pydantic import ValidationError

    from flows.params import PipelineParams

    tiny = PipelineParams.preset_defaults("tiny-cpu", rollout_correction="seq-mask", opsm=True)
    assert tiny.backend().config.rollout_correction == RolloutCorrection(mode="seq-mask", opsm=True)
    assert tiny.training_fingerprint() != PipelineParams.preset_defaults("tiny-cpu").training_fingerprint()
    assert PipelineParams.preset_defaults("dsv4-flash-mi355x", rollout_correction="none").miles_overrides()[
        "rollout_correction"]["mode"] == "none"
    assert "rollout_correction" not in PipelineParams.preset_defaults("dsv4-flash-mi355x").miles_overrides()
    icepop = PipelineParams.preset_defaults("dsv4-flash-mi355x", rollout_correction="icepop", opsm=True)
    assert icepop.miles_overrides()["rollout_correction"] == RolloutCorrection(mode="icepop", opsm=True).to_dict()
    with pytest.raises(ValidationError, match="needs Miles' examples/.*use 'icepop' on dsv4-flash-mi355x"):
        PipelineParams.preset_defaults("dsv4-flash-mi355x", rollout_correction="geo-mask")
    with pytest.raises(ValidationError, match="opsm_delta"):
        PipelineParams.preset_defaults("tiny-cpu", opsm_delta=-1.0)
    with pytest.raises(ValidationError, match="rollout_correction"):
        PipelineParams.preset_defaults("tiny-cpu", rollout_correction="tls")


def test_each_mode_becomes_miles_flags_on_a_cluster_preset():
    """engines/miles/train_args.py correction_args: the flags Miles' own code reads for each mode (parsed by
    Miles' parser in tests/conformance/test_miles_corrections_cluster.py); MIS modes refused in one line."""
    from engines.presets.runs import SEED_RUN, apply_overrides
    from engines.miles.train_args import ICEPOP_FUNCTION, correction_args, misc_args

    def flags(**setting):
        return correction_args(apply_overrides(SEED_RUN, {"rollout_correction": setting})[0])

    assert correction_args(SEED_RUN) == flags(mode="tis") == ["--use-tis"]  # Miles' default bounds 0 / 2
    assert flags(mode="none") == []
    assert flags(mode="tis", clip_low=0.1, clip_high=3.0) == ["--use-tis", "--tis-clip", "3", "--tis-clip-low", "0.1"]
    assert flags(mode="icepop") == ["--use-tis", "--tis-clip-low", "0.5", "--custom-tis-function-path",
                                    ICEPOP_FUNCTION]
    assert flags(mode="none", opsm=True, opsm_delta=1e-3) == ["--use-opsm", "--opsm-delta", "0.001"]
    for mode, instead in (("seq-is", "tis"), ("geo-mask", "icepop"), ("seq-mask", "icepop")):
        with pytest.raises(ValueError, match=f"'{mode}' needs Miles' examples/.*use '{instead}' on the cluster"):
            flags(mode=mode)
    from engines.presets.runs import layout_input
    from engines.profiles import get_profile

    profile = get_profile(SEED_RUN.profile)
    cluster = layout_input(SEED_RUN, profile=profile).cluster
    replay, _ = apply_overrides(SEED_RUN, {"rollout_correction": {"mode": "tis", "routing_replay": True}})
    assert "--use-rollout-routing-replay" in misc_args(replay, cluster, profile)
    assert "--use-rollout-routing-replay" not in misc_args(SEED_RUN, cluster, profile)
