"""The embedded trainer: transformers' DeepseekV4ForCausalLM, fp32 master weights, BF16 autocast, AdamW.

It scores given tokens (logprobs + entropy), takes GRPO steps with TIS on a batch of rollout samples,
and hands its weights to the rollout side as a native state dict. Micro-batches hold sequences of equal
length up to `max_tokens_per_gpu` tokens, so there is no padding at all (the transformers model cannot
pack several sequences into one row: its compressors would pool across sequence boundaries).

    trainer = Trainer.from_native(cfg, native_state, TrainerConfig(lr=1e-4))
    metrics = trainer.grpo_step(samples, grpo_config)
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from engines.model.config import ModelConfig
from engines.train.hf_model import native_from_reference, reference_from_native


@dataclass(kw_only=True)
class TrainerConfig:
    lr: float = 1e-4
    """AdamW learning rate (constant). Miles' DeepSeek-V4 recipe uses 1e-6 at 284B; the tiny model needs ~1e-4."""
    betas: tuple[float, float] = (0.9, 0.98)
    """AdamW betas (Miles' recipe)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_tokens_per_gpu: int = 8192
    """Token budget of one micro-batch (forward + backward); bounds activation memory."""
    recompute: bool = False
    """Recompute each decoder layer's activations in the backward pass (less memory, ~1/3 more compute)."""
    compute_dtype: str = "bfloat16"
    """Autocast dtype of forward/backward: bfloat16 (the seed's actor) or float32 (exact, for tests)."""
    quantization_aware: bool = False
    """Forward with the weights the rollout engine serves (FP8 round trip, straight-through gradient to the
    fp32 master; engines/train/fake_quant.py). Off: plain BF16, whose updates FP8 re-quantization mostly
    rounds away, so rollout lags the trainer."""
    rollout_expert_dtype: str = "fp8"
    """Routed-expert format of the rollout weights the quantization-aware forward reproduces."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.max_tokens_per_gpu < 1:
            raise ValueError(f"max_tokens_per_gpu must be >= 1, got {self.max_tokens_per_gpu}")
        if self.compute_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"compute_dtype must be 'bfloat16' or 'float32', got {self.compute_dtype!r}")


@dataclass
class Sample:
    """One rollout sample as the trainer needs it."""

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    reward: float
    group: int
    """Samples of the same prompt share a group id (GRPO normalises within it)."""
    advantage: float = 0.0
    extra: dict = field(default_factory=dict)


def micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped into micro-batches of equal length with at most max_tokens tokens each (no padding).

    >>> micro_batches([5, 3, 5, 5, 3], max_tokens=10)
    [[1, 4], [0, 2], [3]]
    """
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, n in enumerate(lengths):
        by_length[n].append(i)
    batches = []
    for n in sorted(by_length):
        per_batch = max(1, max_tokens // n)
        idx = by_length[n]
        batches.extend(idx[j:j + per_batch] for j in range(0, len(idx), per_batch))
    return batches


class Trainer:
    def __init__(self, model, cfg: ModelConfig, config: TrainerConfig) -> None:
        self.model = model.float().train()
        self.cfg, self.config = cfg, config
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, betas=config.betas,
                                           weight_decay=config.weight_decay)
        self.step = 0
        self.fake_quant = None
        self._stored = None
        if config.quantization_aware:
            from engines.train.fake_quant import FakeQuant

            self.fake_quant = FakeQuant(self.model, cfg, expert_dtype=config.rollout_expert_dtype)
        if config.recompute:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    @classmethod
    def from_native(cls, cfg: ModelConfig, native: dict[str, torch.Tensor], config: TrainerConfig) -> "Trainer":
        return cls(reference_from_native(cfg, native), cfg, config)

    def native_state(self) -> dict[str, torch.Tensor]:
        """fp32 master weights under native names (what an export quantizes for the rollout engine)."""
        return native_from_reference(self.model)

    def _autocast(self):
        enabled = self.config.compute_dtype == "bfloat16"
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled)

    def _forward_logprobs(self, seqs: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprobs and entropies [B, R] of the response tokens of equal-length sequences (grad enabled)."""
        ids = torch.tensor([p + r for p, r in seqs])
        p_len, r_len = len(seqs[0][0]), len(seqs[0][1])
        with self._autocast():
            if self.fake_quant is None:
                out = self.model(input_ids=ids)
            else:
                if self._stored is None:  # the weights only change in optimizer.step(): quantize once per step
                    self._stored = self.fake_quant.stored(self.model)
                out = self.fake_quant.forward(self.model, ids, self._stored)
            logits = out.logits[:, p_len - 1:p_len - 1 + r_len].float()
        logp = torch.log_softmax(logits, dim=-1)
        targets = ids[:, p_len:p_len + r_len]
        token_lp = logp.gather(-1, targets[..., None])[..., 0]
        entropy = -(logp.exp() * logp).sum(-1)
        return token_lp, entropy

    @torch.no_grad()
    def logprobs(self, seqs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """Per-token logprobs of each (prompt, response) under the current weights."""
        out: list[list[float]] = [[] for _ in seqs]
        samples = [Sample(p, r, [], 0.0, 0) for p, r in seqs]
        for idx in self._shape_groups(samples):
            lp, _ = self._forward_logprobs([seqs[i] for i in idx])
            for i, row in zip(idx, lp):
                out[i] = row.tolist()
        return out

    def grpo_step(self, samples: list[Sample], grpo) -> dict[str, float]:
        """One optimizer step of GRPO (+ TIS) on samples whose `advantage` is already set (rl.grpo.GRPOConfig)."""
        from rl.grpo import policy_loss, tis_metrics, tis_weights

        total = sum(len(s.response_ids) for s in samples)
        if total == 0:
            raise ValueError("GRPO step got no response tokens; every sample has an empty response")
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = defaultdict(float)
        for idx in self._shape_groups(samples):
            chunk = [samples[i] for i in idx]
            lp, entropy = self._forward_logprobs([(s.prompt_ids, s.response_ids) for s in chunk])
            rollout_lp = torch.tensor([s.rollout_logprobs for s in chunk], dtype=torch.float32)
            old = lp.detach()  # one optimizer step per rollout: the behaviour policy is the current one
            mask = torch.ones_like(lp, dtype=torch.bool)
            weights = None
            if grpo.use_tis:
                weights, _ = tis_weights(old, rollout_lp, mask, clip_high=grpo.tis_clip_high,
                                         clip_low=grpo.tis_clip_low)
            loss, m = policy_loss(lp, old, torch.tensor([s.advantage for s in chunk]), mask,
                                  clip_low=grpo.clip_low, clip_high=grpo.clip_high, tis_weights=weights,
                                  loss_denominator=total)
            loss.backward()
            for key in ("pg_loss", "pg_clipfrac", "ppo_kl"):
                sums[key] += m[key]  # already divided by the batch's token count
            n = lp.numel()
            for key, value in tis_metrics(old, rollout_lp, mask, clip_high=grpo.tis_clip_high,
                                          clip_low=grpo.tis_clip_low).items():
                sums[key] += value * n / total
            sums["entropy"] += float(entropy.detach().sum()) / total
        clip = grpo.max_grad_norm if grpo.max_grad_norm > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        if not torch.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"non-finite grad norm {float(grad_norm)} at step {self.step + 1}; "
                                     "the update was skipped (lower lr, check rewards/advantages for NaN)")
        self.optimizer.step()
        self._stored = None
        self.step += 1
        metrics = {f"train/{k}": v for k, v in sums.items()}
        metrics["train/grad_norm"] = float(grad_norm)
        return metrics

    def _shape_groups(self, samples: list[Sample]) -> list[list[int]]:
        """Micro-batches of identical (prompt, response) lengths, each within the token budget."""
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        out = []
        for batch in micro_batches(lengths, self.config.max_tokens_per_gpu):
            groups: dict[tuple[int, int], list[int]] = defaultdict(list)
            for i in batch:
                if samples[i].response_ids:
                    groups[(len(samples[i].prompt_ids), len(samples[i].response_ids))].append(i)
            out.extend(groups.values())
        return out

    # ------------------------------------------------------------------ state for checkpoints
    def state(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "step": self.step}

    def load_state(self, state: dict) -> None:
        self._stored = None
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])

