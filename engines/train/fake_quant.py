"""Quantization-aware forward for the trainer: compute with exactly the weights the rollout engine serves.

The rollout engine holds FP8 (128x128 UE8M0 blocks) linears and experts and BF16 norms/embeddings; the
trainer keeps fp32 master weights. With plain BF16 training, each step's update (~lr per weight) is far
below the FP8 grid spacing (~1/8 of a weight), so re-quantization rounds most of it away: the rollout
policy lags the trainer and the mismatch is the whole effect of recent updates (measured on tiny-cpu: mean
|Δlogprob| 0.17-0.24 right after one lr-1e-4 step). Here the forward sees Q(w) = dequant(quant(w)), the
exact weights the next export serves, and the gradient passes straight through to the fp32 master
(w + stop_grad(Q(w) - w)), so master weights still accumulate small updates until they cross a grid point.
This is the tiny-scale analogue of FP8 actor training, the seed's stated next step.

    fq = FakeQuant(model, cfg, expert_dtype="fp8")
    logits = fq.forward(model, input_ids)     # autocast as usual outside
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.func import functional_call

from checkpoints.names import placement
from engines.model.config import ModelConfig
from engines.model.params import native_param_specs
from engines.train.storage import stored_value


class FakeQuant:
    def __init__(self, model, cfg: ModelConfig, *, expert_dtype: str = "fp8", scale_fmt: str = "ue8m0") -> None:
        params = dict(model.named_parameters())
        self.scale_fmt = scale_fmt
        self.plan: dict[str, list[tuple[tuple[slice, ...], tuple[int, ...], str]]] = defaultdict(list)
        for native, spec in native_param_specs(cfg).items():
            if spec.kind in ("fp32", "int64"):
                continue
            p = placement(native, spec.shape, "transformers", cfg.n_routed_experts)
            if p.name not in params:
                raise ValueError(f"native tensor {native!r} maps to {p.name!r}, which the trainer model lacks")
            box = tuple(slice(o, o + s) for o, s in zip(p.offsets, p.sizes))
            self.plan[p.name].append((box, spec.shape, spec.kind))
        self.expert_dtype = expert_dtype

    @torch.no_grad()
    def stored(self, model) -> dict[str, torch.Tensor]:
        """Q(w) for every quantized parameter (detached)."""
        params = dict(model.named_parameters())
        out = {}
        for name, boxes in self.plan.items():
            q = params[name].detach().float().clone()
            for box, shape, kind in boxes:
                value = stored_value(q[box].reshape(shape), kind, expert_dtype=self.expert_dtype,
                                     scale_fmt=self.scale_fmt)
                q[box] = value.reshape(q[box].shape)
            out[name] = q
        return out

    def forward(self, model, input_ids: torch.Tensor, stored: dict[str, torch.Tensor] | None = None, **kwargs):
        """model(input_ids, **kwargs) with each quantized weight replaced by w + stop_grad(Q(w) - w)."""
        stored = stored if stored is not None else self.stored(model)
        params = dict(model.named_parameters())
        swapped = {name: params[name] + (q - params[name]).detach() for name, q in stored.items()}
        return functional_call(model, swapped, args=(), kwargs={"input_ids": input_ids, **kwargs}, strict=False)
