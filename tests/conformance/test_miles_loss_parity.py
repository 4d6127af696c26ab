"""The embedded trainer's policy loss and its gradient equal Miles' own, on the same random batch, in both Miles
DeepSeek-V4 generations (31f1ca961 + Megatron-LM 2e64d788b, e9e19b223 + 6184c094a).

One subprocess per generation (engines.upstream.sources.engine_python, ~10 s) runs Miles' whole loss path on
per-token logprobs that require grad:

  - rewards -> advantages: `convert_samples_to_train_data` (its `_post_process_rewards`: the per-group
    normalisation, std + 1e-6) and `compute_advantages_and_returns` (`get_grpo_returns`);
  - `loss_function` (loss.py: `get_sum_of_sample_mean`, the Megatron scaling `* num_microbatches /
    global_batch_size`) -> `policy_loss_function` -> `compute_policy_loss` and `vanilla_tis_function`, one sample
    per micro-batch as the job runs (`--micro-batch-size 1`), through Megatron's own `forward_step_calc_loss`
    (its `/ num_microbatches`); with --calculate-per-token-loss the summed gradient is divided by the step's token
    count as Megatron's `finalize_model_grads` does.

What stands in for the rest: a CP/TP/DP-size-1 ParallelState built from Miles' own classes, and
`get_log_probs_and_entropy` answering with the given logprobs (the logits -> logprob step needs Megatron's
vocab-parallel cross entropy; the trainer's logprobs are checked against Miles' model elsewhere). The arguments
are the cluster job's loss flags (engines/miles/train_args.py `grpo_args` of the seed run, with each
aggregation) over Miles' argparse defaults (MILES_DEFAULTS; the slow test checks them against Miles' parser).

v4rl's side is the trainer's: `group_advantages`, the trainer's `micro_batches` split at a small budget, and
`grpo_loss` (apply_correction + policy_loss) over `step_denominator`. float32 throughout: loss and every
per-token gradient agree to 1e-6 relative (1e-9 absolute; measured: 1.6e-7), the loss to 1e-7 absolute (LOSS_ATOL),
advantages to 1e-6. A planted change to the clip,
the TIS bound or the aggregation moves the gradient far outside that.

    .venv/bin/python -m pytest tests/conformance/test_miles_loss_parity.py -q
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engines.presets.runs import SEED_RUN
from engines.miles.train_args import grpo_args
from engines.train.trainer import micro_batches
from engines.upstream.sources import engine_python
from rl.correction_setting import RolloutCorrection
from rl.grpo import GRPOConfig, group_advantages, grpo_loss, step_denominator

GENERATIONS = {1: ("miles_tree", "megatron_tree"), 2: ("miles_gen2_tree", "megatron_gen2_tree")}
AGGREGATIONS = ("sample-mean", "token-mean")
RTOL, ATOL = 1e-6, 1e-9
LOSS_ATOL = 1e-7
"""The loss is a sum of terms of size ~1 that cancel (advantages sum to 0 per group): float32 summation order
moves it by ~1e-8 absolute, whatever its size."""

MILES_DEFAULTS = {
    "loss_type": "policy_loss", "calculate_per_token_loss": False, "use_dynamic_global_batch_size": False,
    "recompute_loss_function": False, "allgather_cp": False, "true_on_policy_mode": False,
    "use_tis": False, "tis_clip": 2.0, "tis_clip_low": 0.0, "custom_tis_function_path": None,
    "custom_pg_loss_reducer_function_path": None, "get_mismatch_metrics": False, "use_opsm": False,
    "use_rollout_logprobs": False, "skip_actor_forward_only": False, "observe_training_entropy": False,
    "eps_clip_c": None, "use_kl_loss": False, "use_unbiased_kl": False, "kl_coef": 0.0, "rewards_normalization": True,
    "grpo_std_normalization": True, "normalize_advantages": False, "use_opd": False, "reward_key": None,
    "gamma": 1.0, "lambd": 1.0, "balance_data": False,
}
"""Miles' argparse defaults (miles/utils/arguments.py, both pins) of what its loss path reads and the job's loss
flags do not set."""
JOB_FLAGS = {"qkv_format": "bshd"}
"""What the job passes outside grpo_args that the loss reads (misc_args: --qkv-format bshd)."""

MILES_CODE = r"""
import sys
from argparse import Namespace
from functools import partial
from types import SimpleNamespace

import torch
import miles.backends.training_utils.loss_hub.losses as losses
from megatron.core.pipeline_parallel.schedules import forward_step_calc_loss
from miles.backends.training_utils.loss import compute_advantages_and_returns, loss_function
from miles.backends.training_utils.parallel import ParallelState, set_parallel_state
from miles.ray.rollout.train_data_conversion import convert_samples_to_train_data
from miles.utils.ft_utils.process_group_utils import GroupInfo
from miles.utils.types import Sample

data = torch.load(sys.argv[1])
set_parallel_state(ParallelState(**{name: GroupInfo(rank=0, size=1, group=None) for name in
                                    ("intra_dp", "intra_dp_cp", "cp", "tp", "pp", "ep", "etp", "indep_dp")}))


def given_log_probs(logits, *, response_lengths, **_):
    # the per-token logprobs themselves stand in for the logits
    return {"log_probs": list(torch.split(logits, response_lengths))}


losses.get_log_probs_and_entropy = given_log_probs
lengths, prompts = data["response_lengths"], data["prompt_lengths"]
masks = [torch.tensor(m, dtype=torch.int32) for m in data["masks"]]


def split(flat):
    return list(torch.split(flat, lengths))


out = {}
for name, fields in data["cases"].items():
    args = Namespace(**fields)
    n = args.n_samples_per_prompt
    samples = [Sample(group_index=i // n, index=i, tokens=[1] * (p + r), response_length=r, reward=reward,
                      loss_mask=list(m), rollout_log_probs=lp.tolist(), status=Sample.Status.COMPLETED)
               for i, (p, r, reward, m, lp) in enumerate(zip(prompts, lengths, data["rewards"], data["masks"],
                                                             split(data["rollout"])))]
    train = convert_samples_to_train_data(args, samples, {}, None, None)
    rollout_data = {"rewards": train["rewards"], "log_probs": split(data["old"]),
                    "rollout_log_probs": split(data["rollout"]), "loss_masks": masks, "response_lengths": lengths,
                    "total_lengths": [p + r for p, r in zip(prompts, lengths)]}
    compute_advantages_and_returns(args, rollout_data)
    current = data["current"].clone().requires_grad_()
    config = SimpleNamespace(calculate_per_token_loss=args.calculate_per_token_loss, timers=None)
    step = len(lengths)  # --micro-batch-size 1: one sample per micro-batch
    loss, tokens, store, start = 0.0, 0, [], 0
    for i, r in enumerate(lengths):
        batch = {"advantages": [rollout_data["advantages"][i]], "log_probs": [rollout_data["log_probs"][i]],
                 "rollout_log_probs": [rollout_data["rollout_log_probs"][i]], "loss_masks": [masks[i]],
                 "response_lengths": [r], "total_lengths": [prompts[i] + r], "unconcat_tokens": [samples[i].tokens],
                 "rollout_mask_sums": torch.tensor([train["rollout_mask_sums"][i]], dtype=torch.float32)}
        func = partial(loss_function, args, batch, step, apply_megatron_loss_scaling=True, num_rollouts=step)
        output, num_tokens = forward_step_calc_loss(None, current[start:start + r], func, config, None, False, step,
                                                    store, cp_group_size=1, is_last_stage=True)
        output.backward()
        loss, tokens, start = loss + float(output), tokens + int(num_tokens), start + r
    grad = current.grad
    if args.calculate_per_token_loss:  # finalize_model_grads: gradients scaled by 1 / the step's token count
        grad, loss = grad / tokens, loss / tokens
    out[name] = {"loss": loss, "grad": grad, "rewards": train["rewards"],
                 "advantages": [float(a[0]) for a in rollout_data["advantages"]]}
torch.save(out, sys.argv[2])
"""


def _batch(seed: int = 0) -> dict:
    """4 groups x 4 samples, responses of 1-9 tokens, interior loss-mask zeros in a few; rewards with a constant
    group; old logprobs 0.15 off the current ones (PPO ratios across both clip bounds), rollout logprobs 0.6 off
    the old ones (TIS weights past 2)."""
    g = torch.Generator().manual_seed(seed)
    n_groups, n = 4, 4
    lengths = torch.randint(1, 10, (n_groups * n,), generator=g).tolist()
    lengths[3] = 1
    prompts = [int(p) for p in torch.randint(3, 7, (n_groups,), generator=g).repeat_interleave(n)]
    masks = [[1] * r for r in lengths]
    for i in (2, 7, 12):
        if lengths[i] > 2:
            masks[i][lengths[i] // 2] = 0  # a tool-response token inside the response
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.5, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    total = sum(lengths)
    current = -torch.rand(total, generator=g) * 3
    old = current + torch.randn(total, generator=g) * 0.15
    rollout = old + torch.randn(total, generator=g) * 0.6
    return {"response_lengths": lengths, "prompt_lengths": prompts, "masks": masks, "rewards": rewards,
            "current": current, "old": old, "rollout": rollout}


def _seed_run(aggregation: str):
    return dataclasses.replace(SEED_RUN, algorithm=dataclasses.replace(SEED_RUN.algorithm,
                                                                       loss_aggregation=aggregation))


def _loss_args(aggregation: str) -> dict:
    """Miles' arguments of the cluster job's loss: grpo_args of the seed run with this aggregation, as Miles reads
    them, over MILES_DEFAULTS."""
    return {**MILES_DEFAULTS, **JOB_FLAGS, **_flag_values(grpo_args(_seed_run(aggregation)))}


def _job_args(aggregation: str, batch: dict) -> dict:
    """_loss_args with the batch's sizes (one optimizer step over the whole batch)."""
    groups, n = batch["rewards"].shape
    return {**_loss_args(aggregation), "n_samples_per_prompt": n, "rollout_batch_size": groups,
            "global_batch_size": groups * n}


def _flag_values(argv: list[str]) -> dict:
    """`--name value` and bare `--switch` of an argv as argparse dests (numbers as floats)."""
    out, i = {}, 0
    while i < len(argv):
        dest = argv[i][2:].replace("-", "_")
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
            try:
                out[dest] = float(value)
            except ValueError:
                out[dest] = value
            i += 2
        else:
            out[dest], i = True, i + 1
    return out


@pytest.fixture(scope="module", params=sorted(GENERATIONS))
def miles_result(request, tmp_path_factory):
    """(generation, batch, Miles' answer per aggregation) from one subprocess per generation."""
    miles, megatron = (request.getfixturevalue(name) for name in GENERATIONS[request.param])
    batch = _batch()
    tmp = tmp_path_factory.mktemp(f"miles-loss-{request.param}")
    data = {**batch, "rewards": batch["rewards"].flatten().tolist(),
            "cases": {a: _job_args(a, batch) for a in AGGREGATIONS}}
    torch.save(data, tmp / "in.pt")
    # compute_policy_loss and compute_approx_kl are torch.compile'd; inductor needs triton (stubbed): run eagerly
    engine_python(MILES_CODE, [megatron, miles], args=[str(tmp / "in.pt"), str(tmp / "out.pt")],
                  env={"TORCHDYNAMO_DISABLE": "1"}, timeout=600)
    return request.param, batch, torch.load(tmp / "out.pt")


def _v4rl(batch: dict, grpo: GRPOConfig, budget: int = 24) -> tuple[float, torch.Tensor, torch.Tensor]:
    """(loss, gradient w.r.t. the flat current logprobs, advantages) the way the trainer's step computes them:
    its micro-batch split, each micro-batch right-padded into rows, grpo_loss over the step's denominator."""
    lengths, prompts = batch["response_lengths"], batch["prompt_lengths"]
    advantages = group_advantages(batch["rewards"]).flatten()
    current = batch["current"].clone().requires_grad_()
    starts = torch.tensor([0, *lengths]).cumsum(0).tolist()
    loss_tokens = [sum(m) for m in batch["masks"]]
    denominator = step_denominator(grpo.loss_aggregation, loss_tokens)
    total = 0.0
    chunks = micro_batches([p + r for p, r in zip(prompts, lengths)], budget)
    assert len(chunks) > 2  # the step really is split

    def rows(flat: torch.Tensor, idx: list[int]) -> torch.Tensor:
        width = max(lengths[i] for i in idx)
        return torch.stack([torch.nn.functional.pad(flat[starts[i]:starts[i] + lengths[i]], (0, width - lengths[i]))
                            for i in idx])

    for idx in chunks:
        mask = rows(torch.tensor([x for m in batch["masks"] for x in m], dtype=torch.float32), idx).bool()
        for b, i in enumerate(idx):  # padding is outside the response
            mask[b, lengths[i]:] = False
        loss, _, _ = grpo_loss(rows(current, idx), rows(batch["old"], idx), rows(batch["rollout"], idx),
                               advantages[idx], mask, grpo, denominator=denominator)
        loss.backward()
        total += float(loss.detach())
    return total, current.grad, advantages


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_loss_and_gradient_equal_miles(miles_result, aggregation):
    generation, batch, theirs = miles_result
    miles = theirs[aggregation]
    loss, grad, advantages = _v4rl(batch, GRPOConfig(loss_aggregation=aggregation))
    torch.testing.assert_close(advantages, torch.tensor(miles["advantages"]), rtol=1e-6, atol=1e-6)
    assert advantages.abs().max() > 0 and (advantages.view(4, 4)[1] == 0).all()  # the constant group: no signal
    assert loss == pytest.approx(miles["loss"], abs=LOSS_ATOL)
    torch.testing.assert_close(grad, miles["grad"], rtol=RTOL, atol=ATOL)
    ratio = (batch["current"] - batch["old"]).exp()
    tis = (batch["old"] - batch["rollout"]).exp()
    assert ((ratio > 1.2) & (ratio < 1.28)).any() and (ratio < 0.8).any() and (tis > 2).any()  # bounds exercised


@pytest.mark.parametrize("planted", [
    {"clip_high": 0.2}, {"clip_low": 0.3}, {"rollout_correction": RolloutCorrection(mode="tis", clip_high=1.5)},
    {"loss_aggregation": "token-mean"}], ids=["clip-high", "clip-low", "tis-bound", "aggregation"])
def test_a_planted_change_breaks_the_parity(miles_result, planted):
    _, batch, theirs = miles_result
    _, grad, _ = _v4rl(batch, GRPOConfig(**planted))
    assert not torch.allclose(grad, theirs["sample-mean"]["grad"], rtol=100 * RTOL, atol=100 * ATOL)


def test_the_embedded_default_is_the_cluster_jobs_aggregation():
    """Miles reduces sample-mean unless told --calculate-per-token-loss; v4rl's job never passes it by default, and
    the embedded trainer's default is the same, with the same clip range (tests/test_loss_setting.py: every surface)."""
    assert "--calculate-per-token-loss" not in grpo_args(SEED_RUN)
    assert GRPOConfig().loss_aggregation == SEED_RUN.algorithm.loss_aggregation == "sample-mean"
    assert _loss_args("sample-mean")["calculate_per_token_loss"] is False
    assert _loss_args("token-mean")["calculate_per_token_loss"] is True
    assert (GRPOConfig().clip_low, GRPOConfig().clip_high) == (_loss_args("sample-mean")["eps_clip"],
                                                               _loss_args("sample-mean")["eps_clip_high"])


PARSER_CODE = r"""
import argparse, json, sys
from miles.utils.arguments import get_miles_extra_args_provider
parser = argparse.ArgumentParser()
get_miles_extra_args_provider()(parser)  # Miles' own arguments (and its resets of Megatron's) only
request = json.loads(sys.argv[1])
answers = {}
for name, argv in request["argvs"].items():
    args, _ = parser.parse_known_args(argv + ["--rollout-batch-size", "4"])
    answers[name] = {key: getattr(args, key, "<absent>") for key in request["keys"]}
print("ANSWER" + json.dumps(answers))
"""


@pytest.mark.slow
def test_the_arguments_this_test_assumes_are_miles_own(miles_tree, megatron_tree, sglang_paths):
    """MILES_DEFAULTS and the job's loss flags as Miles' own argument parser reads them (generation 1; importing
    it costs ~25 s: Miles' arguments import SGLang's). qkv_format is Megatron's, checked by test_miles_parse_args."""
    import json

    from engines.upstream.miles_preflight import MILES_STUB_ROOTS
    from engines.upstream.stubs import GPU_ONLY_ROOTS

    keys = sorted(set(_loss_args("token-mean")) - set(JOB_FLAGS))
    argvs = {a: grpo_args(_seed_run(a)) for a in AGGREGATIONS}
    done = engine_python(PARSER_CODE, [megatron_tree, miles_tree, *sglang_paths],
                         args=[json.dumps({"argvs": argvs, "keys": keys})],
                         stub_roots=(*GPU_ONLY_ROOTS, *MILES_STUB_ROOTS), timeout=600)
    answers = json.loads(done.stdout.split("ANSWER", 1)[1])
    for aggregation, resolved in answers.items():
        assert resolved == {k: v for k, v in _loss_args(aggregation).items() if k in keys}, aggregation
