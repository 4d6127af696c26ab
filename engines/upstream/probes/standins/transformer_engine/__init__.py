"""A stand-in for NVIDIA/ROCm TransformerEngine, so Megatron's REAL TE wrappers (TELinear, TENorm,
TEColumnParallelLinear, TERowParallelLinear, TEGroupedLinear, ...) build on CPU or the meta device.

Why it keeps names: a checkpoint's keys are the module's state_dict names, so every stand-in module owns exactly
the parameters TE's own module owns, under TE's names: `Linear.weight` (+ `bias`), `LayerNormLinear.
layer_norm_weight` + `weight`, `RMSNorm.weight`, `GroupedLinear.weight0..N-1`, and TE's `_extra_state` (TE >= 2
serializes FP8 metadata into it; with no FP8 recipe it is an empty uint8 tensor, which is what this returns).
Why it keeps values: the forward of each is the math TE computes for BF16 (y = x W^T + b with fp32 accumulation,
RMSNorm in fp32 cast back to the input dtype); no FP8. The version claims 2.8.0 so Megatron takes the paths of a
current TE. Anything else Megatron touches at import time (DotProductAttention, ops, router, ...) resolves to
engines/upstream/stubs.py stubs: the DeepSeek-V4 model never instantiates them.
"""

__version__ = "2.8.0"

from . import pytorch  # noqa: E402,F401
from . import common  # noqa: E402,F401
