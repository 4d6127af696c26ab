"""Planted model bugs for tests only: the two train/rollout mismatches the seed found, switchable in our engine.

  hash_from_positions   hash-routed MoE layers look up `tid2eid` with the token's POSITION instead of its
                        token id (the seed's hash-routing mismatch).
  comb_untransposed     the mHC residual mix applies `comb @ streams` instead of `combᵀ @ streams` (the
                        seed's mHC post-mix mismatch; Sinkhorn's matrix is not symmetric, so it matters).

Off by default; the model consults `ACTIVE` at two call sites in engines/model/model.py and does nothing
else with it, so production code pays one attribute test per layer. Switch faults on only through the
context manager, which restores the previous state on exit (the flags are process-global, so the
rollout engine's scheduler thread sees them too):

    from engines.model.faults import planted
    with planted("comb_untransposed"):                      # every layer, as the seed's bug
        report = align(...)
    with planted("hash_from_positions", layers={1}):        # only layer 1 (to test localisation)
        ...
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

FAULTS: tuple[str, ...] = ("hash_from_positions", "comb_untransposed")


@dataclass
class Faults:
    """Which planted bugs are on, and in which layers (None: all layers)."""

    hash_from_positions: bool = False
    comb_untransposed: bool = False
    layers: frozenset[int] | None = None

    def on(self, fault: str, layer: int) -> bool:
        return getattr(self, fault) and (self.layers is None or layer in self.layers)


ACTIVE = Faults()
"""The process-wide switches. Read by the model; written only by `planted`."""


@contextlib.contextmanager
def planted(*faults: str, layers: Iterable[int] | None = None) -> Iterator[Faults]:
    """Turn the named faults on (optionally only in `layers`) for the duration of the block. Tests only."""
    unknown = [f for f in faults if f not in FAULTS]
    if unknown or not faults:
        raise ValueError(f"planted() needs fault names from {FAULTS}; got {list(faults)}")
    global ACTIVE
    saved = ACTIVE
    ACTIVE = Faults(**{f: True for f in faults}, layers=None if layers is None else frozenset(layers))
    try:
        yield ACTIVE
    finally:
        ACTIVE = saved


def routing_ids(token_ids: torch.Tensor, positions: torch.Tensor, layer: int, vocab_size: int) -> torch.Tensor:
    """The ids a layer's hash router looks up: the token ids, or (fault) the positions, wrapped into the table."""
    if not ACTIVE.on("hash_from_positions", layer):
        return token_ids
    return positions.expand_as(token_ids) % vocab_size


def merge_comb(comb: torch.Tensor, layer: int) -> torch.Tensor:
    """The comb matrix handed to `hc_merge` (which applies its transpose); the fault pre-transposes it."""
    if not ACTIVE.on("comb_untransposed", layer):
        return comb
    return comb.transpose(-1, -2)
