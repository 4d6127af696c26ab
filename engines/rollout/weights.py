"""The rollout engine's weights: held exactly as the checkpoint stores them, plus the runtime copies.

Two layers, as in SGLang's FP8 path (reference/miles-sglang-megatron.md §2.3, rl-frameworks.md pain 3):
  stored    `WeightStore`: native name -> `QuantizedTensor` (FP8 E4M3 + 128x128 block scale, routed
            experts FP4 E2M1 packed + UE8M0 1x32 scale) or the plain tensor (bf16, fp32, int64 tid2eid).
            Updates replace stored tensors only, after validation (`check_update`).
  runtime   the `DeepseekV4` module's parameters: every stored tensor dequantized (fp32 arithmetic)
            and cast to the runtime dtype. `rebuild_runtime` recomputes all of them; it is what
            `/end_weight_update` runs (upstream SGLang's form of the patched `post_process_weights`
            route). With the ROCm profile (`rocm_fnuz`) FP8 weights are first converted to e4m3fnuz
            with doubled scales, the form ROCm kernels read, and dequantized from there (same values
            by construction).

Update validation refuses, naming the tensor: unknown names, wrong shapes, a storage kind other than
the one held (FP4 experts arriving as FP8 bytes, a scale-less FP8 weight), and any change to a hash
layer's `tid2eid` (a frozen routing table; an all-zero table is the buffer an exporter forgot).

    store = WeightStore.from_dir("ckpt/")            # as stored
    rebuild_runtime(model, store, rocm_fnuz=False)   # dequantized copies in the model
    sums = runtime_checksums(model)                  # name -> sha256 of what the engine computes with
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch

from checkpoints.hf import (
    FP8_BLOCK,
    CheckpointError,
    QuantizedTensor,
    RawTensor,
    read_config,
    read_stored_tensors,
)
from checkpoints.names import native_to_sglang_name
from checkpoints.quant import dequantize_fp8_blockwise, fp8_to_fnuz, tensor_checksum
from engines.model import DeepseekV4, ModelConfig
from engines.model.params import ParamSpec, native_param_specs


class WeightUpdateError(ValueError):
    """An update was refused; the message names the directory, the tensor and what to do."""


UNSCALED_BF16_SUFFIXES = (".attn.wo_a.weight",)
"""Stored FP8 weights an update may carry unquantized: SGLang (SGLANG_OPT_FP8_WO_A_GEMM=0, v4rl's setting)
dequantizes wo_a to a BF16 parameter while loading (`_dequant_fp8_wo_a_streaming`) and loads a BF16 wo_a as is,
which is what Miles' broadcast sends (its FP8 quantizer's list has no wo_a); the engine then serves it as sent."""


# ---------------------------------------------------------------------------------------------- reading
def read_weight_dir(path: str | Path, *, fp8_block: tuple[int, int] = FP8_BLOCK
                    ) -> tuple[ModelConfig | None, dict[str, RawTensor]]:
    """Every tensor of a HF-layout directory (whole checkpoint or one bucket of it), as stored.

    A bucket is the same layout as `v4rl export --format hf-fp8` (index + shards, native or SGLang
    names, each quantized weight beside its scale) holding a subset of the tensors; config.json is
    optional for a bucket (FP8 blocks are then `fp8_block`, the served checkpoint's). Weight/scale
    pairing and dtype checks are `checkpoints.hf`'s.
    """
    path = Path(path)
    cfg = None
    if (path / "config.json").is_file():
        cfg, raw_cfg = read_config(path)
        fp8_block = tuple((raw_cfg.get("quantization_config") or {}).get("weight_block_size") or FP8_BLOCK)
    _, out, _ = read_stored_tensors(path, fp8_block=fp8_block)
    return cfg, out


# ---------------------------------------------------------------------------------------------- the store
class WeightStore:
    """Native name -> tensor exactly as the checkpoint stores it; the engine's source of truth."""

    def __init__(self, cfg: ModelConfig, tensors: Mapping[str, RawTensor], *, source: str) -> None:
        self.cfg = cfg
        self.specs: dict[str, ParamSpec] = native_param_specs(cfg)
        self.tensors: dict[str, RawTensor] = {}
        missing = [n for n in self.specs if n not in tensors]
        if missing:
            raise CheckpointError(f"{source}: missing {missing[0]!r} ({len(missing)} tensors missing); "
                                  "the engine needs a whole checkpoint to start")
        for name in self.specs:  # validate kinds/shapes the same way updates are validated
            self.tensors[name] = _check_one(name, tensors[name], self.specs, None, source)
        unknown = [n for n in tensors if n not in self.specs]
        if unknown:
            raise CheckpointError(f"{source}: unknown tensor {unknown[0]!r}; not a tensor of this model config")
        for name, t in self.tensors.items():
            if name.endswith("tid2eid") and not bool(t.any()):
                raise CheckpointError(f"{source}: {name} is all zeros, so every token would route to expert 0; "
                                      "the checkpoint lost its hash-routing table: re-export it from the base model")

    @classmethod
    def from_dir(cls, path: str | Path) -> "WeightStore":
        cfg, tensors = read_weight_dir(path)
        if cfg is None:
            raise CheckpointError(f"{path} has no config.json; the engine starts from a whole HF checkpoint")
        return cls(cfg, tensors, source=str(path))

    def check_update(self, update: Mapping[str, RawTensor], *, source: str,
                     cfg: ModelConfig | None = None) -> dict[str, RawTensor]:
        """Validate an update against the held tensors; returns it (nothing is applied here)."""
        if cfg is not None and cfg != self.cfg:
            new, old = dataclasses.asdict(cfg), dataclasses.asdict(self.cfg)
            fields = sorted(k for k in old if old[k] != new.get(k))
            raise WeightUpdateError(f"{source}/config.json describes another model than the one served (fields "
                                    f"{fields} differ); start a new server for a new model config")
        if not update:
            raise WeightUpdateError(f"{source} holds no tensors of this model; nothing to update")
        return {name: _check_one(name, t, self.specs, self.tensors, source) for name, t in update.items()}

    @property
    def fp8_block(self) -> tuple[int, int]:
        """Block shape of the served FP8 weights (what a config-less bucket is read with)."""
        return next((t.block for t in self.tensors.values() if isinstance(t, QuantizedTensor) and t.kind == "fp8"),
                    FP8_BLOCK)

    def apply(self, update: Mapping[str, RawTensor]) -> None:
        self.tensors.update(update)

    def storage_summary(self) -> dict[str, int]:
        """How many tensors of each stored form the engine holds (fp8, fp4, plain)."""
        summary: dict[str, int] = {}
        for t in self.tensors.values():
            key = t.kind if isinstance(t, QuantizedTensor) else str(t.dtype).replace("torch.", "")
            summary[key] = summary.get(key, 0) + 1
        return summary


def _check_one(name: str, t: RawTensor, specs: Mapping[str, ParamSpec], held: Mapping[str, RawTensor] | None,
               source: str) -> RawTensor:
    spec = specs.get(name)
    if spec is None:
        raise WeightUpdateError(f"{source}: {name!r} is not a tensor of the served model")
    shape = t.shape if isinstance(t, QuantizedTensor) else tuple(t.shape)
    if tuple(shape) != spec.shape:
        raise WeightUpdateError(f"{source}: {name!r} has shape {tuple(shape)}; the served model has {spec.shape}")
    if spec.kind == "int64":
        if isinstance(t, QuantizedTensor) or t.dtype.is_floating_point:
            raise WeightUpdateError(f"{source}: {name!r} must be an integer table, got a {_form(t)} tensor")
        t = t.to(torch.int64)
        if held is not None:
            if not bool(t.any()):
                raise WeightUpdateError(
                    f"{source}: {name} (SGLang's {native_to_sglang_name(name)}) is all zeros. tid2eid is a frozen "
                    "buffer (not a parameter), so an exporter "
                    "that only walks parameters sends zeros (miles#2706); refusing the update. Export buffers too, "
                    "or leave tid2eid out of the update")
            if not torch.equal(t, held[name]):
                rows = int((t != held[name]).any(dim=-1).sum())
                raise WeightUpdateError(f"{source}: {name} differs from the served table in {rows} token rows; "
                                        "hash routing is frozen at initialisation and training never changes "
                                        "it, so the update is refused (check the exporter's name mapping)")
        return t
    want_quantized = spec.kind in ("fp8", "fp4")
    now = held[name] if held is not None else None
    if want_quantized and not isinstance(t, QuantizedTensor) and t.dtype.is_floating_point and (
            now is None or not isinstance(now, QuantizedTensor)):
        return t  # an unquantized checkpoint (hf-bf16: the BF16 rollout), served and updated as such
    if want_quantized and name.endswith(UNSCALED_BF16_SUFFIXES) and not isinstance(t, QuantizedTensor) and \
            t.dtype.is_floating_point and t.element_size() > 1:
        return t  # SGLang's wo_a is a BF16 parameter (its FP8 pre-pass dequantizes): Miles sends it unquantized
    if want_quantized != isinstance(t, QuantizedTensor) or (
            isinstance(t, QuantizedTensor) and now is not None and not isinstance(now, QuantizedTensor)):
        held_form = "unquantized (a BF16 start)" if now is not None and not isinstance(now, QuantizedTensor) else (
            "a quantized weight with its scale" if want_quantized else spec.kind)
        raise WeightUpdateError(f"{source}: {name!r} arrived as {_form(t)} but is stored as {held_form}; "
                                "re-export in the serving checkpoint's storage (`--format hf-fp8` or hf-bf16)")
    if isinstance(t, QuantizedTensor):
        if isinstance(now, QuantizedTensor) and now.kind != t.kind:
            raise WeightUpdateError(
                f"{source}: {name!r} arrived as {t.kind.upper()} but the engine holds it as {now.kind.upper()} "
                f"(e.g. FP4 bytes would be decoded as FP8); the expert dtype of the export must match the served "
                "checkpoint's `expert_dtype`")
        if spec.kind == "fp8" and t.kind != "fp8":
            raise WeightUpdateError(f"{source}: {name!r} is an FP8 linear but arrived as {t.kind.upper()}")
        return t
    if not t.dtype.is_floating_point:
        raise WeightUpdateError(f"{source}: {name!r} has dtype {t.dtype}; expected a floating tensor")
    return t


def _form(t: RawTensor) -> str:
    return f"{t.kind.upper()}+scale" if isinstance(t, QuantizedTensor) else str(t.dtype).replace("torch.", "")


# ---------------------------------------------------------------------------------------------- runtime
def prepare_runtime_model(cfg: ModelConfig, dtype: torch.dtype) -> DeepseekV4:
    """An empty model in the runtime dtype; in bf16, the modules the reference keeps in fp32 stay fp32."""
    model = DeepseekV4(cfg)
    if dtype != torch.float32:
        model = model.to(dtype).keep_fp32_where_reference_does()
    return model.eval().requires_grad_(False)


@torch.no_grad()
def rebuild_runtime(model: DeepseekV4, store: WeightStore, *, rocm_fnuz: bool = False) -> None:
    """Recompute every runtime tensor from the stored form (in place, into the model's parameters).

    Dequantization is fp32 arithmetic then one cast, the same as `checkpoints.hf.load_hf_checkpoint`,
    so a rebuilt engine is bit-identical to one freshly loaded from the same files.
    """
    state = {name: _dequantize(t, rocm_fnuz) for name, t in store.tensors.items()}
    model.load_state_dict(state, strict=True)


def _dequantize(t: RawTensor, rocm_fnuz: bool) -> torch.Tensor:
    if not isinstance(t, QuantizedTensor):
        return t.float() if t.is_floating_point() else t
    if t.kind == "fp8" and rocm_fnuz:
        q, s = fp8_to_fnuz(t.data, t.scale)
        return dequantize_fp8_blockwise(q, s, block=t.block, out_dtype=torch.float32)
    return t.dequantize(torch.float32)


@torch.no_grad()
def randomize_runtime(model: DeepseekV4, skip: Sequence[str] = ()) -> int:
    """Fill every tensor `rebuild_runtime` writes (the model's state dict) with random values; integer tables
    (tid2eid) get random ids in their own range. Returns how many were overwritten."""
    count = 0
    for name, t in model.state_dict().items():  # shares storage with the parameters and persistent buffers
        if any(s in name for s in skip):
            continue
        if t.is_floating_point():
            t.copy_(torch.randn_like(t, dtype=torch.float32).to(t.dtype))
        else:
            t.copy_(torch.randint_like(t, 0, max(int(t.max()) + 1, 1)))
        count += 1
    return count


def _runtime_tensors(model: DeepseekV4) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()


def runtime_checksums(model: DeepseekV4) -> dict[str, str]:
    """sha256 (dtype, shape, bytes) of every runtime parameter and buffer, tid2eid and RoPE tables included.

    -0.0 is hashed as +0.0: e4m3fnuz has no negative zero, so the ROCm path turns FP8 -0 into +0, a
    value-identical weight (products and sums come out the same) that must not fail the gate.
    """
    return {name: tensor_checksum(t + 0 if t.is_floating_point() else t) for name, t in _runtime_tensors(model)}
