"""The embedded trainer's policy loss and gradient equal TRL 1.16's GRPOTrainer loss for the settings `v4rl bench e2e`
runs (bench/e2e_trl.py trl_config: loss_type "dapo" for token-mean, "grpo" for sample-mean), and TRL's advantages
equal v4rl's `group_advantages` with TRL's epsilon; the deliberate differences are tested as differences.

TRL's side is a real `GRPOTrainer` built from `trl_config` on a 1-layer random Llama (the loss never runs the
model): its own `_compute_loss` on each micro-batch of `per_device_train_batch_size` rows, summed over the
accumulation steps as its training step does (TRL scales the loss for the accumulation itself and the Trainer adds
nothing: GRPOTrainer.loss_is_scaled_for_ga), with `current_gradient_accumulation_steps` set to a full window as the
training loop sets it. Only `_get_per_token_logps_and_entropies` is overridden, to hand TRL the test's per-token
logprobs (rows of one leaf tensor) instead of a forward pass, so the gradient is TRL's w.r.t. the same tensor.
Its advantages come from its own `_generate_and_score_completions` (generation, rewards, group normalisation).

v4rl's side is the trainer's: its `micro_batches` split and `grpo_loss` over `step_denominator`, without a rollout
correction (TRL generates with the model it trains: no engine mismatch to correct). float32: losses and gradients
agree to 1e-6 relative (1e-9 absolute; they come out bit-identical), losses to 1e-7 absolute (LOSS_ATOL),
advantages to 1e-6.

    .venv/bin/python -m pytest tests/test_trl_loss_parity.py -q
"""

from __future__ import annotations

import json

import pytest
import torch

from bench.e2e_settings import E2ESettings
from engines.train.trainer import micro_batches
from rl.grpo import GRPOConfig, group_advantages, grpo_loss, step_denominator

pytest.importorskip("trl", reason="TRL is not installed; .venv/bin/pip install -e '.[bench]'")

RTOL, ATOL = 1e-6, 1e-9
LOSS_ATOL = 1e-7
"""The loss is a sum of terms of size ~1 that cancel (advantages sum to 0 per group): float32 summation order
moves it by ~1e-8 absolute, whatever its size (the gradients here agree bit for bit)."""
SETTINGS = dict(steps=1, prompts_per_step=4, n_samples=4, max_new_tokens=6, max_tokens_per_gpu=64)
LONGEST_PROMPT = 10
REWARDS = [[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.5, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]]


def _grouped_rewards(prompts: list[str], rewards: list[str], **_) -> list[float]:
    """Each prompt's REWARDS row, in the order its samples come (a TRL reward function: one call per batch)."""
    seen: dict[str, int] = {}
    out = []
    for prompt, row in zip(prompts, rewards):
        seen[prompt] = seen.get(prompt, 0) + 1
        out.append(json.loads(row)[seen[prompt] - 1])
    return out


def _trainer(tmp_path, aggregation: str):
    """TRL's GRPOTrainer as bench e2e configures it, handing `_compute_loss` the logprobs set in `.given`."""
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import GRPOTrainer

    from bench.e2e_trl import trl_config

    class GivenLogprobs(GRPOTrainer):
        given: torch.Tensor

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, **_):
            assert self.given.shape == (input_ids.shape[0], logits_to_keep)
            return self.given, torch.zeros_like(self.given.detach()), None

    settings = E2ESettings(**SETTINGS, loss_aggregation=aggregation)
    tokenizer = AutoTokenizer.from_pretrained(settings.base)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                         bos_token_id=tokenizer.bos_token_id))
    rows = [{"prompt": f"{tokenizer.bos_token}{i}+{i}=", "rewards": json.dumps(r)} for i, r in enumerate(REWARDS)]
    args = trl_config(settings, str(tmp_path / aggregation), LONGEST_PROMPT)
    trainer = GivenLogprobs(model=model, reward_funcs=_grouped_rewards, args=args,
                            train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps  # a full window, as in training
    return trainer, rows


def _batch(seed: int = 0) -> dict:
    """16 completions of 1-6 tokens (right-padded, TRL's completion_mask), current logprobs, old ones 0.25 off."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (16,), generator=g)
    lengths[5] = 1
    mask = (torch.arange(6)[None, :] < lengths[:, None]).int()
    current = -torch.rand(16, 6, generator=g) * 3
    return {"lengths": lengths.tolist(), "mask": mask, "current": current,
            "old": current + torch.randn(16, 6, generator=g) * 0.25,
            "advantages": group_advantages(torch.tensor(REWARDS)).flatten()}


def _trl(trainer, batch: dict, with_old: bool) -> tuple[float, torch.Tensor]:
    """TRL's loss summed over its accumulation steps, and its gradient w.r.t. the current logprobs."""
    current = batch["current"].clone().requires_grad_()
    mask = batch["mask"]
    size = trainer.args.per_device_train_batch_size
    inputs = {"prompt_ids": torch.ones(16, 3, dtype=torch.long), "prompt_mask": torch.ones(16, 3, dtype=torch.long),
              "completion_ids": torch.ones(16, 6, dtype=torch.long), "completion_mask": mask,
              "advantages": batch["advantages"], "num_items_in_batch": mask.sum()}  # TRL: the generation batch's
    if with_old:
        inputs["old_per_token_logps"] = batch["old"]
    total = 0.0
    assert size < 16  # several accumulation steps
    for start in range(0, 16, size):
        part = slice(start, start + size)
        trainer.given = current[part]
        loss = trainer._compute_loss(trainer.model, {k: v if k == "num_items_in_batch" else v[part]
                                                     for k, v in inputs.items()})
        loss.backward()
        total += float(loss.detach())
    return total, current.grad


def _v4rl(batch: dict, grpo: GRPOConfig, with_old: bool) -> tuple[float, torch.Tensor]:
    """The trainer's step on the same rows: its micro-batch split, grpo_loss over the step's denominator."""
    current = batch["current"].clone().requires_grad_()
    lengths, mask = batch["lengths"], batch["mask"].bool()
    denominator = step_denominator(grpo.loss_aggregation, lengths)
    chunks = micro_batches([LONGEST_PROMPT + r for r in lengths], 40)
    assert len(chunks) > 2
    total = 0.0
    for idx in chunks:
        width = max(lengths[i] for i in idx)
        lp = current[idx, :width]
        old = batch["old"][idx, :width] if with_old else lp.detach()
        loss, _, _ = grpo_loss(lp, old, old, batch["advantages"][idx], mask[idx, :width], grpo,
                               denominator=denominator)
        loss.backward()
        total += float(loss.detach())
    return total, current.grad


@pytest.fixture(scope="module")
def trainers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl-loss")
    return {a: _trainer(tmp, a)[0] for a in ("token-mean", "sample-mean")}


@pytest.mark.parametrize("with_old", [False, True], ids=["on-policy", "stale-old-logprobs"])
@pytest.mark.parametrize("aggregation", ["token-mean", "sample-mean"])
def test_loss_and_gradient_equal_trls(trainers, aggregation, with_old):
    trainer = trainers[aggregation]
    assert trainer.loss_type == {"token-mean": "dapo", "sample-mean": "grpo"}[aggregation]
    batch = _batch()
    theirs = _trl(trainer, batch, with_old)
    ours = _v4rl(batch, GRPOConfig(loss_aggregation=aggregation, rollout_correction="none"), with_old)
    assert ours[0] == pytest.approx(theirs[0], abs=LOSS_ATOL)
    torch.testing.assert_close(ours[1], theirs[1], rtol=RTOL, atol=ATOL)
    assert (theirs[1][batch["mask"] == 0] == 0).all() and theirs[1].abs().max() > 0
    if with_old:  # both clip bounds are exercised
        ratio = (batch["current"] - batch["old"]).exp()[batch["mask"].bool()]
        assert ((ratio > 1.2) & (ratio < 1.28)).any() and (ratio < 0.8).any()


@pytest.mark.parametrize("planted", [{"clip_high": 0.2}, {"clip_low": 0.1}, {"loss_aggregation": "sample-mean"},
                                     {"rollout_correction": "tis"}],
                         ids=["clip-high", "clip-low", "aggregation", "tis (a deliberate difference)"])
def test_a_planted_change_breaks_the_parity(trainers, planted):
    """A wrong clip or aggregation fails the comparison; so does v4rl's default TIS when the rollout logprobs
    differ from the trainer's (deliberate: v4rl's rollout engine samples from FP8 weights, TRL from the model it
    trains, so TRL has nothing to correct; bench/e2e_trl.py DIFFERENCES["tis"])."""
    batch = _batch()
    _, theirs = _trl(trainers["token-mean"], batch, with_old=True)

    def grad(**changes) -> torch.Tensor:
        grpo = GRPOConfig(**{"loss_aggregation": "token-mean", "rollout_correction": "none", **changes})
        current = batch["current"].clone().requires_grad_()
        rollout = batch["old"] + 0.3  # the engine's logprobs: TIS weights exp(-0.3), not 1
        loss, _, _ = grpo_loss(current, batch["old"], rollout, batch["advantages"], batch["mask"].bool(), grpo,
                               denominator=step_denominator(grpo.loss_aggregation, batch["lengths"]))
        loss.backward()
        return current.grad

    torch.testing.assert_close(grad(), theirs, rtol=RTOL, atol=ATOL)
    assert not torch.allclose(grad(**planted), theirs, rtol=100 * RTOL, atol=100 * ATOL)


def test_advantages_are_trls_with_trls_epsilon(tmp_path):
    """TRL's own rollout pipeline (_generate_and_score_completions: generation, rewards, the per-group mean and
    unbiased std) gives v4rl's group_advantages with eps 1e-4; v4rl's 1e-6 (Miles') is a deliberate difference,
    at most ~1e-4 relative: for a group [1, 0, 0, 1] 0.8659 (TRL) vs 0.8660."""
    trainer, rows = _trainer(tmp_path, "token-mean")
    out = trainer._generate_and_score_completions([dict(r) for r in rows for _ in range(4)])
    rewards = torch.tensor(REWARDS)
    torch.testing.assert_close(out["advantages"], group_advantages(rewards, eps=1e-4).flatten(), rtol=1e-6,
                               atol=1e-6)
    ours = group_advantages(rewards).flatten()
    assert (out["advantages"] - ours).abs().max() > 1e-5
    assert (ours.view(4, 4)[1] == 0).all() and (out["advantages"].view(4, 4)[1] == 0).all()  # constant group
