"""The bound on Miles' train-vs-rollout |Δlogprob|, derived from bf16 noise measured on the rehearsal's own model.

Miles logs `train/train_rollout_logprob_abs_diff`: the mean |Megatron's logprob - the engine's rollout logprob|
over response tokens. In the rehearsal both sides hold the same weights (the engine dequantizes the FP8/FP4
checkpoint to fp32, Megatron loads v4rl's BF16 conversion of it, exact for these scales), so all they may differ by
is arithmetic: Megatron computes in bf16, the engine in fp32. This module measures that difference on the same
tiny checkpoint, prompts, sampling temperature and response length as the rehearsal: v4rl's engine generates in
fp32 (processed logprobs, log_softmax(logits / T), as SGLang and Miles' loss compute them), then v4rl's model
scores the same tokens in bf16 (fp32 where the reference keeps fp32). `bf16_noise` is the mean |bf16 - fp32| over
those tokens; the bound is NOISE_FACTOR times it. A second bf16 implementation (Megatron's) differs from fp32 by
about as much, and from ours by about sqrt(2) times as much, so 3x leaves room for that and for the sample-to-sample
spread of a 16-sample mean, but not for a real mismatch: raw logprobs against processed ones at T 0.8 (the engine's
own convention before ENGINE_LOGPROB_ROW) are `raw_vs_processed`, about 20x the noise.

    m = measure_logprob_noise(hf_dir, prompts, temperature=0.8)
    m.bf16_noise, m.bound, m.raw_vs_processed
    .venv/bin/python -m engines.rehearsal.logprob_noise HF_DIR    # prints the measurement as JSON
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

NOISE_FACTOR = 3.0
"""The bound is NOISE_FACTOR x the measured bf16 noise (the module docstring says why 3)."""


@dataclass(frozen=True)
class LogprobNoise:
    bf16_noise: float
    """Mean |bf16 - fp32| processed logprob of the same response tokens under the same weights."""
    raw_vs_processed: float
    """Mean |log_softmax(logits) - log_softmax(logits / T)| in fp32: what a raw-vs-processed mix-up alone gives."""
    tokens: int
    temperature: float
    factor: float = NOISE_FACTOR

    @property
    def bound(self) -> float:
        return self.factor * self.bf16_noise

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "bound": self.bound}


def measure_logprob_noise(hf: Path, prompts: list[str], *, temperature: float, samples_per_prompt: int = 4,
                          max_new_tokens: int = 24, seed: int = 0) -> LogprobNoise:
    """Generate with v4rl's engine in fp32 at `temperature`, rescore in bf16; see the module docstring."""
    from transformers import AutoTokenizer

    from engines.align.score import load_ours, token_logprobs
    from engines.rollout.api import EngineConfig, RequestSpec
    from engines.rollout.engine import RolloutEngine
    from engines.rollout.sampling import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(str(hf))
    specs = [RequestSpec(rid=f"{p}-{s}", input_ids=tokenizer(prompt)["input_ids"], seed=seed + 1000 * p + s,
                         return_logprob=True, sampling=SamplingParams(temperature=temperature,
                                                                      max_new_tokens=max_new_tokens))
             for p, prompt in enumerate(prompts) for s in range(samples_per_prompt)]
    engine = RolloutEngine(hf, EngineConfig(dtype="float32", return_original_logprob=False))
    try:
        outputs = engine.generate(specs, timeout=600)
    finally:
        engine.shutdown()
    sequences = [{"prompt_ids": o.input_ids, "response_ids": o.output_ids} for o in outputs if o.output_ids]
    fp32_processed = [o.output_logprobs for o in outputs if o.output_ids]

    def scored(dtype: torch.dtype, scale: float) -> list[list[float]]:
        model = load_ours(hf, dtype)
        return token_logprobs(lambda ids: model(ids).float() / scale, sequences, vocab_size=model.cfg.vocab_size)

    bf16_processed = scored(torch.bfloat16, temperature)
    fp32_raw = scored(torch.float32, 1.0)
    engine_lp = torch.tensor([x for row in fp32_processed for x in row])
    return LogprobNoise(
        bf16_noise=_mean_abs(torch.tensor([x for row in bf16_processed for x in row]), engine_lp),
        raw_vs_processed=_mean_abs(torch.tensor([x for row in fp32_raw for x in row]), engine_lp),
        tokens=engine_lp.numel(), temperature=temperature)


def _mean_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape or a.numel() == 0:
        raise ValueError(f"logprob noise: {a.numel()} scored tokens against {b.numel()} generated ones")
    return float((a - b).abs().mean())


def logprob_diff_problem(rollouts: dict[str, dict], noise: LogprobNoise, logs: str) -> str | None:
    """None when every rollout's train/train_rollout_logprob_abs_diff is within the bound; else one line."""
    for rollout, values in sorted(rollouts.items(), key=lambda kv: int(kv[0])):
        diff = values.get("train/train_rollout_logprob_abs_diff")
        if diff is not None and diff > noise.bound:
            return (f"rollout {rollout}: Miles' train/train_rollout_logprob_abs_diff {diff:.4f} exceeds "
                    f"{noise.factor:g} x the measured bf16 noise {noise.bf16_noise:.4f} = {noise.bound:.4f}: Megatron "
                    f"and the engine compute different logprobs for the same tokens (see {logs})")
    return None


if __name__ == "__main__":
    from engines.presets.runs import SEED_RUN
    from engines.rehearsal.run import rehearsal_prompts

    print(json.dumps(measure_logprob_noise(Path(sys.argv[1]), rehearsal_prompts(),
                                           temperature=SEED_RUN.data.temperature).to_json(), indent=2))
