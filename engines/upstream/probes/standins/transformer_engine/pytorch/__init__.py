"""transformer_engine.pytorch stand-in: the modules Megatron's TE wrappers subclass, with TE's parameter names
(see transformer_engine/__init__.py for why names and values are kept)."""

from __future__ import annotations

import importlib
import sys

import torch
import torch.nn.functional as F

from . import fp8  # noqa: F401
from .fp8 import fp8_autocast, fp8_model_init  # noqa: F401


def _factory(device, dtype):
    return {"device": device if device is not None else "cpu", "dtype": dtype or torch.float32}


class TransformerEngineBaseModule(torch.nn.Module):
    """What TE's modules share: `_extra_state` in the state dict and TE's FP8 bookkeeping (always off)."""

    def __init__(self) -> None:
        super().__init__()
        self.fp8 = False
        self.fp8_calibration = False
        self.fp8_meta = {"fp8_checkpoint": False, "recipe": None}
        self.tp_group = None
        self.tp_size = 1

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        return None

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)  # TE >= 2 with no FP8 recipe: an empty byte tensor

    def set_extra_state(self, state) -> None:
        return None

    def set_tensor_parallel_group(self, tp_group) -> None:
        self.tp_group = tp_group

    def _init_weight(self, weight: torch.nn.Parameter, init_method) -> None:
        if init_method is not None and weight.device.type != "meta":
            init_method(weight)


class Linear(TransformerEngineBaseModule):
    """te.pytorch.Linear: `weight` [out, in] (+ `bias`); y = x W^T + b."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, init_method=None,
                 return_bias: bool = False, params_dtype=None, device=None, parallel_mode=None, tp_size: int = 1,
                 **kwargs) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.parallel_mode, self.tp_size = parallel_mode, tp_size
        if parallel_mode == "column":
            out_features //= tp_size
        elif parallel_mode == "row":
            in_features //= tp_size
        self.use_bias, self.return_bias = bias, return_bias
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, **_factory(device, params_dtype)))
        self._init_weight(self.weight, init_method)
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(out_features, **_factory(device, params_dtype)))
        else:
            self.bias = None

    def _get_weight_tensors(self):
        return [self.weight]

    def forward(self, x, is_first_microbatch=None, **kwargs):
        out = F.linear(x, self.weight)
        if self.return_bias:
            return out, self.bias
        return out if self.bias is None else out + self.bias


class RMSNorm(TransformerEngineBaseModule):
    """te.pytorch.RMSNorm: `weight`; y = x / sqrt(mean(x^2) + eps) * w (computed in fp32, cast to x's dtype)."""

    def __init__(self, normalized_shape: int | None = None, eps: float = 1e-5, *, hidden_size: int | None = None,
                 zero_centered_gamma: bool = False, params_dtype=None, device=None, **kwargs) -> None:
        super().__init__()  # TE >= 2 names the width `normalized_shape`, older TE `hidden_size`: both accepted
        hidden_size = normalized_shape if normalized_shape is not None else hidden_size
        self.eps, self.zero_centered_gamma = eps, zero_centered_gamma
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, **_factory(device, params_dtype)))

    def forward(self, x):
        w = self.weight.float() + (1.0 if self.zero_centered_gamma else 0.0)
        xf = x.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps) * w).to(x.dtype)


class LayerNorm(RMSNorm):
    """te.pytorch.LayerNorm: `weight` + `bias` (DeepSeek-V4 uses RMSNorm only; kept for completeness of names)."""

    def __init__(self, normalized_shape: int | None = None, eps: float = 1e-5, **kwargs) -> None:
        super().__init__(normalized_shape, eps, **kwargs)
        self.bias = torch.nn.Parameter(torch.zeros_like(self.weight))

    def forward(self, x):
        return F.layer_norm(x.float(), x.shape[-1:], self.weight.float(), self.bias.float(), self.eps).to(x.dtype)


class LayerNormLinear(Linear):
    """te.pytorch.LayerNormLinear: `layer_norm_weight` then `weight`; y = RMSNorm(x) W^T."""

    def __init__(self, in_features: int, out_features: int, *, eps: float = 1e-5, normalization: str = "RMSNorm",
                 zero_centered_gamma: bool = False, return_layernorm_output: bool = False, **kwargs) -> None:
        params_dtype, device = kwargs.get("params_dtype"), kwargs.get("device")
        super().__init__(in_features, out_features, **kwargs)
        self.eps, self.normalization, self.zero_centered_gamma = eps, normalization, zero_centered_gamma
        self.return_layernorm_output = return_layernorm_output
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(in_features, **_factory(device, params_dtype)))

    def forward(self, x, is_first_microbatch=None, **kwargs):
        xf = x.float()
        w = self.layer_norm_weight.float() + (1.0 if self.zero_centered_gamma else 0.0)
        normed = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps) * w).to(x.dtype)
        out = super().forward(normed)
        if self.return_layernorm_output:
            return (out, normed) if not self.return_bias else (*out, normed)
        return out


class GroupedLinear(TransformerEngineBaseModule):
    """te.pytorch.GroupedLinear: `weight0..N-1` [out, in] (+ `bias0..`); rows of x split by m_splits, one GEMM each."""

    def __init__(self, num_gemms: int, in_features: int, out_features: int, *, bias: bool = True, init_method=None,
                 return_bias: bool = False, params_dtype=None, device=None, **kwargs) -> None:
        super().__init__()
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias, self.return_bias = bias, return_bias
        for i in range(num_gemms):
            w = torch.nn.Parameter(torch.empty(out_features, in_features, **_factory(device, params_dtype)))
            self._init_weight(w, init_method)
            self.register_parameter(f"weight{i}", w)
            if bias:
                self.register_parameter(f"bias{i}", torch.nn.Parameter(
                    torch.zeros(out_features, **_factory(device, params_dtype))))

    def _get_weight_tensors(self):
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    def forward(self, x, m_splits, is_first_microbatch=None, **kwargs):
        outs = []
        for i, part in enumerate(torch.split(x, list(m_splits))):
            out = F.linear(part, getattr(self, f"weight{i}"))
            if self.use_bias and not self.return_bias:
                out = out + getattr(self, f"bias{i}")
            outs.append(out)
        out = torch.cat(outs) if outs else x.new_empty(0, self.out_features)
        if self.return_bias:
            return out, [getattr(self, f"bias{i}") for i in range(self.num_gemms)] if self.use_bias else None
        return out


def __getattr__(name: str):
    """Everything else TE has (DotProductAttention, ops, distributed, ...): a stub class or a stubbed submodule."""
    if name.startswith("__"):
        raise AttributeError(name)
    if name[:1].isupper():
        return sys.modules["engine_stubs"]._stub_class(f"{__name__}.{name}")
    return importlib.import_module(f"{__name__}.{name}")
