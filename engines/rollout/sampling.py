"""Batched sampling with our DeepSeek-V4: prefill once per prompt, n decode rows per prompt, decode.

Sampling follows SGLang's parameters (temperature, top_p, top_k, max_new_tokens, stop_token_ids,
ignore_eos, a per-request seed). The logprob reported for each sampled token is the RAW logprob,
log_softmax of the unprocessed logits (temperature 1, no top-p/top-k truncation): that is what a
trainer recomputes, so train/rollout differences measure the engines, not the sampler settings.

Every request draws from its own torch.Generator seeded from (seed, sample index), so a request's
tokens do not depend on what else is in the batch. `generate` (the bootstrap's evaluation) samples with
torch.multinomial; the rollout engine's `sample_rows` by inverse CDF from blocks of uniform draws (one native
call per step for every temperature-only row) - the same distribution, other draws.

    outs = generate(model, [prompt_ids], SamplingParams(temperature=1.0, max_new_tokens=16), n=8, seed=0)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engines.model import DecodeBatch, DeepseekV4, SequenceCache


@dataclass(kw_only=True)
class SamplingParams:
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus mass kept (1.0 keeps everything)."""
    top_k: int = -1
    """Keep only the k most likely tokens (-1: all)."""
    max_new_tokens: int = 128
    """Tokens generated at most; finish_reason 'length' when reached."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end a sample (finish_reason 'stop', token included)."""
    ignore_eos: bool = False
    """Keep generating past the EOS token."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")


@dataclass
class Completion:
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str  # "stop" | "length"


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Draw one token id from a [vocab] logit row under the sampling parameters."""
    if params.temperature == 0:
        return int(logits.argmax())
    scores = logits.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(scores, min(params.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        drop = sorted_probs.cumsum(0) - sorted_probs > params.top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[int]:
    """`sample_token` for every row of [B, vocab] logits, with the softmax batched over rows that only set a
    temperature; each row still draws from its own generator, so a row's token does not depend on the others."""
    tokens = [0] * len(params)
    plain = [i for i, p in enumerate(params) if p.temperature > 0 and p.top_k <= 0 and p.top_p >= 1.0]
    if plain:
        temperatures = torch.tensor([params[i].temperature for i in plain], dtype=torch.float32)
        probs = torch.softmax(logits[plain].float() / temperatures[:, None], dim=-1)
        for j, i in enumerate(plain):
            tokens[i] = int(torch.multinomial(probs[j], 1, generator=generators[i]))
    for i in sorted(set(range(len(params))) - set(plain)):
        tokens[i] = sample_token(logits[i], params[i], generators[i])
    return tokens


# ---------------------------------------------------------------------------------------------- the engine's sampler
class UniformStream:
    """A request's uniform draws in [0, 1) for inverse-CDF sampling, taken from its own torch.Generator BLOCK at a
    time (one op per BLOCK tokens instead of one multinomial per token); rows with top-k or top-p draw from the
    generator itself (`sample_token`)."""

    BLOCK = 64

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator
        self._block: list[float] = []
        self._next = 0

    def draw(self) -> float:
        if self._next == len(self._block):
            self._block = torch.rand(self.BLOCK, generator=self.generator, dtype=torch.float64).tolist()
            self._next = 0
        self._next += 1
        return self._block[self._next - 1]


def is_plain(params: SamplingParams) -> bool:
    """Temperature only (the inverse-CDF path): no top-k, no top-p."""
    return params.top_k <= 0 and params.top_p >= 1.0


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], streams: list[UniformStream],
                banned: dict[int, list[int]] | None = None) -> tuple[list[int], list[float]]:
    """The rollout engine's tokens for every row of [B, vocab] logits, and each token's RAW logprob (log_softmax of
    the unprocessed logits). Plain rows (`is_plain`) sample by inverse CDF with one draw of their stream: the first
    token whose cumulative weight exp((logit - max) / temperature) (float32, summed in float64 in index order)
    exceeds the draw times the total (temperature 0: the first maximum), in one native call for all of them (fused.c
    `v4rl_sample`; the same algorithm in torch ops where the kernels are off). Other rows go through `sample_token`
    with the stream's generator. `banned`: row -> token ids it may not sample (min_new_tokens), its RAW logprob
    still from the unmodified logits. A row's token never depends on the other rows."""
    from engines.model import fused

    banned = banned or {}
    logits = logits.float()
    tokens, logprobs = [0] * len(params), [0.0] * len(params)
    plain = [i for i, p in enumerate(params) if is_plain(p)]
    others = sorted(set(range(len(params))) - set(plain))
    if plain:
        rows = logits[plain].contiguous()
        for j, i in enumerate(plain):
            if i in banned:
                rows[j, banned[i]] = float("-inf")
        temperatures = torch.tensor([params[i].temperature for i in plain], dtype=torch.float32)
        uniforms = torch.tensor([streams[i].draw() if params[i].temperature > 0 else 0.0 for i in plain],
                                dtype=torch.float64)
        drawn, drawn_lp = (fused.sample if fused.library() is not None else _sample_torch)(rows, temperatures, uniforms)
        for j, i in enumerate(plain):
            tokens[i], logprobs[i] = drawn[j], drawn_lp[j]
    for i in others:
        row = logits[i].clone()
        if i in banned:
            row[banned[i]] = float("-inf")
        tokens[i] = sample_token(row, params[i], streams[i].generator)
    for i in sorted(set(banned) | set(others)):  # RAW logprobs from the unmodified logits
        logprobs[i] = float(torch.log_softmax(logits[i], dim=-1)[tokens[i]])
    return tokens, logprobs


def _sample_torch(rows: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor
                  ) -> tuple[list[int], list[float]]:
    """`v4rl_sample` in torch ops: the same float32 exponentials summed in float64 (in another order)."""
    top, best = rows.max(dim=-1, keepdim=True)
    shifted = rows - top
    raw = shifted.double() - shifted.exp().double().sum(-1, keepdim=True).log()
    scaled = shifted * (1 / temperatures.clamp_min(1e-30))[:, None]
    weights = torch.where((temperatures == 1)[:, None], shifted, scaled).exp().double().cumsum(-1)
    chosen = torch.searchsorted(weights, (uniforms * weights[:, -1])[:, None], right=True)[:, 0]
    chosen = torch.where(temperatures > 0, chosen.clamp_max(rows.shape[-1] - 1), best[:, 0])
    return chosen.tolist(), raw.gather(1, chosen[:, None])[:, 0].float().tolist()


@torch.inference_mode()
def generate(model: DeepseekV4, prompts: list[list[int]], params: SamplingParams, *, n: int = 1, seed: int = 0,
             eos_token_id: int | None = None) -> list[list[Completion]]:
    """n samples for each prompt; returns one list of Completions per prompt."""
    stops = set(params.stop_token_ids)
    if eos_token_id is not None and not params.ignore_eos:
        stops.add(eos_token_id)
    rows: list[tuple[int, int]] = []  # (prompt index, sample index)
    caches: list[SequenceCache] = []
    next_logits: list[torch.Tensor] = []
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token (e.g. BOS)")
        by_length.setdefault(len(p), []).append(i)
    for length, idxs in by_length.items():
        logits, pre = model.prefill(torch.tensor([prompts[i] for i in idxs]))
        for j, i in enumerate(idxs):
            for s in range(n):
                rows.append((i, s))
                caches.append(pre[j])  # DecodeBatch.from_caches copies, so the n rows evolve independently
                next_logits.append(logits[j, -1])
    generators = [torch.Generator().manual_seed(seed * 1_000_003 + i * 1009 + s) for i, s in rows]
    outputs = [[] for _ in rows]
    logprobs = [[] for _ in rows]
    finish = ["length"] * len(rows)
    active = list(range(len(rows))) if params.max_new_tokens > 0 else []
    current = torch.stack(next_logits) if next_logits else None
    batch = DecodeBatch.from_caches(model.cfg, caches) if active else None
    while active:
        raw = torch.log_softmax(current.float(), dim=-1)
        drawn = sample_tokens(current, [params] * len(active), [generators[r] for r in active])
        drawn_logprobs = raw.gather(1, torch.tensor(drawn)[:, None])[:, 0].tolist()
        tokens, still, rows_kept = [], [], []
        for pos, r in enumerate(active):
            tok = drawn[pos]
            outputs[r].append(tok)
            logprobs[r].append(drawn_logprobs[pos])
            if tok in stops:
                finish[r] = "stop"
            elif len(outputs[r]) < params.max_new_tokens:
                still.append(r)
                tokens.append(tok)
                rows_kept.append(pos)
        active = still
        if active:
            if len(rows_kept) < len(batch):
                batch.select(rows_kept)
            current = model.decode(torch.tensor(tokens), batch)
    result: list[list[Completion]] = [[None] * n for _ in prompts]  # type: ignore[list-item]
    for r, (i, s) in enumerate(rows):
        result[i][s] = Completion(list(prompts[i]), outputs[r], logprobs[r], finish[r])
    return result
