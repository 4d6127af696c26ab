"""EngineConfig.return_original_logprob: RAW sampled-token logprobs by default; off, SGLang's default
log_softmax(logits / temperature) of the same token (what Miles' trainer recomputes), greedy rows still RAW.

    .venv/bin/python -m pytest tests/test_rollout_processed_logprobs.py -q
"""

from __future__ import annotations

import math

import torch

from engines.rollout.engine import EngineConfig, RequestSpec, RolloutEngine
from engines.rollout.sampling import SamplingParams

PROMPT = [0] + [5 + (3 * k) % 90 for k in range(12)]


def _outputs(ckpt, *, original: bool, temperature: float):
    engine = RolloutEngine(ckpt, EngineConfig(context_length=64, return_original_logprob=original))
    try:
        spec = RequestSpec(rid="a", input_ids=PROMPT, seed=3, return_logprob=True, top_logprobs_num=10_000,
                           sampling=SamplingParams(temperature=temperature, max_new_tokens=6))
        return engine.generate([spec])[0]
    finally:
        engine.shutdown()


def test_processed_logprobs_are_the_temperature_scaled_softmax_of_the_same_token(tiny_checkpoint):
    raw, processed = (_outputs(tiny_checkpoint, original=o, temperature=0.8) for o in (True, False))
    assert raw.output_ids == processed.output_ids  # the same draws: only the reported logprob changes
    for step, tok in enumerate(raw.output_ids):
        ids = torch.tensor([t for _, t in raw.output_top_logprobs[step]])
        lps = torch.tensor([lp for lp, _ in raw.output_top_logprobs[step]], dtype=torch.float64)
        want = torch.log_softmax(lps / 0.8, -1)[(ids == tok).nonzero()[0, 0]]  # RAW lp = z - const: same z / T
        assert math.isclose(processed.output_logprobs[step], float(want), abs_tol=2e-5)
        assert not math.isclose(processed.output_logprobs[step], raw.output_logprobs[step], abs_tol=1e-4)


def test_greedy_rows_stay_raw(tiny_checkpoint):
    raw, processed = (_outputs(tiny_checkpoint, original=o, temperature=0.0) for o in (True, False))
    assert raw.output_logprobs == processed.output_logprobs
