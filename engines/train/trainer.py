"""The embedded trainer: transformers' DeepseekV4ForCausalLM, fp32 master weights, BF16 autocast, AdamW.

It scores given tokens (logprobs + entropy), takes GRPO steps with TIS on a batch of rollout samples,
and hands its weights to the rollout side as a native state dict.

Samples sharing a prompt (a GRPO group) share its forward: each micro-batch runs its distinct prompts once
with transformers' DynamicCache, expands the cache to one row per sample (`reorder_cache`) and continues
with the responses, so a group of n costs one prompt plus n responses instead of n full sequences, with
the same logprobs and gradients (autograd flows back through the cache). Micro-batches hold prompts of one
length and stay within `max_tokens_per_gpu` (prompt + padded response tokens). The model cannot pack
unrelated sequences into one row: its compressors would pool across the boundary. mHC's Sinkhorn runs as
native kernels (hf_model.use_native_mhc): the same results and gradients, bit for bit, in fewer ops.

    trainer = Trainer.from_native(cfg, native_state, TrainerConfig(lr=1e-4))
    metrics = trainer.grpo_step(samples, grpo_config)
"""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from engines.model.config import ModelConfig
from engines.train.bf16 import bf16_autocast
from engines.train.routing_replay import RouterReplay

# engines.train.hf_model (transformers' DeepSeek-V4 modeling, which loads torch._dynamo and torch.distributed: about
# 3 CPU-s) is imported where a model is built, not here: TrainerConfig and Sample are read by processes that never
# build one (the driver of a run on Ray, the rollout worker, which imports engines.train.actors).


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
    """Routed-expert format of the rollout weights (fp8 | fp4): what the quantization-aware forward reproduces and
    what the weight export writes (engines/train/actors.py), so both match the rollout engine's start format."""
    rollout_weight_format: str = "fp8"
    """How the rollout weights store their linears (fp8 | bf16): what the weight export writes. bf16 is the
    unquantized BF16 rollout (no quantization-aware forward then: nothing is rounded to reproduce)."""
    threads: int | None = None
    """Intra-op CPU threads while the trainer computes (set for each step and scoring call, restored after, so a
    rollout engine in the same process keeps its own setting). None: every core (os.cpu_count()). Ray gives an
    actor that reserves one CPU OMP_NUM_THREADS=1, which left all but one core idle while `v4rl train`'s trainer
    actor worked (rollout and training take turns, so the cores are free); set a number to share the machine."""
    share_prompt_prefix: bool = True
    """Run each distinct prompt once per micro-batch and continue its samples from the prompt's cache (same
    logprobs and gradients as full sequences, to float rounding). Off, or with `recompute` (transformers turns
    the cache off under gradient checkpointing): every sample is forwarded as a full sequence."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.max_tokens_per_gpu < 1:
            raise ValueError(f"max_tokens_per_gpu must be >= 1, got {self.max_tokens_per_gpu}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1 or None (every core), got {self.threads}")
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
    routed_experts: torch.Tensor | None = None
    """The rollout engine's experts per position (int32 [len(prompt + response) - 1, layers, top_k]); with them
    the step logs train/router_mismatch_frac and, with routing replay, replays them (routing_replay.py)."""


@dataclass
class PrefixBatch:
    """One shared-prefix micro-batch: distinct prompts of one length and, per prompt, the samples continuing it."""

    prompts: list[tuple[int, ...]]
    members: list[list[int]]
    """members[g]: indices (into the caller's sequence list) of the samples whose prompt is prompts[g]."""


def prefix_batches(seqs: list[tuple[list[int], list[int]]], max_tokens: int) -> list[PrefixBatch]:
    """Group samples by prompt, then fill micro-batches with prompts of equal length while
    prompts x length + samples x longest response stays within max_tokens (a group too big is split).

    >>> [(b.prompts, b.members) for b in prefix_batches([([1, 2], [5]), ([1, 2], [6, 7]), ([3], [8])], 6)]
    [([(3,)], [[2]]), ([(1, 2)], [[0, 1]])]
    """
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i, (prompt, _) in enumerate(seqs):
        by_prompt.setdefault(tuple(prompt), []).append(i)
    units: list[tuple[tuple[int, ...], list[int]]] = []
    for prompt, members in by_prompt.items():
        members = sorted(members, key=lambda i: (len(seqs[i][1]), i))
        part: list[int] = []
        for i in members:  # split a group whose own prompt + responses exceed the budget
            longest = len(seqs[i][1])
            if part and len(prompt) + (len(part) + 1) * longest > max_tokens:
                units.append((prompt, part))
                part = []
            part.append(i)
        units.append((prompt, part))
    units.sort(key=lambda u: (len(u[0]), max(len(seqs[i][1]) for i in u[1]), u[1][0]))
    batches: list[PrefixBatch] = []
    rows = longest = 0
    for prompt, members in units:
        unit_longest = max(len(seqs[i][1]) for i in members)
        if batches and len(batches[-1].prompts[0]) == len(prompt):
            current = batches[-1]
            size = (len(current.prompts) + 1) * len(prompt) + (rows + len(members)) * max(longest, unit_longest)
            if size <= max_tokens:
                current.prompts.append(prompt)
                current.members.append(members)
                rows, longest = rows + len(members), max(longest, unit_longest)
                continue
        batches.append(PrefixBatch([prompt], [members]))
        rows, longest = len(members), unit_longest
    return batches


def micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices sorted by length and cut so that each micro-batch's padded size (count x longest) fits max_tokens.

    >>> micro_batches([5, 3, 5, 5, 3, 9], max_tokens=10)
    [[1, 4], [0, 2], [3], [5]]
    """
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
        if current and max(longest, lengths[i]) * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, lengths[i])
    if current:
        batches.append(current)
    return batches


def _token_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, R, V] predicting targets [B, R] -> (logprob of each target, entropy of each distribution)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets[..., None])[..., 0], -(logp.exp() * logp).sum(-1)


class Trainer:
    def __init__(self, model, cfg: ModelConfig, config: TrainerConfig) -> None:
        from engines.train.hf_model import use_native_mhc

        self.model = use_native_mhc(model.float().train(), cfg)
        self.router_replay = RouterReplay(self.model)
        self.cfg, self.config = cfg, config
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, betas=config.betas,
                                           weight_decay=config.weight_decay)
        self.step = 0
        self._mismatch = [0, 0]
        """(mismatched, compared) router pairs of the current step (routing_replay.py)."""
        self._forwarded = 0
        """Tokens the current step's forwards ran, padding included (perf/train_forwarded_tokens)."""
        self.fake_quant = None
        self._stored = None
        if config.quantization_aware:
            from engines.train.fake_quant import FakeQuant

            self.fake_quant = FakeQuant(self.model, cfg, expert_dtype=config.rollout_expert_dtype)
        if config.recompute:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    @classmethod
    def from_native(cls, cfg: ModelConfig, native: dict[str, torch.Tensor], config: TrainerConfig) -> "Trainer":
        from engines.train.hf_model import reference_from_native

        return cls(reference_from_native(cfg, native), cfg, config)

    def native_state(self) -> dict[str, torch.Tensor]:
        """fp32 master weights under native names (what an export quantizes for the rollout engine)."""
        from engines.train.hf_model import native_from_reference

        return native_from_reference(self.model)

    @contextmanager
    def _compute_threads(self):
        """torch's intra-op threads at config.threads (every core by default) for the duration."""
        before = torch.get_num_threads()
        torch.set_num_threads(self.config.threads or os.cpu_count() or 1)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def _autocast(self):
        return bf16_autocast(enabled=self.config.compute_dtype == "bfloat16")

    @property
    def shares_prefix(self) -> bool:
        return self.config.share_prompt_prefix and not self.config.recompute

    def _call_model(self, input_ids: torch.Tensor, **kwargs):
        if self.fake_quant is None:
            return self.model(input_ids=input_ids, **kwargs)
        if self._stored is None:  # the weights only change in optimizer.step(): quantize once per step
            self._stored = self.fake_quant.stored(self.model)
        return self.fake_quant.forward(self.model, input_ids, self._stored, **kwargs)

    def _forward_shared(self, batch: PrefixBatch, seqs: list[tuple[list[int], list[int]]],
                        routes: list[torch.Tensor] | None = None, replay: bool = False) -> tuple[torch.Tensor, ...]:
        """Like _forward_logprobs, rows in `batch.members` order: prompts once, responses from the expanded cache.
        With the rollout's `routes` (one per sequence) the router mismatch is counted from these two forwards; with
        `replay` they are replayed, the prompt's from its group's first sample (`_prompt_routes_agree` holds)."""
        from transformers import DynamicCache

        rows = [i for members in batch.members for i in members]
        expand = torch.tensor([g for g, members in enumerate(batch.members) for _ in members])
        prompt_len = len(batch.prompts[0])
        r_max = max(len(seqs[i][1]) for i in rows)
        responses = torch.zeros(len(rows), r_max, dtype=torch.long)
        mask = torch.zeros(len(rows), r_max, dtype=torch.bool)
        for b, i in enumerate(rows):
            response = seqs[i][1]
            responses[b, :len(response)] = torch.tensor(response)
            mask[b, :len(response)] = True
        replayed_prompts = replayed_responses = None
        if replay:  # a route per position: the prompts' in the first forward, each response's in the second
            replayed_prompts = torch.stack([routes[members[0]][:prompt_len].long() for members in batch.members])
            replayed_responses = _padded_routes([routes[i][prompt_len:] for i in rows], r_max)
        with self._autocast():
            cache = DynamicCache(config=self.model.config)
            with self.router_replay.forward(replayed_prompts):
                prefix = self._call_model(torch.tensor(batch.prompts), past_key_values=cache, use_cache=True)
            own_prompt = self.router_replay.own_routes()[expand] if routes is not None else None
            cache.reorder_cache(expand)
            with self.router_replay.forward(replayed_responses):
                continued = self._call_model(responses, past_key_values=cache, use_cache=True)
        if routes is not None:  # a sequence's routes cover its prompt and all but its last response token
            own = torch.cat([own_prompt, self.router_replay.own_routes()[:, :-1]], dim=1)
            lengths = torch.tensor([len(seqs[i][0]) + len(seqs[i][1]) - 1 for i in rows])
            self._count_mismatch(own, [routes[i] for i in rows], lengths)
        self._forwarded += len(batch.prompts) * prompt_len + responses.numel()
        logits = torch.cat([prefix.logits[:, -1:][expand], continued.logits[:, :-1]], dim=1)
        return (*_token_logprobs_and_entropy(logits, responses), mask)

    def _count_mismatch(self, own: torch.Tensor, routes: list[torch.Tensor], routed: torch.Tensor) -> None:
        """Add the router mismatch of one forward to self._mismatch: `own` [B, S, ...] from RouterReplay.own_routes,
        the rollout's per-sequence `routes`, `routed[b]` positions of row b covered by a route."""
        valid = torch.arange(own.shape[1])[None, :] < routed[:, None]
        mismatched, pairs = self.router_replay.mismatch(own, _padded_routes(routes, own.shape[1]), valid)
        self._mismatch[0] += mismatched
        self._mismatch[1] += pairs

    def _micro_batches(self, seqs: list[tuple[list[int], list[int]]], routes: list[torch.Tensor] | None = None,
                       replay: bool = False):
        """(sample indices in row order, forward) per micro-batch, skipping samples without response tokens. With
        the rollout's `routes` (one per sample) each forward counts router mismatches into self._mismatch; with
        `replay` it also replays them. A prompt shared by a group is forwarded once, replayed with its first
        sample's routes, unless the group's samples came back with different routes for it: then every sample
        is forwarded whole with its own."""
        keep = [i for i, (_, r) in enumerate(seqs) if r]
        kept = [seqs[i] for i in keep]
        kept_routes = None if routes is None else [routes[i] for i in keep]
        batches = prefix_batches(kept, self.config.max_tokens_per_gpu) if self.shares_prefix else None
        if batches is not None and (not replay or _prompt_routes_agree(batches, kept, kept_routes)):
            for batch in batches:
                rows = [keep[j] for members in batch.members for j in members]
                yield rows, lambda batch=batch: self._forward_shared(batch, kept, kept_routes, replay)
        else:
            for idx in self._batches([len(p) + len(r) for p, r in seqs], [len(r) for _, r in seqs]):
                yield idx, lambda idx=idx: self._forward_logprobs(
                    [seqs[i] for i in idx], None if routes is None else [routes[i] for i in idx], replay)

    def _forward_logprobs(self, seqs: list[tuple[list[int], list[int]]], routes: list[torch.Tensor] | None = None,
                          replay: bool = False) -> tuple[torch.Tensor, ...]:
        """Logprobs, entropies and mask [B, R_max] of the response tokens (right padding; grad enabled)."""
        lengths = [len(p) + len(r) for p, r in seqs]
        ids = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
        r_max = max(len(r) for _, r in seqs)
        pos = torch.zeros(len(seqs), r_max, dtype=torch.long)
        mask = torch.zeros(len(seqs), r_max, dtype=torch.bool)
        for b, (p, r) in enumerate(seqs):
            ids[b, :lengths[b]] = torch.tensor(p + r)
            pos[b, :len(r)] = torch.arange(len(p) - 1, len(p) - 1 + len(r))
            mask[b, :len(r)] = True
        replayed = _padded_routes(routes, ids.shape[1]) if routes is not None and replay else None
        with self._autocast(), self.router_replay.forward(replayed):
            out = self._call_model(ids)
        if routes is not None:
            self._count_mismatch(self.router_replay.own_routes(), routes, torch.tensor(lengths) - 1)
        self._forwarded += ids.numel()
        rows = torch.arange(len(seqs))[:, None]
        return (*_token_logprobs_and_entropy(out.logits[rows, pos], ids[rows, pos + 1]), mask)

    @torch.no_grad()
    def logprobs(self, seqs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """Per-token logprobs of each (prompt, response) under the current weights."""
        out: list[list[float]] = [[] for _ in seqs]
        with self._compute_threads():
            for idx, forward in self._micro_batches(seqs):
                lp, _, mask = forward()
                for i, row, m in zip(idx, lp, mask):
                    out[i] = row[m].tolist()
        return out

    def grpo_step(self, samples: list[Sample], grpo) -> dict[str, float]:
        """One optimizer step of GRPO (+ TIS) on samples whose `advantage` is already set (rl.grpo.GRPOConfig).
        Besides train/*, it reports how it computed: perf/train_threads, perf/train_tokens (prompt + response
        tokens of the samples), perf/train_forwarded_tokens (what the forwards ran, padding included: below
        train_tokens when prompts are shared) and perf/train_tokens_per_s, so a slower path shows as a number."""
        start = time.perf_counter()
        self._forwarded = 0
        with self._compute_threads():
            metrics = self._grpo_step(samples, grpo)
            metrics["perf/train_threads"] = torch.get_num_threads()
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples if s.response_ids)
        metrics.update({"perf/train_tokens": tokens, "perf/train_forwarded_tokens": self._forwarded,
                        "perf/train_tokens_per_s": tokens / (time.perf_counter() - start)})
        return metrics

    def _grpo_step(self, samples: list[Sample], grpo) -> dict[str, float]:
        from rl.grpo import grpo_loss, step_denominator

        total = sum(len(s.response_ids) for s in samples)
        if total == 0:
            raise ValueError("GRPO step got no response tokens; every sample has an empty response")
        sequences = sum(1 for s in samples if s.response_ids)
        # each micro-batch's loss over the whole step's denominator: their gradients add up to the step's
        denominator = step_denominator(grpo.loss_aggregation, [len(s.response_ids) for s in samples])
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = defaultdict(float)
        routes = [s.routed_experts for s in samples] if all(s.routed_experts is not None for s in samples) else None
        replay = bool(getattr(grpo.rollout_correction, "routing_replay", False))
        if replay and routes is None:
            raise ValueError("routing replay is on but the rollout returned no routed experts for some samples; "
                             "serve the rollout with --enable-return-routed-experts (or turn --routing-replay off)")
        self._mismatch = [0, 0]
        for idx, forward in self._micro_batches([(s.prompt_ids, s.response_ids) for s in samples], routes, replay):
            chunk = [samples[i] for i in idx]
            lp, entropy, mask = forward()
            rollout_lp = torch.zeros_like(lp)
            for b, s in enumerate(chunk):
                if len(s.rollout_logprobs) != len(s.response_ids):
                    raise ValueError(f"sample {idx[b]} has {len(s.rollout_logprobs)} rollout logprobs for "
                                     f"{len(s.response_ids)} response tokens; the rollout must return one per token")
                rollout_lp[b, :len(s.response_ids)] = torch.tensor(s.rollout_logprobs)
            old = lp.detach()  # one optimizer step per rollout: the behaviour policy is the current one
            advantages = torch.tensor([s.advantage for s in chunk])
            loss, m, correction = grpo_loss(lp, old, rollout_lp, advantages, mask, grpo, denominator=denominator)
            loss.backward()
            for key in ("pg_loss", "pg_clipfrac", "ppo_kl"):
                sums[key] += m[key]  # already divided by the step's denominator
            n = int(mask.sum())
            for key, value in correction.token_metrics.items():
                sums[key] += value * n / total
            for key, value in correction.sequence_metrics.items():
                sums[key] += value * len(chunk) / sequences
            sums["entropy"] += float(entropy.detach()[mask].sum()) / total
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
        if routes is not None:
            metrics["train/router_mismatch_frac"] = self._mismatch[0] / max(1, self._mismatch[1])
        return metrics

    def _batches(self, lengths: list[int], response_lengths: list[int]) -> list[list[int]]:
        """Micro-batches within the token budget, leaving out samples without response tokens."""
        keep = [i for i, r in enumerate(response_lengths) if r > 0]
        return [[keep[j] for j in batch]
                for batch in micro_batches([lengths[i] for i in keep], self.config.max_tokens_per_gpu)]

    # ------------------------------------------------------------------ state for checkpoints
    def state(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "step": self.step}

    def load_state(self, state: dict) -> None:
        self._stored = None
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])


def _prompt_routes_agree(batches: list[PrefixBatch], seqs: list[tuple[list[int], list[int]]],
                         routes: list[torch.Tensor]) -> bool:
    """Whether every group's samples carry the same rollout routes for their shared prompt (so replaying the first
    sample's in one prompt forward replays each sample's); an engine that prefilled a prompt once per group does."""
    for batch in batches:
        length = len(batch.prompts[0])
        for members in batch.members:
            first = routes[members[0]][:length]
            if any(not torch.equal(routes[i][:length], first) for i in members[1:]):
                return False
    return True


def _padded_routes(routes: list[torch.Tensor], length: int) -> torch.Tensor:
    """Per-sample routes [len - 1, layers, top_k] as one [B, length, layers, top_k] tensor; the positions no route
    covers (each sequence's last, right padding) get expert 0, whose outputs no logprob reads."""
    layers, top_k = routes[0].shape[1:]
    out = torch.zeros(len(routes), length, layers, top_k, dtype=torch.long)
    for b, r in enumerate(routes):
        out[b, :len(r)] = r.long()
    return out
