"""Per-layer sub-block outputs of Miles' DeepSeek-V4 Megatron model, captured with forward hooks (model_probe.py).

The same five sub-blocks, shapes and layout as v4rl's own trace (engines/align/layerwise.py SUB_BLOCKS), so
v4rl's layer-by-layer comparison reads both:

  attention   self_attention's output                               [S,B,D]    -> [B,S,D]
  mhc_attn    the hc streams after the attention-side mHC merge     [S,B,hc,D] -> [B,S,hc,D]
  router      the experts each token is routed to (routing_map)     [S*B,E]    -> [B,S,k] expert ids, ascending
  moe         the MoE block's output (routed + shared)              [S,B,D]    -> [B,S,D]
  mhc_ffn     the layer's output (streams after the FFN-side merge) [S,B,hc,D] -> [B,S,hc,D]

Where the attention-side merge lands differs by generation: Miles' first generation merges in a helper that is
no module (its `layer_post` is wrapped for the duration of the capture: same computation, output recorded, the
first call of a layer = attention side); Megatron's own mHC (second generation) takes the merged streams as the
input of the layer's `mlp_hyper_connection` module (a forward pre-hook reads it, [s, b, n*C] -> [B, S, n, C]).
"""

from __future__ import annotations

import contextlib
import importlib

import torch

HC_UTIL_MODULES = (
    "miles_plugins.models.deepseek_v4.ops.hyper_connection",  # Miles main (first generation)
)
"""Where each Miles generation keeps the mHC helper whose `layer_post` merges a sub-layer into the streams."""


def _hc_util_classes() -> list[type]:
    found = []
    for name in HC_UTIL_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        cls = getattr(module, "DeepSeekV4HyperConnectionUtil", None)
        if cls is not None:
            found.append(cls)
    return found


def _bsd(t: torch.Tensor) -> torch.Tensor:
    return t.detach().transpose(0, 1).contiguous().float()


@contextlib.contextmanager
def capture(module, batch: int, seq: int):
    """Yield a list (one dict per decoder layer) that the forward inside the block fills."""
    layers = module.decoder.layers
    trace: list[dict[str, torch.Tensor]] = [{} for _ in layers]
    merges: list[torch.Tensor] = []
    handles = []
    originals = []

    for cls in _hc_util_classes():
        original = cls.layer_post

        def layer_post(self, *args, _original=original, **kwargs):
            out = _original(self, *args, **kwargs)
            merges.append(out)
            return out

        originals.append((cls, original))
        cls.layer_post = layer_post

    def streams(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if t.dim() == 3:  # Megatron's mHC keeps the n streams flattened: [s, b, n*C]
            t = t.view(t.shape[0], t.shape[1], -1, module.config.hidden_size)
        return _bsd(t)

    def first(output):
        return output[0] if isinstance(output, (tuple, list)) else output

    def routed(output) -> torch.Tensor:
        routing_map = output[1]  # (probs, routing_map [tokens, experts] bool)
        k = int(routing_map[0].sum())
        ids = routing_map.nonzero()[:, 1].view(seq, batch, k)
        return ids.transpose(0, 1).sort(-1).values

    for i, layer in enumerate(layers):
        def before(mod, args, kwargs, i=i):
            merges.clear()
            trace[i].pop("mhc_attn", None)

        def after(mod, args, kwargs, output, i=i):
            trace[i]["mhc_ffn"] = streams(first(output))
            if "mhc_attn" in trace[i]:  # recorded by the mlp_hyper_connection pre-hook (second generation)
                return
            if not merges:
                raise RuntimeError(f"layer {i}: no mHC merge was recorded; has the hyper-connection helper moved? "
                                   f"(looked in {HC_UTIL_MODULES})")
            trace[i]["mhc_attn"] = streams(merges[0])

        handles += [
            layer.register_forward_pre_hook(before, with_kwargs=True),
            layer.register_forward_hook(after, with_kwargs=True),
            layer.self_attention.register_forward_hook(
                lambda mod, a, o, i=i: trace[i].__setitem__("attention", _bsd(first(o)))),
            layer.mlp.router.register_forward_hook(
                lambda mod, a, o, i=i: trace[i].__setitem__("router", routed(o))),
            layer.mlp.register_forward_hook(lambda mod, a, o, i=i: trace[i].__setitem__("moe", _bsd(first(o)))),
        ]
        if hasattr(layer, "mlp_hyper_connection"):
            handles.append(layer.mlp_hyper_connection.register_forward_pre_hook(
                lambda mod, a, i=i: trace[i].__setitem__("mhc_attn", streams(a[0]))))
    try:
        yield trace
    finally:
        for h in handles:
            h.remove()
        for cls, original in originals:
            cls.layer_post = original
