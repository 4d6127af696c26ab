"""The rollout engine's prefill: each distinct sequence prefilled once (same lengths batched), remembered in an
LRU prefix cache (the n samples of a GRPO group, a retracted request's resume) and served from it.

Only what a request asks for is computed: the vocabulary projection of every prompt position (prompt logprobs
and their top-k) runs only for sequences whose requests want them; otherwise the last position's logits, all
a sampler needs, are the only ones projected. An entry prefilled without them does not serve a later request
that wants them (it is prefilled again). Every entry keeps the experts its tokens were routed to (a few int32 per
token and layer), so a request served from the cache returns the routing its KV was computed with.

    cache = PrefixCache(model, capacity=512)
    fresh, tokens = cache.prefill({key: top_k}, scored={key})     # key: a tuple of token ids
    entry = cache.hit(key, needs_logprobs=False)
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from engines.model import SequenceCache

PREFILL_CHUNK = 64
"""Sequences per prefill forward (bounds the [B, S, vocab] logits tensor)."""

Key = tuple[int, ...]


@dataclass
class PrefixEntry:
    cache: SequenceCache
    last_logits: torch.Tensor
    token_logprobs: list[float] | None
    """logprob of token i given tokens < i, for i = 1 .. len-1; None when no request asked for prompt logprobs."""
    routes: torch.Tensor
    """int32 [len, layers, top_k]: the experts token i was routed to in each layer, as the prefill computed them."""


class PrefixCache:
    """Prefilled sequences by their token ids, least recently used dropped beyond `capacity` (0: none kept)."""

    def __init__(self, model, capacity: int) -> None:
        self.model, self.capacity = model, capacity
        self._entries: OrderedDict[Key, PrefixEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()

    def hit(self, key: Key, *, needs_logprobs: bool) -> PrefixEntry | None:
        """The cached entry for these tokens if it serves the request (marked recently used), else None."""
        entry = self._entries.get(key)
        if entry is None or (needs_logprobs and entry.token_logprobs is None):
            return None
        self._entries.move_to_end(key)
        return entry

    def prefill(self, tops: dict[Key, int], scored: set[Key]) -> tuple[dict[Key, tuple[PrefixEntry, Any]], int]:
        """Prefill every sequence of `tops` (sequence -> top-k of prompt logprobs wanted); `scored`: those whose
        prompt logprobs a request wants. Returns ({sequence: (entry, top-k rows or None)}, tokens prefilled)."""
        out: dict[Key, tuple[PrefixEntry, Any]] = {}
        groups: dict[tuple[int, bool], list[Key]] = {}
        for key in tops:
            groups.setdefault((len(key), key in scored), []).append(key)
        tokens = 0
        for (_, all_logits), group in groups.items():
            for i in range(0, len(group), PREFILL_CHUNK):
                chunk = group[i:i + PREFILL_CHUNK]
                ids = torch.tensor(chunk, dtype=torch.long)
                routes: list[torch.Tensor] = []
                logits, caches = self.model.prefill(ids, all_logits=all_logits, routes=routes)
                per_token = stack_routes(routes, len(chunk))
                logp = torch.log_softmax(logits.float(), dim=-1) if all_logits else None
                token_lp = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0].tolist() if all_logits else None
                for j, key in enumerate(chunk):
                    k = tops.get(key, 0)
                    top = topk_rows(logp[j, :-1], k) if k else None
                    entry = PrefixEntry(caches[j], logits[j, -1].clone(), token_lp[j] if all_logits else None,
                                        per_token[j].clone())
                    out[key] = (entry, top)
                    self._remember(key, entry)
                tokens += ids.numel()
        return out, tokens

    def _remember(self, key: Key, entry: PrefixEntry) -> None:
        if self.capacity <= 0:
            return
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)


def stack_routes(routes: list[torch.Tensor], rows: int) -> torch.Tensor:
    """The model's per-layer routes (int64 [rows * S, top_k] each) as int32 [rows, S, layers, top_k]."""
    per_layer = torch.stack(routes, dim=1).to(torch.int32)
    return per_layer.view(rows, -1, *per_layer.shape[1:])


def topk_rows(logp: torch.Tensor, k: int) -> list[list[tuple[float, int]]]:
    """Per row of a [N, vocab] logprob tensor: the k best (logprob, token id) pairs."""
    values, ids = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
    return [list(zip(v, i)) for v, i in zip(values.tolist(), ids.tolist())]
