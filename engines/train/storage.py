"""What weights look like after being stored in a checkpoint: quantize each tensor the way `checkpoints/hf.py`
writes it (FP8 blocks, FP4 or FP8 experts, bf16, fp32, int64) and read it back dequantized.

Used where a trainer needs the exact weights the rollout engine will serve, without disk I/O: the bootstrap
evaluates them, the quantization-aware forward (engines/train/fake_quant.py) trains through them.
"""

from __future__ import annotations

import torch

from checkpoints.hf import FP4_GROUP, FP8_BLOCK, QuantizedTensor, encode_tensor
from engines.model.config import ModelConfig
from engines.model.params import native_param_specs


def stored_value(w: torch.Tensor, kind: str, *, expert_dtype: str = "fp4", scale_fmt: str = "ue8m0",
                 out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One tensor of storage kind `kind` (native_param_specs) as a reader dequantizes it after writing."""
    stored = encode_tensor("x.weight", w, kind, weight_format="fp8", expert_dtype=expert_dtype, scale_fmt=scale_fmt)
    if len(stored) == 1:
        t = stored[0][1]
        return t.to(out_dtype) if t.is_floating_point() else t
    (_, data), (_, scale) = stored
    kind = "fp4" if data.dtype == torch.int8 else "fp8"
    block = (1, FP4_GROUP) if kind == "fp4" else FP8_BLOCK
    return QuantizedTensor(data=data, scale=scale, kind=kind, block=block).dequantize(out_dtype)


def storage_round_trip(native: dict[str, torch.Tensor], cfg: ModelConfig, *, expert_dtype: str = "fp4",
                       scale_fmt: str = "ue8m0", out_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {name: stored_value(native[name], spec.kind, expert_dtype=expert_dtype, scale_fmt=scale_fmt,
                               out_dtype=out_dtype)
            for name, spec in native_param_specs(cfg).items()}
