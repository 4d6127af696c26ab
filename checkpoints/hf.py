"""Write and read DeepSeek-V4 HF checkpoints in the native layout (what `deepseek-ai/DeepSeek-V4-Flash` ships).

On disk (`weight_format="fp8"`, the release format):
  model-0000K-of-0000N.safetensors     native names (`layers.0.attn.wq_a.weight`, `embed.weight`, ...)
  model.safetensors.index.json         {"metadata": {"total_size": bytes}, "weight_map": {name: shard}}
  config.json                          DeepSeek's release form (ModelConfig.to_hf_dict()) + "dtype" +
                                       quantization_config + expert_dtype (engines/model/config_format.py)
  generation_config.json, tokenizer files (copied from tokenizer_dir)
Each tensor is stored as `engines/model/params.py` says:
  fp8    `X.weight` float8_e4m3fn + `X.scale` [ceil(M/128), ceil(N/128)] float8_e8m0fnu (or float32)
  fp4    routed experts: `X.weight` int8 [out, in/2] (two E2M1 per byte) + `X.scale` [out, in/32]
         float8_e8m0fnu; with expert_dtype="fp8" they take the fp8 path instead (the FP8 repackage)
  bf16 / fp32 / int64 as named.
`weight_format="bf16"|"fp32"` writes a plain checkpoint (no scales, no quantization_config); fp32-kind
tensors stay fp32 in a bf16 checkpoint. transformers renames `X.scale` to `X.weight_scale_inv` when it
loads, so `DeepseekV4ForCausalLM.from_pretrained` reads what we write.
NOTE: transformers derives the FP8 block from `rows // scale_rows`, so a dimension that is neither a
multiple of 128 nor below 128 (e.g. 200 -> 2 blocks) dequantizes wrongly there (block 100); our reader
is right for any shape. Keep such dimensions out of presets that transformers must load.

Reading accepts the native form, the HF-renamed form (`X.weight_scale_inv`), SGLang/Miles HF names
(`model.layers.N.self_attn.wq_a.weight`), FP4 or FP8 routed experts (told apart by dtype: int8/uint8 ->
FP4, float8_e4m3fn -> FP8), UE8M0 scales as float8_e8m0fnu or uint8 exponent bytes or fp32, and plain
BF16 checkpoints. Native `mtp.*` tensors are skipped (no format here carries the MTP head). The whole
checkpoint is read into memory: fine for the tiny preset, not meant for the 284B release.

    >>> out = save_hf_checkpoint("ckpt/tiny-fp8", cfg, state)            # state: native names, full precision
    >>> cfg, state = load_hf_checkpoint("ckpt/tiny-fp8")                  # dequantized, fp32
    >>> raw = read_raw_tensors("ckpt/tiny-fp8")                          # QuantizedTensor | Tensor

Tests: `.venv/bin/python -m pytest tests/test_hf_checkpoint.py -q`.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from checkpoints.names import IGNORED_NATIVE_PREFIXES, sglang_to_native_name
from checkpoints.paths import INDEX_FILE, SINGLE_FILE  # named once, in the module that imports no torch
from engines.model.config import ModelConfig
from engines.model.config_format import ALIASES, TRANSFORMERS_ONLY
from engines.model.params import ParamSpec, native_param_specs
from checkpoints.quant import (
    UE8M0,
    dequantize_fp4_e2m1,
    dequantize_fp8_blockwise,
    quantize_fp4_e2m1,
    quantize_fp8_blockwise,
)

FP8_BLOCK = (128, 128)
FP4_GROUP = 32
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")
_SCALE_DTYPES = (UE8M0, torch.uint8, torch.float32)
_FP4_DTYPES = tuple(d for d in (torch.int8, torch.uint8, getattr(torch, "float4_e2m1fn_x2", None)) if d is not None)

WeightFormat = Literal["fp8", "bf16", "fp32"]
ExpertDtype = Literal["fp4", "fp8"]


class CheckpointError(ValueError):
    """A checkpoint on disk (or a state to be written) is malformed; the message names file and tensor."""


@dataclass(frozen=True)
class QuantizedTensor:
    """A weight kept as stored: FP8 `[M, N]` + block scale, or packed FP4 `[M, N/2]` + 1x32 scale."""

    data: torch.Tensor
    scale: torch.Tensor
    kind: Literal["fp8", "fp4"]
    block: tuple[int, int]
    """(128, 128) for FP8 blocks, (1, 32) for FP4 groups."""

    @property
    def shape(self) -> tuple[int, int]:
        """Logical (dequantized) shape."""
        m, n = self.data.shape
        return (m, 2 * n) if self.kind == "fp4" else (m, n)

    def dequantize(self, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.kind == "fp4":
            return dequantize_fp4_e2m1(self.data, self.scale, group=self.block[1], out_dtype=out_dtype)
        return dequantize_fp8_blockwise(self.data, self.scale, block=self.block, out_dtype=out_dtype)


RawTensor = QuantizedTensor | torch.Tensor


# ============================================================================================== writing
def scale_name(weight_name: str) -> str:
    """Native scale name of a quantized weight: `X.weight` -> `X.scale`."""
    if not weight_name.endswith(".weight"):
        raise ValueError(f"only `.weight` tensors are quantized; got {weight_name!r}")
    return weight_name[: -len(".weight")] + ".scale"


def encode_tensor(
    name: str,
    tensor: torch.Tensor,
    kind: str,
    *,
    weight_format: WeightFormat = "fp8",
    expert_dtype: ExpertDtype = "fp4",
    scale_fmt: Literal["ue8m0", "fp32"] = "ue8m0",
) -> list[tuple[str, torch.Tensor]]:
    """One native tensor -> the on-disk tensors that store it (weight, plus `.scale` when quantized)."""
    t = tensor.detach()
    if kind == "int64":
        return [(name, t.to(torch.int64, copy=True).contiguous())]
    if weight_format == "fp32":
        return [(name, t.to(torch.float32, copy=True).contiguous())]
    if weight_format == "bf16" or kind in ("bf16", "fp32"):
        dtype = torch.float32 if kind == "fp32" else torch.bfloat16
        return [(name, t.to(dtype, copy=True).contiguous())]
    if kind == "fp4" and expert_dtype == "fp4":
        q, s = quantize_fp4_e2m1(t, group=FP4_GROUP)
    else:  # fp8 linears, and routed experts of the FP8 repackage
        q, s = quantize_fp8_blockwise(t, block=FP8_BLOCK, scale_fmt=scale_fmt)
    return [(name, q), (scale_name(name), s)]


def hf_config_dict(cfg: ModelConfig, *, weight_format: WeightFormat, expert_dtype: ExpertDtype,
                   scale_fmt: str, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """config.json body: the model config in DeepSeek's release form plus the storage fields transformers and
    SGLang read. `base` (a source checkpoint's config.json, e.g. for an export) contributes the keys v4rl does
    not model; the model keys of either form and the storage fields are v4rl's."""
    d = with_release_model_keys({k: v for k, v in (base or {}).items() if k not in _STORAGE_KEYS}, cfg)
    d["dtype"] = "float32" if weight_format == "fp32" else "bfloat16"
    if weight_format == "fp8":
        qc: dict[str, Any] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                              "weight_block_size": list(FP8_BLOCK)}
        if scale_fmt == "ue8m0":  # fp32 scales: no key, transformers' default "float" (as DeepSeek-V3 ships)
            qc["scale_fmt"] = "ue8m0"
        d["quantization_config"] = dict(sorted(qc.items()))
        d["expert_dtype"] = expert_dtype
    return dict(sorted(d.items()))


def with_release_model_keys(raw: Mapping[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """`raw` (a config.json of either form) with its model keys rewritten in the release form from cfg; keys v4rl
    does not model and the storage fields stay as they are."""
    d = {k: v for k, v in raw.items() if k not in _MODEL_KEYS}
    d.update(cfg.to_hf_dict())
    return dict(sorted(d.items()))


_STORAGE_KEYS = frozenset({"quantization_config", "expert_dtype", "dtype", "torch_dtype"})
_MODEL_KEYS = frozenset(set(TRANSFORMERS_ONLY) | set(ALIASES) | set(ALIASES.values()) | {
    "compress_ratios", "compress_rate_csa", "compress_rate_hca", "qk_rope_head_dim", "rope_scaling"})
"""Keys of a config.json whose meaning v4rl models under another spelling in one of the two forms: rewritten
from the ModelConfig, never copied (the release keys v4rl writes are overwritten anyway)."""


def save_hf_checkpoint(
    out_dir: str | Path,
    cfg: ModelConfig,
    state: Mapping[str, torch.Tensor],
    *,
    weight_format: WeightFormat = "fp8",
    expert_dtype: ExpertDtype = "fp4",
    scale_fmt: Literal["ue8m0", "fp32"] = "ue8m0",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tokenizer_dir: str | Path | None = None,
    generation_config: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `state` (native names, full precision) as a sharded HF DeepSeek-V4 checkpoint; returns out_dir.

    The directory is built beside out_dir under a hidden temporary name and renamed into place only
    when complete, so a crash never leaves a directory that looks like a checkpoint.
    """
    out_dir = Path(out_dir)
    if weight_format not in ("fp8", "bf16", "fp32"):
        raise ValueError(f"weight_format must be 'fp8', 'bf16' or 'fp32'; got {weight_format!r}")
    if expert_dtype not in ("fp4", "fp8"):
        raise ValueError(f"expert_dtype must be 'fp4' or 'fp8'; got {expert_dtype!r}")
    if scale_fmt not in ("ue8m0", "fp32"):
        raise ValueError(f"scale_fmt must be 'ue8m0' or 'fp32'; got {scale_fmt!r}")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive; got {max_shard_bytes}")
    if out_dir.exists() and not overwrite:
        raise CheckpointError(f"{out_dir} already exists; pass overwrite=True or choose another directory")
    tok_files = _tokenizer_files(Path(tokenizer_dir)) if tokenizer_dir is not None else []
    specs = native_param_specs(cfg)
    _check_state(state, specs, where=f"state passed to save_hf_checkpoint({out_dir})")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        shards, total = _write_shards(tmp, cfg, state, specs, weight_format=weight_format,
                                      expert_dtype=expert_dtype, scale_fmt=scale_fmt,
                                      max_shard_bytes=max_shard_bytes)
        weight_map = {}
        for k, (part, names) in enumerate(shards, start=1):
            final = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            os.replace(part, tmp / final)
            weight_map.update({n: final for n in names})
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _write_json(tmp / INDEX_FILE, index)
        _write_json(tmp / "config.json", hf_config_dict(cfg, weight_format=weight_format,
                                                        expert_dtype=expert_dtype, scale_fmt=scale_fmt))
        gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}
        gen.update(generation_config or {})
        _write_json(tmp / "generation_config.json", gen)
        for f in tok_files:
            shutil.copy2(f, tmp / f.name)
        _move_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _write_shards(tmp: Path, cfg: ModelConfig, state: Mapping[str, torch.Tensor], specs: dict[str, ParamSpec],
                  **fmt: Any) -> tuple[list[tuple[Path, list[str]]], int]:
    """Encode tensors in spec order, keeping each weight next to its scale, and flush shards by size."""
    max_bytes = fmt.pop("max_shard_bytes")
    shards: list[tuple[Path, list[str]]] = []
    current: dict[str, torch.Tensor] = {}
    current_bytes = total = 0

    def flush() -> None:
        nonlocal current, current_bytes
        part = tmp / f"shard-{len(shards) + 1:05d}.partial"
        save_file(current, str(part), metadata={"format": "pt"})
        shards.append((part, list(current)))
        current, current_bytes = {}, 0

    for name, spec in specs.items():
        try:
            group = encode_tensor(name, state[name], spec.kind, **fmt)
        except (ValueError, TypeError) as exc:
            raise CheckpointError(f"cannot encode tensor {name!r} ({spec.kind}): {exc}") from exc
        size = sum(t.numel() * t.element_size() for _, t in group)
        if current and current_bytes + size > max_bytes:
            flush()
        current.update(group)
        current_bytes += size
        total += size
    if current:
        flush()
    return shards, total


def _move_into_place(tmp: Path, out_dir: Path) -> None:
    if not out_dir.exists():
        os.replace(tmp, out_dir)
        return
    old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
    os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _tokenizer_files(tokenizer_dir: Path) -> list[Path]:
    files = [tokenizer_dir / n for n in TOKENIZER_FILES if (tokenizer_dir / n).is_file()]
    if not files:
        raise CheckpointError(f"tokenizer_dir {tokenizer_dir} has none of {', '.join(TOKENIZER_FILES)}; "
                              "point it at a directory saved by tokenizer.save_pretrained()")
    return files


def _check_state(state: Mapping[str, Any], specs: dict[str, ParamSpec], *, where: str,
                 files: Mapping[str, str] | None = None) -> None:
    """Names and logical shapes of `state` must be exactly those of `specs`."""
    def loc(name: str) -> str:
        return f"{files[name]}: " if files and name in files else ""

    unknown = [n for n in state if n not in specs]
    if unknown:
        raise CheckpointError(f"{loc(unknown[0])}unknown tensor {unknown[0]!r} in {where} "
                              f"({len(unknown)} unknown in all); it is not a DeepSeek-V4 tensor of this config "
                              "(check num_hidden_layers / layer_types / n_routed_experts in config.json)")
    missing = [n for n in specs if n not in state]
    if missing:
        raise CheckpointError(f"missing tensor {missing[0]!r} in {where} ({len(missing)} missing in all, "
                              f"e.g. {missing[:3]}); the checkpoint is incomplete or was written for another "
                              "config: re-export it, or re-download the missing shard")
    for name, spec in specs.items():
        t = state[name]
        shape = t.shape if isinstance(t, QuantizedTensor) else tuple(t.shape)
        if tuple(shape) != spec.shape:
            raise CheckpointError(f"{loc(name)}tensor {name!r} in {where} has shape {tuple(shape)} but the config "
                                  f"expects {spec.shape}")


# ============================================================================================== reading
def load_hf_checkpoint(
    ckpt_dir: str | Path,
    *,
    dequantize: bool = True,
    out_dtype: torch.dtype = torch.float32,
) -> tuple[ModelConfig, dict[str, RawTensor]]:
    """Read a DeepSeek-V4 HF checkpoint into native names, validated against its config.json.

    dequantize=True returns plain tensors: floating ones (quantized or not) in out_dtype, tid2eid int64.
    dequantize=False returns what `read_raw_tensors` returns (QuantizedTensor for FP8/FP4 weights).
    """
    cfg, raw = _read_checkpoint(Path(ckpt_dir))
    if not dequantize:
        return cfg, raw
    out: dict[str, RawTensor] = {}
    for name, t in raw.items():
        if isinstance(t, QuantizedTensor):
            out[name] = t.dequantize(out_dtype)
        elif t.dtype.is_floating_point:
            out[name] = t.to(out_dtype)
        else:
            out[name] = t
    return cfg, out


def read_raw_tensors(ckpt_dir: str | Path) -> dict[str, RawTensor]:
    """Native name -> QuantizedTensor (FP8/FP4 weight + scale, as stored) or plain tensor, validated."""
    return _read_checkpoint(Path(ckpt_dir))[1]


def read_config(ckpt_dir: str | Path) -> tuple[ModelConfig, dict[str, Any]]:
    """The ModelConfig and the raw config.json dict (quantization fields included) of a checkpoint."""
    path = Path(ckpt_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
        return ModelConfig.from_hf_dict(raw), raw
    except (FileNotFoundError, NotADirectoryError):
        from checkpoints.paths import not_hf_reason

        raise CheckpointError(not_hf_reason(ckpt_dir) or f"{path} cannot be read") from None
    except (json.JSONDecodeError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{path}: cannot read the DeepSeek-V4 config: {exc}") from exc


def read_stored_tensors(ckpt_dir: str | Path, *, fp8_block: tuple[int, ...] = FP8_BLOCK,
                        specs: dict[str, ParamSpec] | None = None) -> tuple[str, dict[str, RawTensor], dict[str, str]]:
    """Every tensor of a HF-layout directory (a whole checkpoint or a bucket of one) as stored, each quantized
    weight paired with its scale and checked. Returns (source description, native name -> tensor, name -> file).
    No completeness check: callers holding the full spec list run `_check_state` (read_raw_tensors does).
    """
    ckpt_dir = Path(ckpt_dir)
    source, by_file = _shard_listing(ckpt_dir)
    out, files, _ = pair_stored_tensors(_iter_tensors(ckpt_dir, by_file), fp8_block=fp8_block, specs=specs,
                                        where=str(ckpt_dir))
    return str(source), out, files


def pair_stored_tensors(items: Iterable[tuple[str, str, torch.Tensor]], *, fp8_block: tuple[int, ...] = FP8_BLOCK,
                        specs: dict[str, ParamSpec] | None = None, where: str = "the update", partial: bool = False
                        ) -> tuple[dict[str, RawTensor], dict[str, str], list[tuple[str, str, torch.Tensor]]]:
    """(file or source, stored name, tensor) items -> native name -> tensor as stored, each quantized weight paired
    with its scale and checked; also native name -> source, and, with `partial`, the items whose partner (weight
    or scale) is not among them (a weight broadcast may send a weight and its scale in different buckets)."""
    weights: dict[str, tuple[str, torch.Tensor]] = {}
    scales: dict[str, tuple[str, torch.Tensor]] = {}
    disk_names: dict[tuple[str, bool], str] = {}
    for file, disk_name, tensor in items:
        native, is_scale = _native_name(disk_name, file)
        if native is None:
            continue
        table = scales if is_scale else weights
        if native in table:
            raise CheckpointError(f"{file}: tensor {disk_name!r} duplicates {native!r} already read from "
                                  f"{table[native][0]}; remove the stale shard or fix the index")
        table[native] = (file, tensor)
        disk_names[native, is_scale] = disk_name

    leftover: list[tuple[str, str, torch.Tensor]] = []
    for native, (file, tensor) in list(scales.items()):
        if native not in weights:
            if not partial:
                raise CheckpointError(f"{file}: scale for {native!r} has no weight tensor anywhere in {where}; "
                                      "the checkpoint is incomplete: re-download or re-export it")
            leftover.append((file, disk_names[native, True], tensor))
            del scales[native]
    out: dict[str, RawTensor] = {}
    for native, (file, tensor) in list(weights.items()):
        spec = (specs or {}).get(native)
        scale = scales.get(native)
        if (spec is not None and spec.kind == "int64") or native.endswith("tid2eid"):
            if scale is not None or tensor.dtype.is_floating_point:
                raise CheckpointError(f"{file}: tensor {native!r} must be an integer table; got {tensor.dtype}")
            out[native] = tensor.to(torch.int64)
            continue
        if partial and scale is None and (tensor.dtype == torch.float8_e4m3fn or tensor.dtype in _FP4_DTYPES):
            leftover.append((file, disk_names[native, False], tensor))
            del weights[native]
            continue
        out[native] = _pair(native, file, tensor, scale, fp8_block)
    return out, {n: f for n, (f, _) in weights.items()}, leftover


def _read_checkpoint(ckpt_dir: Path) -> tuple[ModelConfig, dict[str, RawTensor]]:
    cfg, raw_cfg = read_config(ckpt_dir)
    qc = raw_cfg.get("quantization_config") or {}
    specs = native_param_specs(cfg)
    source, out, files = read_stored_tensors(ckpt_dir, fp8_block=tuple(qc.get("weight_block_size") or FP8_BLOCK),
                                             specs=specs)
    _check_state(out, specs, where=str(source), files=files)
    return cfg, {name: out[name] for name in specs}


def _pair(native: str, file: str, tensor: torch.Tensor, scale: tuple[str, torch.Tensor] | None,
          fp8_block: tuple[int, ...]) -> RawTensor:
    """Attach a weight's scale and check its dtype and shape; plain tensors pass through."""
    quantized = tensor.dtype == torch.float8_e4m3fn or tensor.dtype in _FP4_DTYPES
    if not quantized:
        if scale is not None:
            raise CheckpointError(f"{scale[0]}: {native!r} has a scale but its weight in {file} is {tensor.dtype}, "
                                  "not FP8/FP4; drop the stray scale or re-export the checkpoint")
        if not tensor.dtype.is_floating_point or tensor.element_size() == 1:
            raise CheckpointError(f"{file}: tensor {native!r} has dtype {tensor.dtype}; expected bf16/fp16/fp32, "
                                  "or float8_e4m3fn / packed FP4 with a scale")
        return tensor
    if scale is None:
        raise CheckpointError(f"{file}: quantized weight {native!r} ({tensor.dtype}) has no scale "
                              f"({scale_name(native)} / {native}_scale_inv) in any shard; the checkpoint is "
                              "incomplete: re-download or re-export it (never use FP8 bytes unscaled)")
    scale_file, s = scale
    if s.dtype not in _SCALE_DTYPES:
        raise CheckpointError(f"{scale_file}: scale of {native!r} has dtype {s.dtype}; expected float8_e8m0fnu, "
                              "uint8 exponent bytes or float32")
    if tensor.dtype == torch.float8_e4m3fn:
        kind, block = "fp8", (int(fp8_block[0]), int(fp8_block[1]))
        m, n = tensor.shape
        want = (-(-m // block[0]), -(-n // block[1]))
    else:
        kind, block = "fp4", (1, FP4_GROUP)
        if tensor.dtype != torch.int8:
            tensor = tensor.view(torch.int8)
        m, half = tensor.shape
        want = (m, 2 * half // FP4_GROUP)
    if tuple(s.shape) != want:
        raise CheckpointError(f"{scale_file}: scale of {native!r} has shape {tuple(s.shape)}; a {kind} weight of "
                              f"stored shape {tuple(tensor.shape)} needs {want} ({block[0]}x{block[1]} blocks)")
    return QuantizedTensor(data=tensor, scale=s, kind=kind, block=block)


def _native_name(disk_name: str, file: str) -> tuple[str | None, bool]:
    """On-disk name -> (native weight name, is_scale); None for tensors deliberately skipped (mtp)."""
    name, is_scale = disk_name, False
    if name.endswith(".weight_scale_inv"):
        name, is_scale = name[: -len("_scale_inv")], True
    elif name.endswith(".scale"):
        name, is_scale = name[: -len(".scale")] + ".weight", True
    if name.startswith(IGNORED_NATIVE_PREFIXES):
        return None, is_scale
    if name.startswith("model.") or name.startswith("lm_head."):
        try:
            name = sglang_to_native_name(name)
        except ValueError:
            raise CheckpointError(f"{file}: unknown tensor {disk_name!r}; it is neither a native DeepSeek-V4 "
                                  "name nor a SGLang/Miles HF name (checkpoints/names.py)") from None
    return name, is_scale


def _shard_listing(ckpt_dir: Path) -> tuple[Path, dict[str, list[str] | None]]:
    """(index or lone file, {shard file: tensor names the index lists, or None for "all"})."""
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir} is not a directory; expected a HF checkpoint directory")
    index = ckpt_dir / INDEX_FILE
    if not index.is_file():
        if (ckpt_dir / SINGLE_FILE).is_file():
            return ckpt_dir / SINGLE_FILE, {SINGLE_FILE: None}
        raise CheckpointError(f"{ckpt_dir} has neither {INDEX_FILE} nor {SINGLE_FILE}; not a HF checkpoint")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: not a safetensors index ({exc!r}); re-download or re-export it") from exc
    by_file: dict[str, list[str] | None] = {}
    for name, shard in weight_map.items():
        by_file.setdefault(shard, []).append(name)  # type: ignore[union-attr]
    for shard, names in by_file.items():
        if not (ckpt_dir / shard).is_file():
            raise CheckpointError(f"{index} maps tensor {names[0]!r} (and {len(names) - 1} more) to shard "
                                  f"{shard}, which is missing from {ckpt_dir}; re-download that shard")
    return index, by_file


def _iter_tensors(ckpt_dir: Path, by_file: dict[str, list[str] | None]) -> Iterator[tuple[str, str, torch.Tensor]]:
    """Yield (file, name, tensor) for every tensor the listing names."""
    for shard, names in by_file.items():
        path = ckpt_dir / shard
        try:
            with safe_open(str(path), framework="pt") as f:
                present = set(f.keys())
                for name in sorted(present) if names is None else names:
                    if name not in present:
                        raise CheckpointError(f"{path}: tensor {name!r} is listed in {INDEX_FILE} but not stored "
                                              "in this shard; re-download the shard or fix the index")
                    yield str(path), name, f.get_tensor(name)
        except SafetensorError as exc:
            raise CheckpointError(f"{path}: cannot read safetensors file ({exc}); it is truncated or corrupt: "
                                  "re-download or re-export it") from exc
