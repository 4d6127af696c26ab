"""The rehearsal's bound on Miles' |Δlogprob| (engines/upstream/rehearsal/logprob_noise.py): measured bf16 noise on the
tiny Miles-legal model, and the check a train or full stage applies to Miles' logged values."""

import pytest

from engines.upstream.rehearsal.logprob_noise import NOISE_FACTOR, LogprobNoise, logprob_diff_problem, measure_logprob_noise
from engines.upstream.rehearsal.run import rehearsal_prompts
from engines.upstream.rehearsal.tiny_model import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("noise") / "hf")


def test_bf16_noise_is_small_and_a_raw_vs_processed_mixup_is_far_beyond_the_bound(tiny_hf):
    m = measure_logprob_noise(tiny_hf, rehearsal_prompts()[:2], temperature=0.8, samples_per_prompt=2,
                              max_new_tokens=12)
    assert m.tokens >= 20
    # bf16 rounding moves a logprob by ~5e-3 on this model (0.0050 over 346 tokens, docs/rehearsal.md); the
    # raw-vs-processed mix-up Miles logged before ENGINE_LOGPROB_ROW was 0.10-0.11, far past 3x the noise
    assert 1e-4 < m.bf16_noise < 0.02, m
    assert m.raw_vs_processed > 3 * m.bound, m
    assert m.bound == pytest.approx(NOISE_FACTOR * m.bf16_noise)
    # Miles' broadcast re-quantizes UE8M0-scaled FP8 with float32 scales: ~0.023 on this model (Miles logged
    # 0.0231 / 0.0238 in stage full), more than bf16 alone; its bound still excludes the raw-vs-processed mix-up
    assert m.bf16_noise < m.fp8_requant_noise < 0.06, m
    assert m.broadcast_bound == pytest.approx(NOISE_FACTOR * (m.bf16_noise + m.fp8_requant_noise))
    assert m.broadcast_bound < m.raw_vs_processed + m.fp8_requant_noise, m


def test_at_temperature_one_raw_and_processed_coincide(tiny_hf):
    m = measure_logprob_noise(tiny_hf, rehearsal_prompts()[:1], temperature=1.0, samples_per_prompt=2,
                              max_new_tokens=8)
    assert m.raw_vs_processed < 1e-4, m  # the engine's fp32 logprobs are the model's own, token for token


def test_a_diff_past_the_bound_is_one_line_naming_the_rollout_and_the_numbers():
    noise = LogprobNoise(bf16_noise=0.005, fp8_requant_noise=0.023, raw_vs_processed=0.11, tokens=346,
                         temperature=0.8)
    within = {"0": {"train/train_rollout_logprob_abs_diff": 0.009}, "1": {"train/loss": 0.0}}
    assert logprob_diff_problem(within, noise, "miles-train.log") is None
    beyond = {**within, "2": {"train/train_rollout_logprob_abs_diff": 0.105}}
    problem = logprob_diff_problem(beyond, noise, "miles-train.log")
    assert problem.startswith("rollout 2: Miles' train/train_rollout_logprob_abs_diff 0.1050 exceeds 3 x the "
                              "measured noise bf16 0.0050 = 0.0150"), problem
    assert "\n" not in problem and "miles-train.log" in problem
    after_broadcast = {"0": {"train/train_rollout_logprob_abs_diff": 0.0238}}  # stage full's rollout 0, measured
    assert logprob_diff_problem(after_broadcast, noise, "x.log") is not None
    assert logprob_diff_problem(after_broadcast, noise, "x.log", broadcast=True) is None
    problem = logprob_diff_problem(beyond, noise, "x.log", broadcast=True)
    assert "exceeds 3 x the measured noise (bf16 0.0050 + FP8 re-quantization 0.0230) = 0.0840" in problem, problem
