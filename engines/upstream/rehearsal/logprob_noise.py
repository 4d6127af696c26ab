"""The bounds on Miles' train-vs-rollout |Δlogprob|, derived from noise measured on the rehearsal's own model.

Miles logs `train/train_rollout_logprob_abs_diff`: the mean |Megatron's logprob - the engine's rollout logprob|
over response tokens. What the two sides may differ by, measured here on the same tiny checkpoint, prompts,
sampling temperature and response length as the rehearsal (v4rl's engine generates in fp32 with processed
logprobs, log_softmax(logits / T), as SGLang and Miles' loss compute them; the same tokens are then rescored):
- `bf16_noise`: arithmetic. Stage train's engine serves the checkpoint (dequantized to fp32) and Megatron its BF16
  conversion (exact for these scales), so they differ only in that Megatron computes in bf16: the mean |bf16 -
  fp32| of v4rl's model on the same weights (fp32 where the reference keeps fp32; all-bf16 and transformers' bf16
  measured the same, 0.0047-0.0050). Bound: NOISE_FACTOR x bf16_noise.
- `fp8_requant_noise`: Miles' broadcast. From stage full's first broadcast on, the engine holds what Miles sent:
  the actor's BF16 weights quantized again by Miles (megatron_to_hf/processors/quantizer_fp8.py: FP8 blocks with
  float32 amax/448 scales, where the checkpoint has UE8M0 ones; wo_a sent as BF16), while Megatron keeps computing
  on BF16. Measured as the mean |Δ| of the fp32 logprobs when every weight the checkpoint stores quantized, wo_a
  excepted, is re-quantized that way. Stage full's bound: NOISE_FACTOR x (bf16_noise + fp8_requant_noise), the
  sum because mean |a + b| <= mean |a| + mean |b|.
Why 3x: a second bf16 implementation (Megatron's) differs from fp32 by about as much as ours, the sample-to-sample
spread of a 16-sample mean is large, but a real mismatch is far beyond it: raw logprobs against processed ones at
T 0.8 (the engine's own convention before ENGINE_LOGPROB_ROW) are `raw_vs_processed`, about 20x bf16_noise.

    m = measure_logprob_noise(hf_dir, prompts, temperature=0.8)
    m.bound, m.broadcast_bound, m.raw_vs_processed
    .venv/bin/python -m engines.upstream.rehearsal.logprob_noise HF_DIR    # prints the measurement as JSON
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
    fp8_requant_noise: float
    """Mean |Δ| fp32 processed logprob when the quantized weights are re-quantized as Miles' broadcast does."""
    raw_vs_processed: float
    """Mean |log_softmax(logits) - log_softmax(logits / T)| in fp32: what a raw-vs-processed mix-up alone gives."""
    tokens: int
    temperature: float
    factor: float = NOISE_FACTOR

    @property
    def bound(self) -> float:
        """Stage train's: the engine serves the checkpoint, Megatron its BF16 conversion."""
        return self.factor * self.bf16_noise

    @property
    def broadcast_bound(self) -> float:
        """Stage full's: the engine serves Miles' re-quantized broadcast of Megatron's BF16 weights."""
        return self.factor * (self.bf16_noise + self.fp8_requant_noise)

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "bound": self.bound, "broadcast_bound": self.broadcast_bound}


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

    def scored(model, scale: float) -> torch.Tensor:
        rows = token_logprobs(lambda ids: model(ids).float() / scale, sequences, vocab_size=model.cfg.vocab_size)
        return torch.tensor([x for row in rows for x in row])

    engine_lp = torch.tensor([x for row in fp32_processed for x in row])
    fp32 = load_ours(hf, torch.float32)
    raw = scored(fp32, 1.0)
    fp32.load_state_dict(_requantized_as_miles_broadcasts(hf))
    return LogprobNoise(
        bf16_noise=_mean_abs(scored(load_ours(hf, torch.bfloat16), temperature), engine_lp),
        fp8_requant_noise=_mean_abs(scored(fp32, temperature), engine_lp),
        raw_vs_processed=_mean_abs(raw, engine_lp), tokens=engine_lp.numel(), temperature=temperature)


MILES_BF16_SENT = ("attn.wo_a.weight",)
"""Weights the checkpoint stores quantized that Miles' broadcast sends as BF16 (its FP8 quantizer list lacks them)."""


def _requantized_as_miles_broadcasts(hf: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's weights in fp32, each quantized one (but MILES_BF16_SENT) as Miles' broadcast sends it: FP8
    e4m3 blocks of FP8_BLOCK (128x128) with float32 amax/448 scales, dequantized again."""
    from checkpoints.hf import FP8_BLOCK, QuantizedTensor, load_hf_checkpoint
    from checkpoints.quant import dequantize_fp8_blockwise, quantize_fp8_blockwise

    _, raw = load_hf_checkpoint(hf, dequantize=False)
    state = {}
    for name, t in raw.items():
        if not isinstance(t, QuantizedTensor):
            state[name] = t.float() if t.dtype.is_floating_point else t
            continue
        w = t.dequantize(torch.float32)
        if name.endswith(MILES_BF16_SENT):
            state[name] = w
        else:
            q, scale = quantize_fp8_blockwise(w, block=FP8_BLOCK, scale_fmt="fp32")
            state[name] = dequantize_fp8_blockwise(q, scale, out_dtype=torch.float32)
    return state


def _mean_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape or a.numel() == 0:
        raise ValueError(f"logprob noise: {a.numel()} scored tokens against {b.numel()} generated ones")
    return float((a - b).abs().mean())


def logprob_diff_problem(rollouts: dict[str, dict], noise: LogprobNoise, logs: str, *,
                         broadcast: bool = False) -> str | None:
    """None when every rollout's train/train_rollout_logprob_abs_diff is within the bound (stage full's when
    `broadcast`: the engine serves Miles' broadcasts); else one line naming the rollout and the numbers."""
    bound = noise.broadcast_bound if broadcast else noise.bound
    noise_name = (f"(bf16 {noise.bf16_noise:.4f} + FP8 re-quantization {noise.fp8_requant_noise:.4f})" if broadcast
                  else f"bf16 {noise.bf16_noise:.4f}")
    for rollout, values in sorted(rollouts.items(), key=lambda kv: int(kv[0])):
        diff = values.get("train/train_rollout_logprob_abs_diff")
        if diff is not None and diff > bound:
            return (f"rollout {rollout}: Miles' train/train_rollout_logprob_abs_diff {diff:.4f} exceeds "
                    f"{noise.factor:g} x the measured noise {noise_name} = {bound:.4f}: Megatron and the engine "
                    f"compute different logprobs for the same tokens (see {logs})")
    return None


if __name__ == "__main__":
    from engines.presets.runs import SEED_RUN
    from engines.upstream.rehearsal.run import rehearsal_prompts

    print(json.dumps(measure_logprob_noise(Path(sys.argv[1]), rehearsal_prompts(),
                                           temperature=SEED_RUN.data.temperature).to_json(), indent=2))
