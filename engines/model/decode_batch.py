"""Batched decode state: every running sequence's caches stacked into one tensor per layer and field.

A prefill returns one `SequenceCache` per sequence (tensors of that sequence's own lengths, shared
with the prefix cache). A decode step wants the opposite: one [B, ...] tensor per cache field, so a
layer does one matmul for the whole batch whatever each sequence's position. `DecodeBatch` is that
layout; rows are sequences, and sequences at different positions share it:

  window      [B, W, hd]     a ring of the last K=V rows: position p lives in slot p % W; the next
                             token overwrites the oldest, so a step writes one row instead of
                             shifting W (slots a short sequence has not reached are masked by position)
  buffer_*    [B, rate, w]   the compressor's open window; the next token goes to slot position % rate
  entries     [B, cap, d]    emitted compressed entries, position // rate of them valid per row;
                             `cap` grows (doubling) as sequences get longer
  overlap_*   [B, rate, d]   CSA's Ca series of the last closed window (gate -inf before the first,
                             which is what pooling without a prior means)

`from_caches` copies, so decode writes into a batch in place without touching the prefix cache;
`select` keeps rows (finished or aborted sequences leave), `extend` appends newly prefilled ones.

    logits, caches = model.prefill(prompt_ids)
    batch = DecodeBatch.from_caches(model.cfg, caches)
    logits = model.decode(next_ids, batch)          # advances every row by one position
    batch.select([0, 2])                            # row 1 finished
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engines.model.attention import CompressorState
from engines.model.config import ModelConfig


@dataclass
class CompressorSlots:
    """One compressed layer's compressor (or indexer-compressor) state for all rows."""

    buffer_kv: torch.Tensor
    buffer_gate: torch.Tensor
    entries: torch.Tensor
    overlap_kv: torch.Tensor | None = None
    overlap_gate: torch.Tensor | None = None

    def ensure_capacity(self, needed: int) -> None:
        """Make room for entry index `needed - 1` (doubling, so growth is amortised over a generation)."""
        cap = self.entries.shape[1]
        if needed > cap:
            self.pad_entries(max(needed, 2 * cap))

    def pad_entries(self, cap: int) -> None:
        self.entries = F.pad(self.entries, (0, 0, 0, cap - self.entries.shape[1]))

    def _fields(self) -> dict[str, torch.Tensor | None]:
        return dict(vars(self))


@dataclass
class LayerSlots:
    window: torch.Tensor
    compressor: CompressorSlots | None = None
    indexer: CompressorSlots | None = None


class DecodeBatch:
    """The decode-time caches of B sequences; row i belongs to the i-th sequence given to from_caches."""

    def __init__(self, positions: torch.Tensor, layers: list[LayerSlots]) -> None:
        self.positions = positions
        """[B] int64: the position the next decoded token of each row takes."""
        self.layers = layers

    def __len__(self) -> int:
        return int(self.positions.shape[0])

    @classmethod
    def from_caches(cls, cfg: ModelConfig, caches: Sequence) -> "DecodeBatch":
        """Stack per-sequence caches (from `DeepseekV4.prefill`, any positions) into a new batch (copies)."""
        if not caches:
            raise ValueError("DecodeBatch.from_caches needs at least one SequenceCache")
        positions = torch.tensor([c.position for c in caches], dtype=torch.long)
        layers = []
        for i in range(len(caches[0].layers)):
            per_seq = [c.layers[i] for c in caches]
            window = torch.stack([_ring(lc.window, c.position, cfg.sliding_window) for c, lc in zip(caches, per_seq)])
            comp = idx = None
            if per_seq[0].compressor is not None:
                cap = max(lc.compressor.entries.shape[0] for lc in per_seq) + 1
                comp = _stack_states([lc.compressor for lc in per_seq], cap)
                if per_seq[0].indexer is not None:
                    idx = _stack_states([lc.indexer for lc in per_seq], cap)
            layers.append(LayerSlots(window, comp, idx))
        return cls(positions, layers)

    def clone(self) -> "DecodeBatch":
        """An independent copy (every tensor cloned)."""
        copy = DecodeBatch(self.positions.clone(), [])
        for layer in self.layers:
            slots = [None if s is None else CompressorSlots(**{n: None if t is None else t.clone()
                                                               for n, t in s._fields().items()})
                     for s in (layer.compressor, layer.indexer)]
            copy.layers.append(LayerSlots(layer.window.clone(), *slots))
        return copy

    def named_tensors(self, other: "DecodeBatch"):
        """(name, ours, other's) for every cache tensor of two batches with the same layout."""
        yield "positions", self.positions, other.positions
        for i, (a, b) in enumerate(zip(self.layers, other.layers)):
            yield f"layers.{i}.window", a.window, b.window
            for part in ("compressor", "indexer"):
                mine, theirs = getattr(a, part), getattr(b, part)
                if mine is not None:
                    for name, t in mine._fields().items():
                        if t is not None:
                            yield f"layers.{i}.{part}.{name}", t, getattr(theirs, name)

    def select(self, rows: Sequence[int] | torch.Tensor) -> None:
        """Keep only these rows, in this order."""
        index = torch.as_tensor(rows, dtype=torch.long)
        self.positions = self.positions[index]
        for layer in self.layers:
            layer.window = layer.window[index]
            for slots in (layer.compressor, layer.indexer):
                if slots is not None:
                    for name, t in slots._fields().items():
                        if t is not None:
                            setattr(slots, name, t[index])

    def extend(self, other: "DecodeBatch") -> None:
        """Append other's rows after ours (copies; entry buffers are padded to the larger capacity first)."""
        self.positions = torch.cat([self.positions, other.positions])
        for mine, theirs in zip(self.layers, other.layers):
            mine.window = torch.cat([mine.window, theirs.window])
            for a, b in ((mine.compressor, theirs.compressor), (mine.indexer, theirs.indexer)):
                if a is None:
                    continue
                cap = max(a.entries.shape[1], b.entries.shape[1])
                a.pad_entries(cap)
                b.pad_entries(cap)
                for name, t in a._fields().items():
                    if t is not None:
                        setattr(a, name, torch.cat([t, getattr(b, name)]))


def _ring(rows: torch.Tensor, end: int, slots: int) -> torch.Tensor:
    """The window ring of a sequence whose last len(rows) K=V rows end before position `end`."""
    ring = rows.new_zeros(slots, rows.shape[-1])
    ring[torch.arange(end - rows.shape[0], end) % slots] = rows
    return ring


def _right_pad(rows: torch.Tensor, length: int) -> torch.Tensor:
    return F.pad(rows, (0, 0, 0, length - rows.shape[0]))


def _stack_states(states: list[CompressorState], cap: int) -> CompressorSlots:
    first = states[0]
    slots = CompressorSlots(
        buffer_kv=torch.stack([_right_pad(s.buffer_kv, first.rate) for s in states]),
        buffer_gate=torch.stack([_right_pad(s.buffer_gate, first.rate) for s in states]),
        entries=torch.stack([_right_pad(s.entries, cap) for s in states]))
    if first.overlapping:
        shape = (1, first.rate, first.entries.shape[-1])
        none_kv, none_gate = first.entries.new_zeros(shape), first.buffer_gate.new_full(shape, float("-inf"))
        slots.overlap_kv = torch.cat([none_kv if s.overlap_kv is None else s.overlap_kv for s in states])
        slots.overlap_gate = torch.cat([none_gate if s.overlap_gate is None else s.overlap_gate for s in states])
    return slots
