"""transformers' `DeepseekV4ForCausalLM` as our trainer model and reference implementation.

Builds it from a `ModelConfig` (random init or native weights), fixes the parts transformers leaves at
zero on init (the hash-routing table, sinks, compressor position biases, mHC bases) so every path
carries signal, and converts between its state dict and native names (checkpoints/names.py).

    model = build_reference_model(cfg, seed=0)              # random, every path live
    model = reference_from_native(cfg, native_state)        # given weights, fp32
    native = native_from_reference(model)
    use_native_mhc(model, cfg)                              # same numbers, mHC's Sinkhorn as native kernels
"""

from __future__ import annotations

import functools

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from checkpoints.names import native_to_transformers, transformers_to_native
from engines.model.config import ModelConfig
from engines.model.layers import hc_weights


def hf_config(cfg: ModelConfig) -> DeepseekV4Config:
    raw = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")}
    config = DeepseekV4Config(**raw)
    config._attn_implementation = "eager"
    return config


def random_tid2eid(vocab_size: int, n_experts: int, top_k: int, generator: torch.Generator) -> torch.Tensor:
    """A fixed random token -> experts table with k distinct experts per token."""
    return torch.stack([torch.randperm(n_experts, generator=generator)[:top_k] for _ in range(vocab_size)])


@torch.no_grad()
def liven_zero_initialised(model: DeepseekV4ForCausalLM, cfg: ModelConfig, generator: torch.Generator) -> None:
    """Give the tensors transformers' `_init_weights` leaves at zero small random values (tid2eid: a table)."""
    for name, buf in model.named_buffers():
        if name.endswith("tid2eid"):
            buf.copy_(random_tid2eid(cfg.vocab_size, cfg.n_routed_experts, cfg.num_experts_per_tok, generator))
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "sinks":
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
        elif leaf == "position_bias":
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
        elif leaf in ("base", "hc_base"):
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)


def build_reference_model(cfg: ModelConfig, *, seed: int) -> DeepseekV4ForCausalLM:
    """A freshly initialised fp32 transformers model, deterministic for the seed."""
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(hf_config(cfg)).float()
    liven_zero_initialised(model, cfg, torch.Generator().manual_seed(seed + 1))
    return model


def reference_from_native(cfg: ModelConfig, native: dict[str, torch.Tensor],
                          dtype: torch.dtype = torch.float32) -> DeepseekV4ForCausalLM:
    """transformers' model holding exactly the given native weights (cast to dtype; fp32 modules stay fp32)."""
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(hf_config(cfg))
    state = native_to_transformers(native, cfg)
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()},
                          strict=False, assign=True)
    missing = [k for k, v in model.state_dict().items() if v.is_meta and "rotary_emb" not in k]
    if missing:
        raise ValueError(f"native weights lack tensors for {missing[:5]} (and {max(0, len(missing) - 5)} more)")
    for module in model.modules():  # rotary tables are not weights: rebuild them off the meta device
        if type(module).__name__ == "DeepseekV4RotaryEmbedding":
            fresh = type(module)(model.config)
            for name, buf in fresh.named_buffers():
                setattr(module, name, buf)
    model = model.float() if dtype == torch.float32 else model.to(dtype)
    return model.eval()


def native_from_reference(model: DeepseekV4ForCausalLM) -> dict[str, torch.Tensor]:
    cfg = ModelConfig.from_hf_dict(model.config.to_dict())
    state = {k: v.detach() for k, v in model.state_dict().items() if "rotary_emb" not in k}
    return transformers_to_native(state, cfg)


def use_native_mhc(model: DeepseekV4ForCausalLM, cfg: ModelConfig) -> DeepseekV4ForCausalLM:
    """Compute every mHC weight set (transformers' `DeepseekV4HyperConnection`) with our `hc_weights`: the same
    ops, except that the Sinkhorn normalisation, 41% of a training step's ops, runs as native kernels whose
    results and gradients equal the torch ops' bit for bit (engines/model/kernels.py; where they are not
    available the torch ops run). Outputs, gradients and so every training result are unchanged
    (tests/test_kernels.py compares a patched and a stock model); only speed differs. Returns the model."""
    for module in model.modules():
        if type(module).__name__ == "DeepseekV4HyperConnection":
            module.forward = functools.partial(_hyper_connection, module, cfg)
    return model


def _hyper_connection(module: torch.nn.Module, cfg: ModelConfig, hidden_streams: torch.Tensor):
    return hc_weights(hidden_streams, module.fn, module.base, module.scale, cfg)
