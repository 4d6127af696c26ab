"""Pins the GRPO + TIS math (rl.grpo) and DAPO dynamic sampling (rl.dynamic_sampling).

A sign error in the surrogate, a clip applied on the wrong side, padding leaking into the token
mean or a TIS weight that carries gradient would all still "train" while silently learning the
wrong thing, so each is checked on tiny hand-computed tensors, including gradient signs.
CPU only, well under a second.
"""

from __future__ import annotations

import doctest
import math
import warnings

import pytest
import torch

import rl.dynamic_sampling
import rl.grpo
from rl.dynamic_sampling import (
    DynamicSampler,
    DynamicSamplingWarning,
    filter_groups,
    has_signal,
)
from rl.grpo import (GRPOConfig, approx_kl, group_advantages, grpo_loss, policy_loss, step_denominator, tis_metrics,
                     tis_weights)

NUM_GPUS = 0


@pytest.mark.parametrize("module", [rl.grpo, rl.dynamic_sampling])
def test_docstring_examples_run(module) -> None:
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0


# --------------------------------------------------------------------------- advantages


def test_advantages_zero_mean_unit_std_per_group() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0, 1.0], [0.2, 0.9, 0.4, 0.4, 0.1]])
    adv = group_advantages(rewards, eps=0.0)
    assert adv.shape == rewards.shape and adv.dtype == torch.float32
    torch.testing.assert_close(adv.mean(dim=1), torch.zeros(2), atol=1e-6, rtol=0)
    torch.testing.assert_close(adv.std(dim=1), torch.ones(2), atol=1e-6, rtol=0)  # unbiased std, as Miles/verl
    expected = (rewards - rewards.mean(1, keepdim=True)) / rewards.std(1, keepdim=True)
    torch.testing.assert_close(adv, expected)
    assert adv[0, 0] > 0 > adv[0, 1]  # better than the group mean -> positive


def test_all_equal_group_gives_exact_zeros() -> None:
    # 0.1 is not exact in binary: mean - value can be ~1e-9, which / eps would be ~1e-3.
    rewards = torch.tensor([[0.1] * 8, [0.0] * 8, [1.0] * 8, [0.0] * 7 + [1.0]])
    adv = group_advantages(rewards)
    assert torch.equal(adv[:3], torch.zeros(3, 8))
    assert adv[3, 7] > 0 and (adv[3, :7] < 0).all()


def test_advantages_without_std_normalisation() -> None:
    adv = group_advantages(torch.tensor([[0.0, 0.0, 0.0, 4.0]]), normalize_std=False)
    torch.testing.assert_close(adv, torch.tensor([[-1.0, -1.0, -1.0, 3.0]]))


@pytest.mark.parametrize(
    ("rewards", "message"),
    [
        (torch.zeros(8), "reshape"),
        (torch.zeros(4, 1), "at least 2 samples"),
        (torch.tensor([[0.0, float("nan")], [1.0, 0.0]]), r"non-finite rewards in groups \[0\]"),
    ],
)
def test_advantages_reject_bad_input(rewards: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        group_advantages(rewards)


# --------------------------------------------------------------------------- TIS


def test_tis_weights_clamp_detach_and_clipfrac() -> None:
    train = torch.tensor([[0.0, 1.0, -0.5, -30.0], [0.3, 0.0, 5.0, float("nan")]], requires_grad=True)
    rollout = torch.zeros(2, 4)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    w, clipfrac = tis_weights(train, rollout, mask, clip_high=2.0, clip_low=0.5)
    assert not w.requires_grad
    expected = torch.tensor([[1.0, 2.0, math.exp(-0.5), 0.5], [math.exp(0.3), 1.0, 0.0, 0.0]])
    torch.testing.assert_close(w, expected)
    # clipped among the 6 unmasked: exp(1) > 2 and exp(-30) < 0.5; the masked 5.0 and NaN don't count
    assert clipfrac == pytest.approx(2 / 6)


def test_tis_defaults_never_clip_low_and_empty_mask() -> None:
    w, clipfrac = tis_weights(torch.tensor([-50.0, 0.69]), torch.zeros(2))
    assert clipfrac == 0.0 and w[0] > 0  # clip_low=0: small ratios pass through
    _, clipfrac = tis_weights(torch.ones(3), torch.zeros(3), torch.zeros(3))
    assert clipfrac == 0.0
    with pytest.raises(ValueError, match="same response tokens"):
        tis_weights(torch.zeros(3), torch.zeros(4))


def test_tis_metrics() -> None:
    train, rollout = torch.tensor([[0.1, -0.2, 9.0]]), torch.tensor([[0.0, 0.0, 0.0]])
    m = tis_metrics(train, rollout, torch.tensor([[1, 1, 0]]))
    assert m["train_rollout_logprob_abs_diff"] == pytest.approx(0.15)
    assert m["tis"] == pytest.approx((math.exp(0.1) + math.exp(-0.2)) / 2)
    assert m["tis_abs"] == pytest.approx((math.exp(0.1) - 1 + 1 - math.exp(-0.2)) / 2)
    assert m["tis_clipfrac"] == 0.0


# --------------------------------------------------------------------------- policy loss


def test_positive_advantage_gradient_raises_logprob() -> None:
    lp = torch.full((2, 3), -1.0, requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    loss, metrics = policy_loss(lp, lp.detach(), adv, torch.ones(2, 3))
    loss.backward()
    assert (lp.grad[0] < 0).all()  # descent raises logprobs of the good response
    assert (lp.grad[1] > 0).all()  # and lowers those of the bad one
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0] * 3, [1.0] * 3]) / 6)
    assert metrics["pg_clipfrac"] == 0.0 and metrics["ppo_kl"] == 0.0
    # one SGD step lowers the loss
    with torch.no_grad():
        lp2 = lp - 0.1 * lp.grad
    loss2, _ = policy_loss(lp2, lp.detach(), adv, torch.ones(2, 3))
    assert loss2 < loss


def _grad_at_ratio(ratio: float, advantage: float) -> tuple[float, float]:
    old = torch.tensor([[-1.0]])
    lp = (old + math.log(ratio)).clone().requires_grad_(True)
    loss, metrics = policy_loss(lp, old, torch.tensor([advantage]), torch.ones(1, 1))
    loss.backward()
    return float(lp.grad), metrics["pg_clipfrac"]


@pytest.mark.parametrize(
    ("ratio", "advantage", "clipped"),
    [
        (1.25, 1.0, False),  # inside 1 + 0.28: still pushed up
        (1.30, 1.0, True),  # beyond 1 + 0.28: no more push
        (0.85, -1.0, False),  # inside 1 - 0.2: still pushed down
        (0.75, -1.0, True),  # beyond 1 - 0.2: no more push
        (1.35, -1.0, False),  # pessimistic bound: a bad token that grew is always pushed down
        (0.50, 1.0, False),  # and a good token that shrank is always pushed up
    ],
)
def test_clip_higher_is_asymmetric(ratio: float, advantage: float, clipped: bool) -> None:
    grad, clipfrac = _grad_at_ratio(ratio, advantage)
    if clipped:
        assert grad == 0.0 and clipfrac == 1.0
    else:
        assert clipfrac == 0.0
        assert grad == pytest.approx(-advantage * ratio)  # d(-A * exp(lp - old))/dlp


def test_clip_high_and_low_are_separate_knobs() -> None:
    old, lp = torch.zeros(1, 1), torch.full((1, 1), math.log(1.25))
    _, m = policy_loss(lp, old, torch.tensor([1.0]), torch.ones(1, 1), clip_low=0.2, clip_high=0.2)
    assert m["pg_clipfrac"] == 1.0  # symmetric PPO would clip 1.25; clip-higher (0.28) does not
    _, m = policy_loss(lp, old, torch.tensor([1.0]), torch.ones(1, 1), clip_low=0.2, clip_high=0.28)
    assert m["pg_clipfrac"] == 0.0


def test_token_mean_over_mask_ignores_padding() -> None:
    lp = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, float("inf"), float("-inf")]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    adv = torch.tensor([2.0, -1.0])
    loss, metrics = policy_loss(lp, old, adv, mask, tis_weights=torch.tensor([[1.0, 0.5, 7.0], [2.0, 9.0, 9.0]]))
    # ratio 1 everywhere unmasked: pg = -A * w -> (-2*1 - 2*0.5 + 1*2) / 3 tokens
    assert float(loss.detach()) == pytest.approx((-2.0 - 1.0 + 2.0) / 3)
    assert metrics["pg_loss"] == pytest.approx(float(loss.detach()))
    loss.backward()
    assert torch.isfinite(lp.grad).all()
    assert lp.grad[0, 2] == 0 and lp.grad[1, 1] == 0 and lp.grad[1, 2] == 0
    # token mean, not sequence mean: a response twice as long weighs twice as much
    torch.testing.assert_close(lp.grad[mask], torch.tensor([-2.0, -1.0, 2.0]) / 3)


def test_loss_denominator_makes_microbatches_add_up() -> None:
    torch.manual_seed(0)
    lp = torch.randn(4, 5) * 0.1 - 1.0
    old = lp + torch.randn(4, 5) * 0.2
    adv = torch.randn(4)
    mask = torch.rand(4, 5) > 0.3
    full, full_m = policy_loss(lp, old, adv, mask)
    n = float(mask.sum())
    halves = [slice(0, 2), slice(2, 4)]
    parts = [policy_loss(lp[h], old[h], adv[h], mask[h], loss_denominator=n) for h in halves]
    assert float(parts[0][0] + parts[1][0]) == pytest.approx(float(full), rel=1e-6)
    for key in ("pg_loss", "pg_clipfrac", "ppo_kl"):
        assert parts[0][1][key] + parts[1][1][key] == pytest.approx(full_m[key], rel=1e-6, abs=1e-9)


def test_sample_mean_weighs_every_sample_alike() -> None:
    """Each sample's token mean, averaged over the samples (Miles' default): a 1-token and a 3-token response with
    the same advantage get the same total gradient; padding and interior mask zeros stay out of both."""
    lp = torch.zeros(2, 4, requires_grad=True)
    mask = torch.tensor([[True, False, False, False], [True, True, False, True]])
    loss, m = policy_loss(lp, lp.detach(), torch.tensor([1.0, 1.0]), mask, aggregation="sample-mean")
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.5, 0, 0, 0], [-1 / 6, -1 / 6, 0, -1 / 6]]))
    assert m["pg_loss"] == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="sample-mean needs logprobs as \\[samples, tokens\\]"):
        policy_loss(lp[0], lp[0].detach(), torch.ones(4), mask[0], aggregation="sample-mean")
    with pytest.raises(ValueError, match="aggregation='mean': choose sample-mean"):
        policy_loss(lp, lp.detach(), torch.ones(2), mask, aggregation="mean")


@pytest.mark.parametrize("aggregation", ["sample-mean", "token-mean"])
def test_step_denominator_makes_micro_batches_add_up_to_the_step(aggregation: str) -> None:
    """grpo_loss over the step's denominator, summed over any split of the step, is the loss of the whole step."""
    torch.manual_seed(1)
    lp = (torch.randn(6, 5) * 0.1 - 1.0).requires_grad_()
    old, rollout = lp.detach() + torch.randn(6, 5) * 0.2, lp.detach() + torch.randn(6, 5) * 0.5
    mask = torch.arange(5)[None, :] < torch.tensor([5, 1, 3, 2, 5, 4])[:, None]
    adv, config = torch.randn(6), GRPOConfig(loss_aggregation=aggregation)
    denominator = step_denominator(aggregation, mask.sum(dim=1).tolist())
    whole, whole_m, _ = grpo_loss(lp, old, rollout, adv, mask, config, denominator=denominator)
    (grad_whole,) = torch.autograd.grad(whole, lp)
    parts = [grpo_loss(lp[h], old[h], rollout[h], adv[h], mask[h], config, denominator=denominator)
             for h in (slice(0, 1), slice(1, 4), slice(4, 6))]
    (grad_parts,) = torch.autograd.grad(sum(p[0] for p in parts), lp)
    torch.testing.assert_close(grad_parts, grad_whole, rtol=1e-6, atol=1e-8)
    for key in ("pg_loss", "pg_clipfrac", "ppo_kl"):
        assert sum(p[1][key] for p in parts) == pytest.approx(whole_m[key], rel=1e-6, abs=1e-9)


def test_tis_weight_scales_the_gradient() -> None:
    lp = torch.zeros(1, 2, requires_grad=True)
    w = torch.tensor([[2.0, 0.0]])
    loss, _ = policy_loss(lp, lp.detach(), torch.tensor([1.0]), torch.ones(1, 2), tis_weights=w)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, 0.0]]))


def test_per_token_advantages_and_ppo_kl() -> None:
    old = torch.zeros(1, 2)
    lp = torch.tensor([[0.1, -0.3]])
    _, m = policy_loss(lp, old, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))
    assert m["ppo_kl"] == pytest.approx((-0.1 + 0.3) / 2)  # mean(old - new)


def test_kl_penalty_low_var_kl() -> None:
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0]])
    loss, m = policy_loss(lp, lp.detach(), torch.tensor([0.0]), torch.ones(1, 2), kl_coef=0.1, ref_logprobs=ref)
    k3 = math.exp(-0.5) - 1 + 0.5
    assert m["kl_loss"] == pytest.approx(k3 / 2)
    assert float(loss.detach()) == pytest.approx(0.1 * k3 / 2)
    loss.backward()
    assert lp.grad[0, 0] > 0  # moving away from the reference is penalised
    # k3 is non-negative and clamped at 10 for low_var_kl, unclamped for k3
    big = approx_kl(torch.tensor([-30.0]), torch.tensor([0.0]), "low_var_kl")
    assert float(big) == 10.0
    assert float(approx_kl(torch.tensor([-30.0]), torch.tensor([0.0]), "k3")) > 1e12
    assert float(approx_kl(torch.tensor([-1.0]), torch.tensor([0.0]), "k1")) == -1.0  # log(pi / pi_ref)
    assert float(approx_kl(torch.tensor([-1.0]), torch.tensor([0.0]), "k2")) == 0.5
    with pytest.raises(ValueError, match="kl_type"):
        approx_kl(torch.zeros(1), torch.zeros(1), "k4")


def test_kl_metric_without_penalty_and_missing_ref() -> None:
    lp = torch.zeros(1, 2)
    loss, m = policy_loss(lp, lp, torch.tensor([1.0]), torch.ones(1, 2), ref_logprobs=torch.full((1, 2), -1.0))
    assert m["kl_loss"] > 0 and float(loss.detach()) == pytest.approx(-1.0)  # monitored, not added
    _, m = policy_loss(lp, lp, torch.tensor([1.0]), torch.ones(1, 2))
    assert "kl_loss" not in m and set(m) == {"loss", "pg_loss", "pg_clipfrac", "ppo_kl"}
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        policy_loss(lp, lp, torch.tensor([1.0]), torch.ones(1, 2), kl_coef=0.1)


def test_policy_loss_shape_errors() -> None:
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="advantages shape"):
        policy_loss(lp, lp, torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="mask shape"):
        policy_loss(lp, lp, torch.zeros(2), torch.ones(2, 2))
    with pytest.raises(ValueError, match="old_logprobs shape"):
        policy_loss(lp, torch.zeros(2, 2), torch.zeros(2), torch.ones(2, 3))


def test_bf16_logprobs_give_float32_loss() -> None:
    lp = torch.full((2, 3), -1.0, dtype=torch.bfloat16, requires_grad=True)
    loss, _ = policy_loss(lp, lp.detach(), torch.tensor([1.0, -1.0]), torch.ones(2, 3))
    assert loss.dtype == torch.float32
    loss.backward()
    assert lp.grad.dtype == torch.bfloat16


# --------------------------------------------------------------------------- config


def test_config_defaults_match_seed_recipe() -> None:
    cfg = GRPOConfig()
    assert (cfg.clip_low, cfg.clip_high, cfg.max_grad_norm) == (0.2, 0.28, 1.0)
    assert (cfg.rollout_correction.mode, cfg.rollout_correction.clip_bounds) == ("tis", (0.0, 2.0))
    with pytest.raises(TypeError):
        GRPOConfig(0.2)  # keyword-only


def test_every_grpo_config_field_is_read_by_the_trainer() -> None:
    """No validated-but-never-read knob: each field is read in Trainer.grpo_step (lr, dynamic sampling, the group
    size and KL once were validated here while the run took them from elsewhere or nowhere)."""
    import dataclasses
    import inspect

    from engines.train.trainer import Trainer

    step = inspect.getsource(Trainer._grpo_step)
    loss = inspect.getsource(grpo_loss)  # the step's loss, with the config the step hands it
    assert "grpo_loss(" in step
    unread = [f.name for f in dataclasses.fields(GRPOConfig)
              if f"grpo.{f.name}" not in step and f"config.{f.name}" not in loss]
    assert not unread, f"GRPOConfig fields the trainer never reads: {unread}"
    for gone in ("lr", "dynamic_sampling", "n_samples_per_prompt", "kl_coef", "adv_eps"):
        with pytest.raises(TypeError):
            GRPOConfig(**{gone: 1})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"clip_low": 1.0}, r"clip_low=1.0 must lie in \[0, 1\).*Use 0.2"),
        ({"clip_high": -0.1}, "Use 0.28"),
        ({"rollout_correction": {"clip_high": 0.9}}, r"must contain 1.*defaults \(0.0, 2.0\)"),
        ({"rollout_correction": {"clip_low": 1.5, "clip_high": 3.0}}, "must contain 1"),
        ({"rollout_correction": "tls"}, "is not one of none, tis, icepop"),
        ({"max_grad_norm": -1.0}, "max_grad_norm"),
        ({"loss_aggregation": "token_mean"}, "GRPOConfig.loss_aggregation='token_mean': choose sample-mean"),
    ],
)
def test_config_errors_say_the_fix(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GRPOConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_samples": 1}, r"at least 2 samples per prompt.*group mean is the baseline.*>= 2"),
        ({"n_samples": 4.0}, "at least 2 samples"),
        ({"dynamic_sampling_max_rounds": 0}, "dynamic_sampling=False"),
    ],
)
def test_loop_config_errors_say_the_fix(kwargs: dict, message: str) -> None:
    """The group size and dynamic sampling are checked where the loop reads them (rl.loop.LoopConfig)."""
    from rl.loop import LoopConfig

    with pytest.raises(ValueError, match=message):
        LoopConfig(**kwargs)


# --------------------------------------------------------------------------- dynamic sampling


def test_filter_groups_drops_uniform_groups() -> None:
    assert filter_groups([[0, 0, 0], [1, 1, 1], [0, 1, 0], [0.5, 0.5, 0.25]]) == [2, 3]
    assert filter_groups(torch.tensor([[1.0, 1.0], [1.0, 0.0]])) == [1]
    assert has_signal([0.0, 1.0]) and not has_signal([2.0, 2.0])
    with pytest.raises(ValueError, match="non-finite"):
        filter_groups([[0.0, float("nan")]])


class _Generator:
    """Rolls out ``generate(k)`` from a fixed list of groups (one per prompt), recording calls."""

    def __init__(self, groups: list[list[float]]) -> None:
        self.groups, self.cursor, self.calls = groups, 0, []

    def __call__(self, k: int) -> list[list[float]]:
        self.calls.append(k)
        out = self.groups[self.cursor : self.cursor + k]
        self.cursor += len(out)
        return out


def test_sampler_refills_to_target() -> None:
    # half the prompts have signal
    groups = [[0, 1] if i % 2 == 0 else [1, 1] for i in range(100)]
    gen = _Generator(groups)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = DynamicSampler(target_groups=8).sample(gen)
    assert len(result.groups) == 8 and all(has_signal(g) for g in result.groups)
    assert gen.calls == [8, 8]  # keep rate 1/2 -> ask 4 / 0.5 = 8 more
    assert result.n_prompts == gen.cursor == 16  # the data cursor advances by n_prompts
    assert result.n_dropped == result.n_no_signal == 8 and result.n_surplus == 0 and not result.capped
    m = result.metrics()
    assert m["rollout/dynamic_filter_dropped"] == 8.0
    assert m["rollout/dynamic_filter_oversampled"] == 8.0
    assert m["rollout/dynamic_filter_kept"] == 8.0
    assert m["rollout/dynamic_filter_rounds"] == 2.0
    assert m["rollout/dynamic_filter_capped"] == 0.0
    assert m["rollout/dynamic_filter_drop_ratio"] == 0.5


def test_sampler_trims_surplus_and_keeps_order() -> None:
    groups = [[0, 0]] * 3 + [[i, 0] for i in range(1, 20)]
    gen = _Generator(groups)
    result = DynamicSampler(target_groups=4).sample(gen)
    assert result.groups == [[1, 0], [2, 0], [3, 0], [4, 0]]
    # round 1 (4 prompts): 1 kept; rate 1/4 -> ask 12: 12 kept, 9 surplus
    assert gen.calls == [4, 12] and result.n_surplus == 9


def test_sampler_warns_at_cap_with_numbers_and_returns_what_it_has() -> None:
    groups = [[1, 1, 1]] * 9 + [[0, 1, 1]] + [[0, 0, 0]] * 100
    gen = _Generator(groups)
    sampler = DynamicSampler(target_groups=4, max_rounds=3, max_prompts=12)
    with pytest.warns(DynamicSamplingWarning) as record:
        result = sampler.sample(gen)
    message = str(record[0].message)
    assert "max_prompts=12" in message
    assert "kept 1 of 4 groups after 2 rounds and 12 prompts (11 groups dropped" in message
    assert "raise max_rounds (now 3) or max_prompts (now 12)" in message
    assert result.groups == [[0, 1, 1]] and result.capped and result.n_prompts == 12
    assert result.metrics()["rollout/dynamic_filter_capped"] == 1.0


def test_sampler_warns_at_round_cap_and_when_nothing_has_signal() -> None:
    gen = _Generator([[0, 0]] * 100)
    with pytest.warns(DynamicSamplingWarning, match=r"max_rounds=2: kept 0 of 4 .*skip this optimizer step"):
        result = DynamicSampler(target_groups=4, max_rounds=2).sample(gen)
    assert result.groups == [] and gen.calls == [4, 12]


def test_sampler_warns_when_data_runs_out() -> None:
    gen = _Generator([[0, 1], [1, 1], [1, 0]])
    with pytest.warns(DynamicSamplingWarning, match="data exhausted"):
        result = DynamicSampler(target_groups=4).sample(gen)
    assert result.groups == [[0, 1], [1, 0]] and result.n_prompts == 3


def test_sampler_disabled_keeps_everything_in_one_round() -> None:
    gen = _Generator([[0, 0], [0, 1], [1, 1], [1, 0], [0, 1]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = DynamicSampler(target_groups=4, enabled=False).sample(gen)
    assert result.groups == [[0, 0], [0, 1], [1, 1], [1, 0]] and gen.calls == [4]
    assert result.n_dropped == 0 and result.n_no_signal == 2


def test_sampler_reads_rewards_from_objects_and_validates() -> None:
    class Group:
        def __init__(self, rewards: list[float]) -> None:
            self.rewards = rewards

    batches = iter([[Group([0.0, 1.0]), {"rewards": [1.0, 1.0]}], [{"rewards": [0.0, 0.5]}]])
    result = DynamicSampler(target_groups=2).sample(lambda k: next(batches))
    assert result.groups[0].rewards == [0.0, 1.0] and result.groups[1] == {"rewards": [0.0, 0.5]}
    with pytest.raises(ValueError, match="at most one group per requested prompt"):
        DynamicSampler(target_groups=1).sample(lambda k: [[0, 1]] * (k + 1))
    with pytest.raises(ValueError, match="max_prompts=2 < target_groups=4"):
        DynamicSampler(target_groups=4, max_prompts=2)
    with pytest.raises(ValueError, match="enabled=False"):
        DynamicSampler(target_groups=4, max_rounds=0)
