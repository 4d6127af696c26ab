"""What a native state looks like after being stored in a checkpoint: quantize every tensor the way
`checkpoints/hf.py` writes it (FP8 blocks, FP4 experts, bf16, fp32, int64) and read it back dequantized.

Used where a trainer needs to see the exact weights the rollout engine will serve, without disk I/O.
"""

from __future__ import annotations

import torch

from checkpoints.hf import FP4_GROUP, FP8_BLOCK, QuantizedTensor, encode_tensor
from engines.model.config import ModelConfig
from engines.model.params import native_param_specs


def storage_round_trip(native: dict[str, torch.Tensor], cfg: ModelConfig, *, expert_dtype: str = "fp4",
                       scale_fmt: str = "ue8m0", out_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    out = {}
    for name, spec in native_param_specs(cfg).items():
        stored = encode_tensor(name, native[name], spec.kind, weight_format="fp8", expert_dtype=expert_dtype,
                               scale_fmt=scale_fmt)
        if len(stored) == 1:
            t = stored[0][1]
            out[name] = t if not t.is_floating_point() else t.to(out_dtype)
            continue
        (_, data), (_, scale) = stored
        kind = "fp4" if data.dtype == torch.int8 else "fp8"
        block = (1, FP4_GROUP) if kind == "fp4" else FP8_BLOCK
        out[name] = QuantizedTensor(data=data, scale=scale, kind=kind, block=block).dequantize(out_dtype)
    return out
