"""Rollout routing replay (R3) in the embedded trainer, and the router mismatch it removes.

`RouterReplay(model)` wraps every learned top-k router of transformers' DeepseekV4 (`DeepseekV4TopKRouter`; the
hash routers, `DeepseekV4HashRouter`, pick experts by their fixed tid2eid table on both sides and are left alone,
as Miles leaves them). Inside `replay.forward(routes)`, each wrapped router:
  - computes its own top-k of score + bias, as the stock router (kept for the mismatch metric);
  - with `routes` (int [B, S, layers, top_k], the rollout engine's `routed_experts` of the same tokens), uses the
    rollout's experts instead and gathers their gate weights from its own scores, normalised and scaled as the
    stock router does, so the gradient still reaches the router weights (Miles' replay does the same).
`replay.mismatch(replay.own_routes(), routes, valid)` counts the (token, top-k layer) pairs whose trainer-side expert
set differs from the rollout's: `train/router_mismatch_frac`. The trainer reads it from the forward it runs anyway
(with a shared prompt prefix too), so the metric costs a compare, not a forward.

    replay = RouterReplay(model)
    with replay.forward(routes):
        logits = model(input_ids=ids).logits
    mismatched, pairs = replay.mismatch(replay.own_routes(), routes, valid)
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
import torch.nn.functional as F


class RouterReplay:
    """The replaying wrapper of a DeepseekV4ForCausalLM's top-k routers (see module docstring)."""

    def __init__(self, model) -> None:
        self.layers: list[int] = []
        """Indices of the decoder layers whose router is a learned top-k (the replayed ones)."""
        self._routes: torch.Tensor | None = None
        self._own: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(model.model.layers):
            gate = layer.mlp.gate
            if type(gate).__name__ == "DeepseekV4TopKRouter":
                gate.forward = functools.partial(self._route, gate, i)
                self.layers.append(i)

    @contextmanager
    def forward(self, routes: torch.Tensor | None):
        """One model forward: with `routes` [B, S, layers, top_k] replayed, without them the stock routing; the
        trainer's own top-k of each layer is kept either way for `mismatch`."""
        self._routes, self._own = routes, {}
        try:
            yield
        finally:
            self._routes = None

    def _route(self, gate, layer: int, hidden_states: torch.Tensor):
        flat = hidden_states.reshape(-1, gate.hidden_dim)
        logits = F.linear(flat, gate.weight)
        scores = gate.score_fn(logits)
        own = torch.topk(scores + gate.e_score_correction_bias, gate.top_k, dim=-1, sorted=False).indices
        self._own[layer] = own.detach().view(*hidden_states.shape[:-1], gate.top_k)
        indices = own if self._routes is None else self._routes[:, :, layer].reshape(-1, gate.top_k).long()
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, weights * gate.routed_scaling_factor, indices

    def own_routes(self) -> torch.Tensor:
        """The trainer's own top-k experts of the last forward, int64 [B, S, top-k layers, top_k] in the order of
        `self.layers` (what the stock router picked, whether or not routes were replayed)."""
        return torch.stack([self._own[layer] for layer in self.layers], dim=2)

    def mismatch(self, own: torch.Tensor, routes: torch.Tensor, valid: torch.Tensor) -> tuple[int, int]:
        """(pairs whose expert sets differ, pairs compared): `own` from `own_routes` against the rollout's
        `routes` [B, S, layers, top_k] (every decoder layer), at the positions where `valid` [B, S] is true."""
        theirs = routes[:, :, self.layers].long().sort(-1).values
        differ = (own.sort(-1).values != theirs).any(-1) & valid[..., None]
        return int(differ.sum()), int(valid.sum()) * len(self.layers)
