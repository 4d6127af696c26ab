"""Rollout routing replay (R3) in the embedded trainer and train/router_mismatch_frac (issue 29).

The rollout engine's routed experts (tests/test_rollout_routed_experts.py) are replayed by the trainer's
transformers model in the learned top-k layers: its chosen experts then equal the rollout's. The mismatch metric is
0 when trainer and engine hold the same weights and > 0 once the trainer's routers are perturbed.

    .venv/bin/python -m pytest tests/test_routing_replay.py -q
"""

from __future__ import annotations

import pytest
import torch

from engines.rollout.engine import EngineConfig, RequestSpec, RolloutEngine
from engines.rollout.sampling import SamplingParams
from engines.train.trainer import Sample, Trainer, TrainerConfig
from rl.correction_setting import RolloutCorrection
from rl.grpo import GRPOConfig


@pytest.fixture(scope="module")
def rollouts(tiny_base):
    engine = RolloutEngine(tiny_base, EngineConfig(enable_return_routed_experts=True))
    try:
        specs = [RequestSpec(rid=f"r{i}", input_ids=[1, 20 + i, 33, 47, 5], seed=i, return_routed_experts=True,
                             return_logprob=True, sampling=SamplingParams(max_new_tokens=8, temperature=1.0))
                 for i in range(4)]
        outs = engine.generate(specs)
        native = {k: v.float() for k, v in engine.model.state_dict().items()}
        return outs, engine.cfg, native
    finally:
        engine.shutdown()


def samples(outs) -> list[Sample]:
    return [Sample(prompt_ids=o.input_ids, response_ids=o.output_ids, rollout_logprobs=o.output_logprobs,
                   reward=float(i % 2), group=0, advantage=1.0 if i % 2 else -1.0, routed_experts=o.routed_experts)
            for i, o in enumerate(outs)]


def trainer(cfg, native, perturb: float = 0.0) -> Trainer:
    # a copy: the model may share the tensors it is built from, and the perturbation below writes into them
    t = Trainer.from_native(cfg, {k: v.clone() for k, v in native.items()},
                            TrainerConfig(lr=1e-6, compute_dtype="float32"))
    if perturb:
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for i in t.router_replay.layers:
                w = t.model.model.layers[i].mlp.gate.weight
                w.add_(perturb * w.std() * torch.randn(w.shape, generator=g))
    return t


def test_mismatch_is_zero_with_equal_weights_and_positive_with_perturbed_routers(rollouts):
    outs, cfg, native = rollouts
    grpo = GRPOConfig(rollout_correction=RolloutCorrection(mode="tis"))
    same = trainer(cfg, native).grpo_step(samples(outs), grpo)
    assert same["train/router_mismatch_frac"] == 0.0
    moved = trainer(cfg, native, perturb=3.0).grpo_step(samples(outs), grpo)
    assert moved["train/router_mismatch_frac"] > 0.0


def test_replay_makes_the_trainer_use_the_rollout_experts(rollouts):
    outs, cfg, native = rollouts
    t = trainer(cfg, native, perturb=3.0)
    s = samples(outs)[0]
    ids = torch.tensor([s.prompt_ids + s.response_ids])
    padded = torch.zeros(1, ids.shape[1], *s.routed_experts.shape[1:], dtype=torch.long)
    padded[0, :-1] = s.routed_experts.long()
    used = {}
    for i in t.router_replay.layers:  # record what each router hands to the experts
        gate = t.model.model.layers[i].mlp.gate
        wrapped = gate.forward
        gate.forward = lambda h, wrapped=wrapped, i=i: used.__setitem__(i, wrapped(h)[2]) or wrapped(h)
    with torch.no_grad(), t.router_replay.forward(padded):
        t.model(input_ids=ids)
    for i in t.router_replay.layers:
        assert torch.equal(used[i].view(1, -1, cfg.num_experts_per_tok)[:, :-1], padded[:, :-1, i])
    mismatched, _ = t.router_replay.mismatch(t.router_replay.own_routes(), padded, torch.ones(1, ids.shape[1], dtype=torch.bool))
    assert mismatched > 0  # the perturbed routers would have chosen otherwise
    grpo = GRPOConfig(rollout_correction=RolloutCorrection(mode="tis", routing_replay=True))
    assert "train/router_mismatch_frac" in t.grpo_step(samples(outs), grpo)


def test_shared_prefix_forward_counts_the_mismatch_of_full_sequences(tiny_base, rollouts):
    """The metric comes from the forward the step runs anyway: with a GRPO group's prompt forwarded once (the
    default) it counts what whole-sequence forwards count, prompt positions included, and the step still forwards
    each prompt once."""
    _, cfg, native = rollouts
    engine = RolloutEngine(tiny_base, EngineConfig(enable_return_routed_experts=True))
    try:
        specs = [RequestSpec(rid=f"g{i}", input_ids=[1, 20 + i // 3, 33, 47, 5], seed=i, return_routed_experts=True,
                             return_logprob=True, sampling=SamplingParams(max_new_tokens=4 + 2 * (i % 3),
                                                                          temperature=1.0))
                 for i in range(6)]  # two prompts x three samples of different lengths
        group = samples(engine.generate(specs))
    finally:
        engine.shutdown()
    grpo = GRPOConfig(rollout_correction=RolloutCorrection(mode="tis"))
    shared = trainer(cfg, native, perturb=0.3)
    whole = trainer(cfg, native, perturb=0.3)
    whole.config.share_prompt_prefix = False
    ours, full = shared.grpo_step(group, grpo), whole.grpo_step(group, grpo)
    frac = ours["train/router_mismatch_frac"]
    assert 0.0 < frac < 1.0
    assert frac == pytest.approx(full["train/router_mismatch_frac"], abs=1e-9)
    # the metric did not turn the shared prompt forward off (it did once, and a step cost 4x: issue 40)
    assert ours["perf/train_forwarded_tokens"] < ours["perf/train_tokens"] <= full["perf/train_forwarded_tokens"]
    assert shared._mismatch[1] == whole._mismatch[1] == sum(
        len(s.prompt_ids) + len(s.response_ids) - 1 for s in group) * len(shared.router_replay.layers)


def test_replay_with_a_shared_prompt_forward_equals_replay_of_whole_sequences(tiny_base, rollouts):
    """Replay keeps the shared prompt forward: each group's prompt is replayed once with its first sample's routes
    (the engine routed the prompt alike for every sample) and each response with its own; the step's loss,
    gradient and update equal those of whole sequences, each replayed with its own routes. A group whose samples
    disagree on the prompt's routes is forwarded whole."""
    _, cfg, native = rollouts
    engine = RolloutEngine(tiny_base, EngineConfig(enable_return_routed_experts=True))
    try:
        specs = [RequestSpec(rid=f"g{i}", input_ids=[1, 20 + i // 3, 33, 47, 5], seed=i, return_routed_experts=True,
                             return_logprob=True, sampling=SamplingParams(max_new_tokens=4 + 2 * (i % 3),
                                                                          temperature=1.0))
                 for i in range(6)]
        group = samples(engine.generate(specs))
    finally:
        engine.shutdown()
    grpo = GRPOConfig(rollout_correction=RolloutCorrection(mode="tis", routing_replay=True))
    shared, whole = trainer(cfg, native, perturb=0.3), trainer(cfg, native, perturb=0.3)
    whole.config.share_prompt_prefix = False
    ours, full = shared.grpo_step(group, grpo), whole.grpo_step(group, grpo)
    assert ours["perf/train_forwarded_tokens"] < ours["perf/train_tokens"]  # the prompt forwarded once per group
    for key in ("train/pg_loss", "train/grad_norm", "train/router_mismatch_frac"):
        assert ours[key] == pytest.approx(full[key], rel=1e-4, abs=1e-7), key
    for (name, a), b in zip(shared.model.named_parameters(), whole.model.parameters()):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7), name
    group[1].routed_experts = group[1].routed_experts.clone()
    layer = shared.router_replay.layers[0]  # the first prompt position, routed otherwise for this one sample
    group[1].routed_experts[0, layer] = (group[1].routed_experts[0, layer] + 1) % cfg.n_routed_experts
    again = trainer(cfg, native, perturb=0.3).grpo_step(group, grpo)
    assert again["perf/train_forwarded_tokens"] >= again["perf/train_tokens"]  # every sample whole
