"""Our DeepSeek-V4 for inference: full-sequence scoring/prefill and cached one-token decode.

Parameter names are the native checkpoint names, so `model.load_state_dict(native_state)` is the whole
weight-loading story (dequantization happens in checkpoints/ and checkpoints/quant.py, not here).

    from engines.model import DeepseekV4, ModelConfig
    model = DeepseekV4(ModelConfig.from_json_file("ckpt/config.json"))
    logits = model(input_ids)                       # [B, S, vocab]
    logits, caches = model.prefill(prompt_ids)      # one SequenceCache per prompt; then, token by token:
    batch = DecodeBatch.from_caches(model.cfg, caches)
    logits = model.decode(next_ids, batch)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from engines.model.attention import Attention, LayerCache
from engines.model.config import ModelConfig
from engines.model.decode_batch import DecodeBatch
from engines.model.fused_model import FusedModel
from engines.model.layers import MoE, RMSNorm, hc_head, hc_merge, hc_weights


@dataclass
class SequenceCache:
    """One sequence's prefill result: its next position and every layer's cache (never written to later)."""

    position: int
    layers: list[LayerCache] = field(default_factory=list)


class Block(nn.Module):
    """One decoder layer: mHC-wrapped attention, then mHC-wrapped MoE."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        n = (2 + cfg.hc_mult) * cfg.hc_mult
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer)
        self.ffn = MoE(cfg, layer)
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.zeros(n, cfg.hc_mult * cfg.hidden_size)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros(n)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3)))

    def forward(self, streams: torch.Tensor, token_ids: torch.Tensor, attention, trace: dict | None = None,
                routes: list[torch.Tensor] | None = None):
        """streams [B, S, hc, D]; `attention(x)` runs this layer's attention on the collapsed input; `routes`: as
        DeepseekV4.prefill's."""
        post, comb, collapsed = hc_weights(streams, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, self.cfg)
        attn_out = attention(self.attn_norm(collapsed))
        streams = hc_merge(streams, attn_out, post, comb)
        if trace is not None:
            trace["attention"] = attn_out
            trace["mhc_attn"] = streams
        post, comb, collapsed = hc_weights(streams, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, self.cfg)
        ffn_in = self.ffn_norm(collapsed)
        moe_out = self.ffn(ffn_in, token_ids, routes)
        if trace is not None:
            trace["router"] = self.ffn.route(ffn_in, token_ids)
            trace["moe"] = moe_out
        streams = hc_merge(streams, moe_out, post, comb)
        if trace is not None:
            trace["mhc_ffn"] = streams
        return streams


class DeepseekV4(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        hc = cfg.hc_mult
        self.hc_head_fn = nn.Parameter(torch.zeros(hc, hc * cfg.hidden_size))
        self.hc_head_base = nn.Parameter(torch.zeros(hc))
        self.hc_head_scale = nn.Parameter(torch.ones(1))
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.fused_kernels = False
        """Run prefill, forward and decode through the fused native kernels (fused_model.py) where they apply. Off
        by default, so scoring, alignment and the bootstrap's evaluation keep the torch ops' exact numbers (the
        committed base checkpoint was selected with them); the rollout engine turns it on."""
        self._fused: FusedModel | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def keep_fp32_where_reference_does(self) -> "DeepseekV4":
        """After `.to(bfloat16)`: put mHC, sinks, ape, norms and the router bias back in fp32 (as the reference)."""
        for name, p in self.named_parameters():
            if (name.rsplit(".", 1)[-1].startswith("hc_") or name.startswith("hc_head") or name.endswith(
                    ("attn_sink", "ape", "gate.bias")) or "norm" in name):
                p.data = p.data.float()
        return self

    def _streams(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The embedding copied into each of the hc_mult residual streams: [..., hc, D]."""
        x = self.embed(token_ids)
        return x.unsqueeze(-2).expand(*x.shape[:-1], self.cfg.hc_mult, x.shape[-1]).contiguous()

    def _logits(self, streams: torch.Tensor) -> torch.Tensor:
        h = self.norm(hc_head(streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.cfg))
        return self.head(h)

    def forward(self, token_ids: torch.Tensor, trace: list[dict] | None = None) -> torch.Tensor:
        """Logits [B, S, vocab] of whole sequences starting at position 0 (right padding is harmless)."""
        return self._full(token_ids, keep_cache=False, trace=trace)[0]

    def prefill(self, token_ids: torch.Tensor, *, all_logits: bool = True, routes: list[torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, list[SequenceCache]]:
        """Like forward, plus one cache per sequence to continue decoding from (all sequences of equal length).
        all_logits=False returns the last position's logits only ([B, 1, vocab]: all a sampler needs). `routes`, if
        given, gets one int64 [B*S, top_k] tensor per layer appended: the experts each token was routed to (hash
        layers: the tid2eid lookup), as computed by the path that ran."""
        return self._full(token_ids, keep_cache=True, all_logits=all_logits, routes=routes)

    @property
    def fused(self) -> FusedModel:
        if self._fused is None:
            self._fused = FusedModel(self)
        return self._fused

    def _full(self, token_ids: torch.Tensor, keep_cache: bool, trace: list[dict] | None = None,
              all_logits: bool = True, routes: list[torch.Tensor] | None = None):
        """Whole sequences through the fused kernels (fused_model.py: judged once per model config by
        fused_check.py, equal to the torch ops to float32 rounding) when `fused_kernels` is on and they apply,
        else the torch ops. A trace needs the torch ops."""
        if self.fused_kernels and trace is None and self.fused.usable():
            return self.fused.full(token_ids, keep_cache, all_logits, routes=routes)
        return self.full_torch(token_ids, keep_cache, trace, all_logits, routes=routes)

    def full_torch(self, token_ids: torch.Tensor, keep_cache: bool, trace: list[dict] | None = None,
                   all_logits: bool = True, streams: torch.Tensor | None = None,
                   routes: list[torch.Tensor] | None = None):
        """`_full` with torch ops only (the reference the fused kernels are checked against); `streams`: the
        initial residual streams [B, S, hc, D] instead of the embedding's (the check perturbs them)."""
        B, S = token_ids.shape
        positions = torch.arange(S, device=token_ids.device).expand(B, S)
        streams = self._streams(token_ids) if streams is None else streams
        caches = [SequenceCache(position=S) for _ in range(B)] if keep_cache else None
        for i, layer in enumerate(self.layers):
            layer_trace = {} if trace is not None else None

            def attention(x, layer=layer):
                out, layer_caches = layer.attn.forward_full(x, positions, keep_cache)
                if keep_cache:
                    for c, lc in zip(caches, layer_caches):
                        c.layers.append(lc)
                return out

            streams = layer(streams, token_ids, attention, layer_trace, routes)
            if trace is not None:
                trace.append(layer_trace)
        return self._logits(streams if all_logits else streams[:, -1:]), caches

    def decode(self, token_ids: torch.Tensor, batch: DecodeBatch, routes: list[torch.Tensor] | None = None
               ) -> torch.Tensor:
        """One new token per row: token_ids [B] -> logits [B, vocab]; advances every row by one position.

        Runs the fused kernels (as `_full`) when `fused_kernels` is on and they apply, else the torch ops.
        `routes`: as prefill's, one int64 [B, top_k] per layer."""
        if self.fused_kernels and self.fused.usable():
            return self.fused.decode(token_ids, batch, routes=routes)
        return self.decode_torch(token_ids, batch, routes=routes)

    def decode_torch(self, token_ids: torch.Tensor, batch: DecodeBatch, streams: torch.Tensor | None = None,
                     routes: list[torch.Tensor] | None = None) -> torch.Tensor:
        """`decode` with torch ops only (the reference of the fused kernels); `streams` as in full_torch."""
        positions = batch.positions.view(-1, 1).to(token_ids.device)
        ids = token_ids.view(-1, 1)
        streams = self._streams(ids) if streams is None else streams
        for i, layer in enumerate(self.layers):
            def attention(x, layer=layer, i=i):
                return layer.attn.forward_decode(x, positions, batch.layers[i])

            streams = layer(streams, ids, attention, routes=routes)
        batch.positions = batch.positions + 1
        return self._logits(streams)[:, 0]
