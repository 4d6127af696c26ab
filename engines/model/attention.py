"""DeepSeek-V4 attention: shared-KV MQA over a sliding window plus compressed long-range entries.

Every layer attends to its last `sliding_window` tokens (query included). Compressed layers add:
  HCA  one entry per non-overlapping window of `rate` tokens, all of them attended (when complete);
  CSA  overlapping windows (entry w pools window w-1's Ca series with window w's Cb series), of which
       the lightning indexer keeps the top `index_topk` per query.
Queries are low-rank (`wq_a -> q_norm -> wq_b`, per-head unweighted RMSNorm), K=V is one shared head,
RoPE is interleaved on the trailing channels (`main` theta on sliding-only layers, `compress` theta
elsewhere), each head has a learned sink logit, and the output goes through a grouped low-rank
projection after the conjugate RoPE removes V's rotation.

Two entry points share the pooling, scoring and attention maths: `forward_full` (whole sequences,
optionally returning per-sequence caches a decode can continue from) and `forward_decode` (one new
token for each row of a `DecodeBatch`, rows at any positions; see decode_batch.py for its layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engines.model.config import CSA, SLIDING, ModelConfig
from engines.model.layers import RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq, unweighted_rms_norm

if TYPE_CHECKING:
    from engines.model.decode_batch import CompressorSlots, LayerSlots


@dataclass
class CompressorState:
    """Per-sequence compressor state: tokens of the open window, emitted entries, CSA overlap (Ca + gate)."""

    buffer_kv: torch.Tensor
    buffer_gate: torch.Tensor
    entries: torch.Tensor
    rate: int
    overlapping: bool
    overlap_kv: torch.Tensor | None = None
    overlap_gate: torch.Tensor | None = None


@dataclass
class LayerCache:
    """Per-sequence cache of one layer: the last sliding_window-1 K=V rows plus compressor states."""

    window: torch.Tensor
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None


class Compressor(nn.Module):
    """Softmax-gated pooling of `rate` tokens into one KV entry (overlapping Ca/Cb series when `overlap`)."""

    def __init__(self, cfg: ModelConfig, rate: int, out_dim: int, overlap: bool) -> None:
        super().__init__()
        width = 2 * out_dim if overlap else out_dim
        self.wkv = nn.Linear(cfg.hidden_size, width, bias=False)
        self.wgate = nn.Linear(cfg.hidden_size, width, bias=False)
        self.norm = RMSNorm(out_dim, cfg.rms_norm_eps)
        self.ape = nn.Parameter(torch.zeros(rate, width))
        self.rate, self.out_dim, self.overlap = rate, out_dim, overlap
        self.register_buffer("inv_freq", rope_inv_freq(cfg, "compress"), persistent=False)

    def pool(self, kv: torch.Tensor, gate: torch.Tensor, first_position: int | torch.Tensor,
             prior: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Pool complete windows. kv/gate: [B, n*rate, width] raw projections; returns ([B, n, out_dim], new overlap).

        first_position: the first window's start, one int or one per row ([B]).
        """
        B, n = kv.shape[0], kv.shape[1] // self.rate
        m, d = self.rate, self.out_dim
        if n == 0:
            return kv.new_zeros(B, 0, d), prior
        kv = kv.view(B, n, m, -1)
        gate = gate.view(B, n, m, -1) + self.ape
        new_overlap = prior
        if self.overlap:
            slots_kv = kv.new_zeros(B, n, 2 * m, d)
            slots_gate = gate.new_full((B, n, 2 * m, d), float("-inf"))
            slots_kv[:, :, m:], slots_gate[:, :, m:] = kv[..., d:], gate[..., d:]
            slots_kv[:, 1:, :m], slots_gate[:, 1:, :m] = kv[:, :-1, :, :d], gate[:, :-1, :, :d]
            if prior is not None:
                slots_kv[:, 0, :m], slots_gate[:, 0, :m] = prior[0].to(kv.dtype), prior[1].to(gate.dtype)
            new_overlap = (kv[:, -1, :, :d].clone(), gate[:, -1, :, :d].clone())
            kv, gate = slots_kv, slots_gate
        pooled = self.norm((kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2))
        positions = torch.arange(n, device=kv.device) * m
        positions = positions + (first_position[:, None] if torch.is_tensor(first_position) else first_position)
        cos, sin = rope_cos_sin(self.inv_freq, positions, pooled.dtype)
        return apply_rope(pooled, cos, sin), new_overlap

    def full(self, x: torch.Tensor, keep_state: bool) -> tuple[torch.Tensor, list[CompressorState] | None]:
        """All entries of whole sequences [B, S, H] -> [B, T, out_dim] (+ per-sequence states to continue from)."""
        return self.full_projected(self.wkv(x), self.wgate(x), keep_state)

    def full_projected(self, kv: torch.Tensor, gate: torch.Tensor, keep_state: bool
                       ) -> tuple[torch.Tensor, list[CompressorState] | None]:
        """`full` from the raw projections kv/gate [B, S, width] (the open window's rows are copied into the states,
        so a state never keeps a whole prefill's projections alive)."""
        usable = (kv.shape[1] // self.rate) * self.rate
        entries, overlap = self.pool(kv[:, :usable], gate[:, :usable], 0, None)
        if not keep_state:
            return entries, None
        states = [CompressorState(kv[b, usable:].clone(), gate[b, usable:].clone(), entries[b], self.rate,
                                  self.overlap, None if overlap is None else overlap[0][b:b + 1],
                                  None if overlap is None else overlap[1][b:b + 1]) for b in range(kv.shape[0])]
        return entries, states

    def step(self, x: torch.Tensor, slots: "CompressorSlots", positions: torch.Tensor) -> None:
        """Feed one token per row (x [B, H] at positions [B]); rows whose window closes emit an entry."""
        kv, gate = self.wkv(x), self.wgate(x)
        rows, slot = torch.arange(x.shape[0], device=x.device), positions % self.rate
        slots.buffer_kv[rows, slot] = kv.to(slots.buffer_kv.dtype)
        slots.buffer_gate[rows, slot] = gate.to(slots.buffer_gate.dtype)
        closing = (slot == self.rate - 1).nonzero()[:, 0]
        if closing.numel() == 0:
            return
        index = positions[closing] // self.rate
        prior = (slots.overlap_kv[closing], slots.overlap_gate[closing]) if self.overlap else None
        entry, overlap = self.pool(slots.buffer_kv[closing], slots.buffer_gate[closing], index * self.rate, prior)
        slots.ensure_capacity(int(index.max()) + 1)
        slots.entries[closing, index] = entry[:, 0].to(slots.entries.dtype)
        if overlap is not None:
            slots.overlap_kv[closing], slots.overlap_gate[closing] = overlap


class Indexer(nn.Module):
    """Lightning indexer: score_t,s = Σ_h w_t,h · ReLU(q_t,h · k_s) / sqrt(d); keeps the top-k past entries."""

    def __init__(self, cfg: ModelConfig, rate: int) -> None:
        super().__init__()
        self.cfg, self.rate = cfg, rate
        self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, cfg.index_n_heads, bias=False)
        self.compressor = Compressor(cfg, rate, cfg.index_head_dim, overlap=True)

    def scores(self, x: torch.Tensor, q_residual: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
        """Index scores [B, S, T] for queries x/q_residual [B, S, .] against keys [B, T, d]."""
        cfg = self.cfg
        B, S = x.shape[:2]
        q = self.wq_b(q_residual).view(B, S, cfg.index_n_heads, cfg.index_head_dim)
        q = apply_rope(q.transpose(1, 2), cos.unsqueeze(1), sin.unsqueeze(1)).transpose(1, 2)
        s = torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1))  # [B, S, heads, T]
        s = F.relu(s) * cfg.index_head_dim ** -0.5
        w = self.weights_proj(x).float() * cfg.index_n_heads ** -0.5
        return (s * w.unsqueeze(-1)).sum(dim=2)

    def select(self, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Visible-and-selected mask [B, S, T]: top-k among entries whose window closed at or before the query."""
        T = scores.shape[-1]
        visible = torch.arange(T, device=scores.device) < ((positions + 1) // self.rate).unsqueeze(-1)
        if T == 0:
            return visible
        # Stable descending sort: among equal scores (frequent: ReLU zeroes whole rows) the earlier entry wins,
        # so a query picks the same entries whether it is scored in a full sequence or in a decode step.
        # (torch.topk breaks ties by row length, which differs between the two.)
        masked = scores.masked_fill(~visible, float("-inf"))
        top = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :min(self.cfg.index_topk, T)]
        chosen = torch.zeros_like(visible).scatter_(-1, top, True)
        return chosen & visible


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.kind = cfg.layer_types[layer]
        nh, hd = cfg.num_attention_heads, cfg.head_dim
        self.wq_a = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, nh * hd, bias=False)
        self.wkv = nn.Linear(cfg.hidden_size, hd, bias=False)
        self.kv_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.wo_a = nn.Linear(nh * hd // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(nh))
        self.compressor = self.indexer = None
        if self.kind != SLIDING:
            rate = cfg.compress_rate(layer)
            self.compressor = Compressor(cfg, rate, hd, overlap=self.kind == CSA)
        if self.kind == CSA:
            self.indexer = Indexer(cfg, cfg.compress_rate(layer))
        self.register_buffer("inv_freq", rope_inv_freq(cfg, "main" if self.kind == SLIDING else "compress"),
                             persistent=False)
        self.register_buffer("compress_inv_freq", rope_inv_freq(cfg, "compress"), persistent=False)

    # ------------------------------------------------------------------ shared pieces
    def _project(self, x: torch.Tensor, positions: torch.Tensor):
        """q [B, nh, S, hd], kv [B, S, hd] (normed, rotated), q_residual, and the (cos, sin) used."""
        cfg = self.cfg
        B, S = x.shape[:2]
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)  # [B, S, r/2]
        q_residual = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_residual).view(B, S, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
        q = apply_rope(unweighted_rms_norm(q, cfg.rms_norm_eps), cos.unsqueeze(1), sin.unsqueeze(1))
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)
        return q, kv, q_residual, (cos, sin)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Sink-softmax attention with K=V. q [B, nh, S, hd], keys [B, L, hd], allowed [B, S, L] -> [B, nh, S, hd]."""
        B, nh, S, hd = q.shape
        L = keys.shape[1]
        # One shared K=V head: fold heads into the query rows instead of broadcasting keys to every head.
        logits = torch.bmm(q.reshape(B, nh * S, hd), keys.transpose(1, 2)).view(B, nh, S, L) * hd ** -0.5
        logits = logits.masked_fill(~allowed.unsqueeze(1), float("-inf"))
        # The sink stays fp32, so in bf16 the concatenation promotes and the softmax runs in fp32 (as the reference).
        sinks = self.attn_sink.view(1, -1, 1, 1).expand(*logits.shape[:3], 1)
        combined = torch.cat([logits, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
        return torch.bmm(probs.to(keys.dtype).reshape(B, nh * S, L), keys).view(B, nh, S, hd)

    def _output(self, attn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Undo V's RoPE at the query position, then the grouped low-rank output projection."""
        cfg = self.cfg
        out = apply_rope(attn, cos.unsqueeze(1), -sin.unsqueeze(1)).transpose(1, 2)  # [B, S, nh, hd]
        B, S = out.shape[:2]
        grouped = out.reshape(B, S, cfg.o_groups, -1)
        w = self.wo_a.weight.view(cfg.o_groups, cfg.o_lora_rank, -1)
        mixed = torch.einsum("bsgi,goi->bsgo", grouped, w).flatten(2)
        return self.wo_b(mixed)

    # ------------------------------------------------------------------ whole sequences
    def forward_full(self, x: torch.Tensor, positions: torch.Tensor, keep_cache: bool = False):
        """x [B, S, H] at positions [B, S] (a fresh sequence from 0). Returns (out, per-sequence caches or None)."""
        cfg = self.cfg
        B, S = x.shape[:2]
        q, kv, q_residual, (cos, sin) = self._project(x, positions)
        i = torch.arange(S, device=x.device)
        allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < cfg.sliding_window)
        allowed = allowed.expand(B, S, S)
        keys = kv
        comp_states = idx_states = None
        if self.compressor is not None:
            entries, comp_states = self.compressor.full(x, keep_cache)
            T = entries.shape[1]
            if self.indexer is not None:
                idx_keys, idx_states = self.indexer.compressor.full(x, keep_cache)
                ccos, csin = rope_cos_sin(self.compress_inv_freq, positions, x.dtype)
                scores = self.indexer.scores(x, q_residual, idx_keys, ccos, csin)
                visible = self.indexer.select(scores, positions)
            else:
                visible = torch.arange(T, device=x.device) < ((positions + 1) // self.compressor.rate).unsqueeze(-1)
            keys = torch.cat([kv, entries], dim=1)
            allowed = torch.cat([allowed, visible], dim=-1)
        out = self._output(self._attend(q, keys, allowed), cos, sin)
        if not keep_cache:
            return out, None
        caches = [LayerCache(window=kv[b, max(0, S - cfg.sliding_window + 1):],
                             compressor=comp_states[b] if comp_states else None,
                             indexer=idx_states[b] if idx_states else None) for b in range(B)]
        return out, caches

    # ------------------------------------------------------------------ one token per row
    def forward_decode(self, x: torch.Tensor, positions: torch.Tensor, cache: "LayerSlots") -> torch.Tensor:
        """x [B, 1, H], positions [B, 1]; writes this token into the batch's caches (in place)."""
        cfg = self.cfg
        W = cfg.sliding_window
        q, kv, q_residual, (cos, sin) = self._project(x, positions)
        pos = positions[:, 0]
        rows = torch.arange(x.shape[0], device=x.device)
        cache.window[rows, pos % W] = kv[:, 0].to(cache.window.dtype)  # the ring's oldest row: see decode_batch.py
        # The window's keys in position order (pos-W+1 .. pos), so sums run in the order they always did; slots
        # before the sequence's start are masked by position.
        order = (pos[:, None] + torch.arange(1 - W, 1, device=x.device)) % W
        keys = cache.window[rows[:, None], order]  # [B, W, hd], this token last
        allowed = (torch.arange(W, device=x.device) >= (W - 1 - pos)[:, None]).unsqueeze(1)  # [B, 1, W]
        if self.compressor is not None:
            self.compressor.step(x[:, 0], cache.compressor, pos)
            entries = cache.compressor.entries
            T = entries.shape[1]
            if self.indexer is not None:
                self.indexer.compressor.step(x[:, 0], cache.indexer, pos)
                ccos, csin = rope_cos_sin(self.compress_inv_freq, positions, x.dtype)
                scores = self.indexer.scores(x, q_residual, cache.indexer.entries[:, :T], ccos, csin)
                visible = self.indexer.select(scores, positions)
            else:
                visible = (torch.arange(T, device=x.device) < ((pos + 1) // self.compressor.rate)[:, None]).unsqueeze(1)
            keys = torch.cat([keys, entries], dim=1)
            allowed = torch.cat([allowed, visible], dim=-1)
        return self._output(self._attend(q, keys, allowed), cos, sin)
