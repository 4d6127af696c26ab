"""Our DeepSeek-V4 through the fused native kernels (fused.py): whole sequences and the decode step, checked
against the torch ops before first use.

Per layer, for every row (a decode step's one token per sequence, or every position of a prefill): mHC
weights + the block's input norm (one call), one matmul for every projection of the normed input (wq_a, wkv,
both compressors' wkv/wgate, the indexer's weights_proj, concatenated), the query norm, one matmul for wq_b
and the indexer's wq_b, per-head norm + RoPE, the K=V row (into the window ring when decoding), the
compressors (a decode step's window step in C; a prefill's pooling stays the torch ops of
attention.Compressor, a handful per layer), the indexer's top-k, sink attention over the window and the
chosen entries with V's RoPE undone, the grouped wo_a, wo_b; then mHC merge, mHC weights + norm, routing +
routed + shared experts (one call), mHC merge. About 20 calls per layer where the torch ops dispatch 300-1800
(decode) and attend to every earlier position (prefill) instead of the window.

Every weight a kernel multiplies by is a runtime copy packed for fused.c's GEMM (panels of 32 output columns;
the projections of one input concatenated), rebuilt whenever a source parameter changes (pointer or in-place
version: a weight update, a test editing a weight). That is a second copy of the model's weights in memory.

Numerics: float32 with the torch ops' formulas, sums in another order. Before first use for a model config,
fused_check.py judges the kernels on a synthetic model of that config (never the live weights): the fused
result may be no further from a float64 run of the torch ops than the float32 torch ops are, times
ERROR_FACTOR. The verdict is kept per config (`fused.status()["checked"]`), so the check runs once per config
in a process and trained weights cannot switch a run to the torch ops; a failure falls back to them with one
warning. It is also kept beside the library (fused.saved_check), so a later process with the same library,
config, torch and engines/model code reads it instead of checking again (`V4RL_FUSED_CHECK_CACHE=0`: check anyway).

    fast = FusedModel(model)
    if fast.usable():
        logits = fast.decode(token_ids, batch)         # model.decode_torch(token_ids, batch), to rounding
        logits, caches = fast.full(prompt_ids, keep_cache=True, all_logits=False)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
from dataclasses import dataclass

import torch

from engines.model import fused, fused_check
from engines.model.attention import LayerCache
from engines.model.config import CSA, HCA, SLIDING
from engines.model.decode_batch import DecodeBatch, LayerSlots
from engines.model.layers import rope_cos_sin, rope_inv_freq

log = logging.getLogger("v4rl.kernels")
MIN_WORK_PER_THREAD = 1 << 20
"""Multiply-adds below which a kernel runs on the calling thread only (starting a thread costs ~20 µs)."""


@dataclass
class _Linear:
    """A weight [N, K] packed for fused.c's GEMM (fused.pack), with its output width."""

    packed: torch.Tensor
    n_out: int

    @classmethod
    def of(cls, w: torch.Tensor, groups: int = 1) -> "_Linear":
        return cls(fused.pack(w, groups), w.shape[0] // groups)

    def __call__(self, x: torch.Tensor, threads: int) -> torch.Tensor:
        K = self.packed.shape[2] * self.packed.shape[0]
        return fused.linear(x, self.packed, self.n_out, _threads(threads, x.shape[0] * self.n_out * K))


@dataclass
class _LayerPlan:
    hc_attn: torch.Tensor
    """hc_attn_fn packed (and hc_ffn below): the mHC projections."""
    hc_ffn: torch.Tensor
    proj: _Linear
    """Every projection of the normed block input (wq_a, wkv, compressors' wkv/wgate, weights_proj), one matmul."""
    parts: dict[str, tuple[int, int]]
    """Column range of each projection in proj's output."""
    q_b: _Linear
    """wq_b and the indexer's wq_b (both read the normed q_residual)."""
    wo_a: _Linear
    """The grouped output projection (o_groups blocks)."""
    wo_b: _Linear
    moe: "MoEPlan"


@dataclass
class MoEPlan:
    gate: torch.Tensor
    bias: torch.Tensor | None
    tid2eid: torch.Tensor | None
    k: int
    n_experts: int
    inter: int
    scaling: float
    limit: float
    w13: torch.Tensor
    """[experts, panels, hidden, PANEL]: each expert's w1 and w3 stacked, packed."""
    w2: torch.Tensor
    s13: torch.Tensor
    """The shared expert's, as w13 and w2 for one expert."""
    s2: torch.Tensor


class FusedModel:
    """The fused forward and decode step of one DeepseekV4 (see module docstring)."""

    def __init__(self, model) -> None:
        self.model, self.cfg = model, model.cfg
        self._sources = [p for p in model.parameters()] + [b for n, b in model.named_buffers() if n.endswith("tid2eid")]
        self._stamp: tuple | None = None
        self._plans: list[_LayerPlan] = []
        self._head: tuple[torch.Tensor, _Linear] | None = None
        self._checked: bool | None = None
        self._inv_freq = {kind: rope_inv_freq(self.cfg, kind) for kind in ("main", "compress")}

    # ------------------------------------------------------------------ when
    def usable(self) -> bool:
        """Fused kernels enabled, built, float32 contiguous weights, check passed."""
        if not fused.enabled() or self.model.dtype != torch.float32:
            return False
        if self._checked is None:
            self._checked = fused.library() is not None and self._layout_ok() and self._check()
        return self._checked

    def _layout_ok(self) -> bool:
        return all(t.device.type == "cpu" and t.is_contiguous() and t.dtype in (torch.float32, torch.int64)
                   for t in self._sources)

    # ------------------------------------------------------------------ runtime weights
    def _current_plans(self) -> list[_LayerPlan]:
        # Inference tensors (a model built under inference_mode) keep no version counter: their pointers only.
        stamp = tuple((t.data_ptr(), -1 if t.is_inference() else t._version) for t in self._sources)
        if stamp != self._stamp:
            m = self.model
            with torch.inference_mode(False), torch.no_grad():
                self._plans = [_layer_plan(layer, self.cfg) for layer in m.layers]
                self._head = (fused.pack(m.hc_head_fn), _Linear.of(m.head.weight))
            self._stamp = stamp
        return self._plans

    def drop_packed_weights(self) -> None:
        """Free the packed copies of the weights (a memory release); the next forward packs them again."""
        self._plans, self._head, self._stamp = [], None, None

    # ------------------------------------------------------------------ forward
    def decode(self, token_ids: torch.Tensor, batch: DecodeBatch, streams: torch.Tensor | None = None,
               routes: list[torch.Tensor] | None = None) -> torch.Tensor:
        """One new token per row: token_ids [B] -> logits [B, vocab]; advances every row (as decode_torch)."""
        ids = token_ids.reshape(-1).to(torch.int64).contiguous()
        pos = batch.positions.contiguous()
        streams = self.model._streams(ids) if streams is None else streams.reshape(len(ids), *streams.shape[-2:])
        caches = batch.layers
        h = self._layers(streams.contiguous(), ids, pos, lambda i, attn, plan, x, rope, threads: self._attend_decode(
            attn, plan, x, pos, caches[i], rope, int(pos.max()), threads), routes)
        batch.positions = batch.positions + 1
        return self._logits(h)

    def full(self, token_ids: torch.Tensor, keep_cache: bool, all_logits: bool = True,
             streams: torch.Tensor | None = None, routes: list[torch.Tensor] | None = None):
        """Whole sequences from position 0: (logits [B, S or 1, vocab], per-sequence caches or None), as full_torch."""
        from engines.model.model import SequenceCache

        B, S = token_ids.shape
        ids = token_ids.reshape(-1).to(torch.int64).contiguous()
        pos = torch.arange(S, dtype=torch.int64).repeat(B)
        streams = self.model._streams(ids) if streams is None else streams.reshape(B * S, *streams.shape[-2:])
        caches = [SequenceCache(position=S) for _ in range(B)] if keep_cache else None

        def attention(i, attn, plan, x, rope, threads):
            out, layer_caches = self._attend_full(attn, plan, x, pos, B, S, rope, keep_cache, threads)
            for c, lc in zip(caches or (), layer_caches or ()):
                c.layers.append(lc)
            return out

        h = self._layers(streams.contiguous(), ids, pos, attention, routes)
        if not all_logits:
            h = h.view(B, S, *h.shape[1:])[:, -1].contiguous()
        return self._logits(h).view(B, S if all_logits else 1, -1), caches

    def _layers(self, streams: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, attention,
                routes: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Every decoder layer over rows of streams [rows, hc, D]; attention(i, attn, plan, x, rope, threads);
        `routes` gets each layer's experts as the MoE kernel chose them (int64 [rows, top_k])."""
        m, cfg = self.model, self.cfg
        plans = self._current_plans()
        rope = {kind: rope_cos_sin(freq, pos, torch.float32) for kind, freq in self._inv_freq.items()}
        threads = torch.get_num_threads()
        moe_work = len(ids) * (cfg.num_experts_per_tok + 1) * 3 * cfg.hidden_size * cfg.moe_intermediate_size
        rows, hc, D = streams.shape
        mhc = _threads(threads, rows * hc * D * (2 + hc) * hc)
        for i, (layer, plan) in enumerate(zip(m.layers, plans)):
            post, comb, x = fused.hc_pre(streams, plan.hc_attn, layer.hc_attn_base, layer.hc_attn_scale, cfg,
                                         layer.attn_norm.weight, layer.attn_norm.eps, mhc)
            streams = fused.hc_post(streams, attention(i, layer.attn, plan, x, rope, threads), post, comb, mhc)
            post, comb, x = fused.hc_pre(streams, plan.hc_ffn, layer.hc_ffn_base, layer.hc_ffn_scale, cfg,
                                         layer.ffn_norm.weight, layer.ffn_norm.eps, mhc)
            chosen = None if routes is None else torch.empty(len(ids), cfg.num_experts_per_tok, dtype=torch.int64)
            moe_out = fused.moe(x, ids, plan.moe, _threads(threads, moe_work), chosen)
            if routes is not None:
                routes.append(chosen)
            streams = fused.hc_post(streams, moe_out, post, comb, mhc)
        return streams

    def _logits(self, streams: torch.Tensor) -> torch.Tensor:
        m = self.model
        hc_head, head = self._head
        threads = torch.get_num_threads()
        rows, hc, D = streams.shape
        h = fused.hc_pre(streams, hc_head, m.hc_head_base, m.hc_head_scale, self.cfg, m.norm.weight, m.norm.eps,
                         _threads(threads, rows * hc * D * hc), head=True)[2]
        return head(h, threads)

    def _queries(self, attn, plan: _LayerPlan, x: torch.Tensor, rope: dict, threads: int):
        """(projections by name, attention queries [rows, nh, hd], indexer queries or None, this layer's cos/sin)."""
        cfg = self.cfg
        nh, hd = cfg.num_attention_heads, cfg.head_dim
        p = plan.proj(x, threads)
        part = {name: p[:, a:b] for name, (a, b) in plan.parts.items()}
        qq = plan.q_b(fused.rms_norm(part["wq_a"], attn.q_norm.weight, attn.q_norm.eps), threads)
        cos, sin = rope["main" if attn.kind == SLIDING else "compress"]
        q = fused.heads_norm_rope(qq[:, :nh * hd], nh, hd, cfg.rms_norm_eps, cos, sin)
        iq = None
        if attn.indexer is not None:
            ccos, csin = rope["compress"]
            iq = fused.heads_norm_rope(qq[:, nh * hd:], cfg.index_n_heads, cfg.index_head_dim, 0.0, ccos, csin,
                                       norm=False)
        return part, q, iq, (cos, sin)

    @staticmethod
    def _output(plan: _LayerPlan, o: torch.Tensor, threads: int) -> torch.Tensor:
        rows, nh, hd = o.shape
        return plan.wo_b(plan.wo_a(o.view(rows, nh * hd), threads), threads)

    def _attend_decode(self, attn, plan: _LayerPlan, x: torch.Tensor, pos: torch.Tensor, cache: LayerSlots,
                       rope: dict, max_pos: int, threads: int) -> torch.Tensor:
        cfg = self.cfg
        part, q, iq, (cos, sin) = self._queries(attn, plan, x, rope, threads)
        fused.kv_store(part["wkv"], attn.kv_norm.weight, attn.kv_norm.eps, cos, sin, pos, cache.window)
        entries = sel = None
        rate = 0
        if attn.compressor is not None:
            rate = attn.compressor.rate
            for slots in (cache.compressor, cache.indexer):
                if slots is not None:
                    slots.ensure_capacity((max_pos + 1) // rate)
            fused.compress_step(part["compressor.wkv"], part["compressor.wgate"], pos, cache.compressor,
                                attn.compressor)
            entries = cache.compressor.entries
            if attn.indexer is not None:
                fused.compress_step(part["indexer.wkv"], part["indexer.wgate"], pos, cache.indexer,
                                    attn.indexer.compressor)
                keys = cache.indexer.entries
                sel = fused.indexer_select(iq, part["indexer.weights_proj"], keys, rate, pos, cfg.index_topk,
                                           _threads(threads, iq.numel() * keys.shape[1]))
        keys = cfg.sliding_window + _entry_keys(entries, sel)
        o = fused.attend(q, cache.window, pos, entries, rate, sel, attn.attn_sink, cos, sin,
                         _threads(threads, len(pos) * cfg.num_attention_heads * keys * cfg.head_dim * 2))
        return self._output(plan, o, threads)

    def _attend_full(self, attn, plan: _LayerPlan, x: torch.Tensor, pos: torch.Tensor, B: int, S: int,
                     rope: dict, keep_cache: bool, threads: int):
        cfg = self.cfg
        part, q, iq, (cos, sin) = self._queries(attn, plan, x, rope, threads)
        kv = x.new_empty(B * S, 1, cfg.head_dim)  # a one-slot "ring" per row: each row's K=V stored in place
        fused.kv_store(part["wkv"], attn.kv_norm.weight, attn.kv_norm.eps, cos, sin, pos, kv)
        entries = sel = comp_states = idx_states = None
        rate = 0
        if attn.compressor is not None:
            rate = attn.compressor.rate
            entries, comp_states = attn.compressor.full_projected(part["compressor.wkv"].view(B, S, -1),
                                                                  part["compressor.wgate"].view(B, S, -1), keep_cache)
            entries = entries.contiguous()
            if attn.indexer is not None:
                keys, idx_states = attn.indexer.compressor.full_projected(
                    part["indexer.wkv"].view(B, S, -1), part["indexer.wgate"].view(B, S, -1), keep_cache)
                sel = fused.indexer_select(iq, part["indexer.weights_proj"], keys.contiguous(), rate, pos,
                                           cfg.index_topk, _threads(threads, iq.numel() * keys.shape[1]))
        n_keys = cfg.sliding_window + _entry_keys(entries, sel)
        o = fused.attend(q, kv.view(B * S, -1), pos, entries, rate, sel, attn.attn_sink, cos, sin,
                         _threads(threads, B * S * cfg.num_attention_heads * n_keys * cfg.head_dim * 2),
                         sliding_window=cfg.sliding_window, seq_len=S)
        out = self._output(plan, o, threads)
        if not keep_cache:
            return out, None
        kv = kv.view(B, S, -1)
        return out, [LayerCache(window=kv[b, max(0, S - cfg.sliding_window + 1):],
                                compressor=comp_states[b] if comp_states else None,
                                indexer=idx_states[b] if idx_states else None) for b in range(B)]

    # ------------------------------------------------------------------ the check
    def _check(self) -> bool:
        """The verdict of fused_check on this model's config: run once per config in a process (under a lock, so
        concurrent first uses wait for one check), then read from fused.status(); kept on disk beside the library
        for later processes with the same library, config and code (fused.saved_check)."""
        signature = shape_signature(self.cfg)
        with _CHECK_LOCK:
            verdict = fused.checked(signature)
            if verdict is None:
                verdict = fused.saved_check(signature)
            if verdict is None:
                result = fused_check.check_config(self.cfg)
                fused.record_check(signature, result.passed, result.details())
                fused.save_check(signature, result.passed, result.details())
                if result.passed:
                    log.info("fused kernels checked for %s in %.1f s (worst %.2fx the torch ops' float32 error, "
                             "on %s; %s)", signature, result.seconds, result.worst_ratio, result.worst_output,
                             result.rows_judged)
                else:
                    log.warning("fused kernels differ from the torch ops for %s (%s): using the torch ops (same "
                                "results within float32 rounding, slower). Report this with your compiler and CPU",
                                signature, result.problem)
                verdict = result.passed
        return verdict


_CHECK_LOCK = threading.Lock()


def shape_signature(cfg) -> str:
    """The key a fused check's verdict is kept under (`fused.status()["checked"]`): the shape in words, plus a
    digest of the whole config (the synthetic model and the kernels read every field of it)."""
    kinds = {SLIDING: "sliding", CSA: "csa", HCA: "hca"}
    digest = hashlib.sha256(json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str).encode()).hexdigest()
    return (f"hidden {cfg.hidden_size}, layers {'-'.join(kinds[t] for t in cfg.layer_types)}, heads "
            f"{cfg.num_attention_heads}x{cfg.head_dim}, experts {cfg.n_routed_experts} top-{cfg.num_experts_per_tok}, "
            f"index top-{cfg.index_topk} (config {digest[:8]})")


def _threads(available: int, work: int) -> int:
    return max(1, min(available, work // MIN_WORK_PER_THREAD))


def _entry_keys(entries: torch.Tensor | None, sel: torch.Tensor | None) -> int:
    if entries is None:
        return 0
    return sel.shape[1] if sel is not None else entries.shape[1]


def _layer_plan(layer, cfg) -> _LayerPlan:
    attn = layer.attn
    blocks = [("wq_a", attn.wq_a.weight), ("wkv", attn.wkv.weight)]
    if attn.compressor is not None:
        blocks += [("compressor.wkv", attn.compressor.wkv.weight), ("compressor.wgate", attn.compressor.wgate.weight)]
    if attn.indexer is not None:
        ic = attn.indexer.compressor
        blocks += [("indexer.wkv", ic.wkv.weight), ("indexer.wgate", ic.wgate.weight),
                   ("indexer.weights_proj", attn.indexer.weights_proj.weight)]
    parts, start = {}, 0
    for name, w in blocks:
        parts[name] = (start, start + w.shape[0])
        start += w.shape[0]
    q_b = [attn.wq_b.weight] + ([attn.indexer.wq_b.weight] if attn.indexer is not None else [])
    return _LayerPlan(hc_attn=fused.pack(layer.hc_attn_fn), hc_ffn=fused.pack(layer.hc_ffn_fn),
                      proj=_Linear.of(torch.cat([w for _, w in blocks])), parts=parts, q_b=_Linear.of(torch.cat(q_b)),
                      wo_a=_Linear.of(attn.wo_a.weight, cfg.o_groups), wo_b=_Linear.of(attn.wo_b.weight),
                      moe=_moe_plan(layer.ffn, cfg))


def _moe_plan(moe, cfg) -> MoEPlan:
    def w13(expert) -> torch.Tensor:
        return fused.pack(torch.cat([expert.w1.weight, expert.w3.weight]))[0]

    is_hash = moe.gate.is_hash
    return MoEPlan(gate=fused.pack(moe.gate.weight), bias=None if is_hash else moe.gate.bias,
                   tid2eid=moe.gate.tid2eid if is_hash else None, k=cfg.num_experts_per_tok,
                   n_experts=cfg.n_routed_experts, inter=cfg.moe_intermediate_size, scaling=cfg.routed_scaling_factor,
                   limit=cfg.swiglu_limit, w13=torch.stack([w13(e) for e in moe.experts]),
                   w2=torch.stack([fused.pack(e.w2.weight)[0] for e in moe.experts]),
                   s13=w13(moe.shared_experts), s2=fused.pack(moe.shared_experts.w2.weight)[0])
