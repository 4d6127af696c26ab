"""Runs INSIDE a subprocess with SGLang's source on sys.path: SGLang's own DeepSeek-V4 model, its loader and its
online-update code on CPU, on checkpoints v4rl wrote. Never imported by v4rl (only this file's path is handed to
engines.upstream.sources.engine_python); only the standard library, torch, safetensors and SGLang are imported.

What it runs, per case (one JSON spec in argv[1], one `PROBE <json>` line on stdout):
  build        `DefaultModelLoader.initialize_model_for_startup` (SGLang's `DeepseekV4ForCausalLM`, single rank,
               gloo), every parameter then filled with a sentinel (NaN; FP8 0x7F = NaN; integers 0x5A)
  first load   `DefaultModelLoader.load_weights_and_postprocess` on the checkpoint: names yielded, SGLang's own
               warnings (`... not found in params_dict`, `Some weights are not initialized`), sentinel left
  update       `disk`: SGLang's `WeightUpdater.update_weights_from_disk` (restore -> load_weights -> post-process,
               rolled back on failure as SGLang does); `distributed`: `begin_weight_update`, one
               `load_weights_from_distributed` per bucket (the buckets v4rl cut, in order), `end_weight_update`
               (the broadcast itself is left out: the tensors arrive as the bytes v4rl sent)
  compare      the updated model against a fresh build + first load of the update's files, parameter by parameter:
               class, shape, dtype, bytes, `format_ue8m0`, whether it still has a `weight_loader`

Modes (SGLang's post-load paths that run on CPU): `env` holds every SGLANG_* variable of the case (the caller's own
SGLANG_* are cleared at start, so an exported job environment changes nothing), set for the case and removed after;
`wo_a_gemm` is SGLANG_OPT_FP8_WO_A_GEMM (read by models/deepseek_v4.py into `_FP8_WO_A_GEMM` at import; set here
the same way); `ue8m0` is the DeepGEMM path of an sm100 GPU (dense FP8 scales requantized to UE8M0 and packed,
`format_ue8m0` latched).

Stand-ins, each changing no name, shape or value (they only answer what a CPU cannot):
  - `current_platform.get_device()` answers "cpu": SGLang asks it where to put RoPE caches; tensors land on CPU.
  - `model._mhc_prewarmed_at_load = True`: load_weights' last step JIT-compiles mHC kernels for a GPU and touches
    no parameter; the flag is SGLang's own "already done" marker.
  - `ue8m0` mode: deep_gemm_wrapper's ENABLE_JIT_DEEPGEMM / DEEPGEMM_SCALE_UE8M0 set as an sm100 GPU sets them,
    `get_device_sm()` answers 100, and DeepGEMM's `get_mn_major_tma_aligned_packed_ue8m0_tensor` is SGLang's own
    torch port of it (`fp8_utils._get_mn_major_tma_aligned_packed_ue8m0_tensor_torch_impl`).

    python -c <engine bootstrap> sglang_model_probe.py '{"cases": [...]}'   (engines/upstream/sglang_model_check.py)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

for _name in [n for n in os.environ if n.startswith("SGLANG_")]:  # each case sets its own (mode["env"]), never the
    del os.environ[_name]                                          # caller's shell's
os.environ.update({"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
os.environ.setdefault("MASTER_PORT", "29641")

import torch  # noqa: E402

SKIPPED = ("attn_mqa.k_scale", "attn_mqa.v_scale")
"""Parameters SGLang's load_weights itself does not expect from a checkpoint (its `skipped_checking_patterns`)."""
INT_SENTINEL = 0x5A


class Flags:
    deepgemm_runner = False
    """ue8m0 mode: the FP8 linears use DeepGEMM's runner (what Fp8LinearMethod's dispatch picks on an sm100 GPU)."""
CPU = torch.device("cpu")


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


WARNINGS = _Warnings()


# ------------------------------------------------------------------------------------------------ setting up
def setup(server_args: dict[str, Any]) -> None:
    """Single-rank gloo groups and SGLang's runtime context, as SGLang's own layer tests set them up."""
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.platforms import current_platform
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    # device "cuda": the model SGLang builds for the cluster's GPUs (its "cpu" engine is another model path)
    args = ServerArgs(model_path=server_args.pop("model_path"), device="cuda", tp_size=1, **server_args)
    reset_context()
    publish(args, role="test", ranks=SpawnRanks(world_rank=0))
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    initialize_model_parallel(backend="gloo")
    type(current_platform).get_device = lambda self, device_id=None: "cpu"
    logging.getLogger("sglang").addHandler(WARNINGS)


@contextlib.contextmanager
def mode(spec: dict[str, Any]):
    """Select SGLang's post-load path for one case; module globals restored afterwards."""
    from sglang.srt.layers import deep_gemm_wrapper
    from sglang.srt.layers.deep_gemm_wrapper import configurer
    from sglang.srt.layers.quantization import fp8_utils
    from sglang.srt.model_loader import utils as loader_utils
    from sglang.srt.models import deepseek_v4

    saved: list[tuple[Any, str, Any]] = []

    def put(obj: Any, name: str, value: Any) -> None:
        saved.append((obj, name, getattr(obj, name, None)))
        setattr(obj, name, value)

    env = dict(spec.get("env") or {})  # every SGLANG_* of the mode; SGLang reads them when it builds and loads
    os.environ.update(env)
    put(deepseek_v4, "_FP8_WO_A_GEMM", bool(spec.get("wo_a_gemm")))  # read once at import: set as the env says
    if spec.get("ue8m0"):
        for module in (deep_gemm_wrapper, configurer):
            put(module, "ENABLE_JIT_DEEPGEMM", True)
            put(module, "DEEPGEMM_SCALE_UE8M0", True)
        put(loader_utils, "get_device_sm", lambda: 100)
        import deep_gemm.utils as dg_utils  # stub modules (engines/upstream/stubs.py): what SGLang calls, from math
        import deep_gemm.utils.layout as layout

        put(dg_utils, "align", _align)
        put(dg_utils, "get_tma_aligned_size", _tma_aligned_size)
        put(layout, "get_mn_major_tma_aligned_packed_ue8m0_tensor",
            fp8_utils._get_mn_major_tma_aligned_packed_ue8m0_tensor_torch_impl)
        put(Flags, "deepgemm_runner", True)
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)
        for name in env:
            os.environ.pop(name, None)


def _align(x: int, y: int) -> int:
    """DeepGEMM's `utils.align`: x rounded up to a multiple of y."""
    return (x + y - 1) // y * y


def _tma_aligned_size(x: int, element_size: int) -> int:
    """DeepGEMM's `utils.get_tma_aligned_size`: TMA rows are 16-byte aligned."""
    return _align(x, 16 // element_size)


# ---------------------------------------------------------------------------------------- model and loads
def build(checkpoint: str):
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import DefaultModelLoader

    model_config = ModelConfig(checkpoint, trust_remote_code=False)
    loader = DefaultModelLoader(LoadConfig())
    model = loader.initialize_model_for_startup(model_config=model_config, device_config=DeviceConfig("cpu"))
    model._mhc_prewarmed_at_load = True
    _use_deepgemm_runner_if(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not any(s in name for s in SKIPPED):
                _fill_sentinel(p.data)
    return model, loader, model_config


def _use_deepgemm_runner_if(model) -> None:
    """In ue8m0 mode the FP8 linears run DeepGEMM (what Fp8LinearMethod picks on sm100)."""
    if not Flags.deepgemm_runner:
        return
    from sglang.srt.layers.quantization import fp8
    from sglang.srt.layers.quantization.fp8_utils import deepgemm_w8a8_block_fp8_linear_with_fallback

    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, fp8.Fp8LinearMethod):
            method.w8a8_block_fp8_linear = deepgemm_w8a8_block_fp8_linear_with_fallback


def _fill_sentinel(t: torch.Tensor) -> None:
    if t.dtype.is_floating_point and t.element_size() == 1:
        t.view(torch.uint8).fill_(0x7F)  # NaN in float8_e4m3fn
    elif t.dtype.is_floating_point:
        t.fill_(float("nan"))
    else:
        t.fill_(INT_SENTINEL)


def sentinel_left(model) -> list[str]:
    left = []
    for name, p in model.named_parameters():
        if any(s in name for s in SKIPPED):
            continue
        d = p.data
        if d.dtype.is_floating_point and d.element_size() == 1:
            hit = bool((d.view(torch.uint8) == 0x7F).all())
        elif d.dtype.is_floating_point:
            hit = bool(torch.isnan(d.float()).any())
        else:
            hit = bool((d == INT_SENTINEL).all())
        if hit:
            left.append(name)
    return left


def first_load(model, loader, model_config, path: str | None = None) -> dict[str, Any]:
    from sglang.srt.model_loader.loader import DefaultModelLoader

    if path is not None:
        model_config.model_path = path  # SGLang's own update_weights_from_disk re-points it the same way
    yielded: list[str] = []

    def weights():
        for name, tensor in loader._get_weights_iterator(DefaultModelLoader.Source.init_new(model_config, model)):
            yielded.append(name)
            yield name, tensor

    start = len(WARNINGS.messages)
    report: dict[str, Any] = {"ok": True, "error": ""}
    try:
        loader.load_weights_and_postprocess(model, weights(), CPU)
    except Exception as exc:  # the reason is the finding: reported, and the caller asserts on it
        report.update(ok=False, error=_reason(exc))
    said = WARNINGS.messages[start:]
    report.update(yielded=len(yielded), not_found=[m for m in said if "not found in params_dict" in m],
                  not_initialized=[m for m in said if "not initialized from checkpoints" in m],
                  sentinel_left=sentinel_left(model) if report["ok"] else [])
    return report


def weight_updater(model, model_config):
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    return WeightUpdater(tp_rank=0, device="cpu", gpu_id=0, model_config=model_config, custom_weight_loaders={},
                         get_model=lambda: model, update_model_fields=lambda *a, **k: None,
                         recapture_cuda_graph=lambda: None, get_model_runner=lambda: None)


def update(model, model_config, spec: dict[str, Any]) -> dict[str, Any]:
    start = len(WARNINGS.messages)
    result = _update(model, model_config, spec)
    result["not_found"] = [m for m in WARNINGS.messages[start:] if "not found in params_dict" in m]
    return result


def _update(model, model_config, spec: dict[str, Any]) -> dict[str, Any]:
    updater = weight_updater(model, model_config)
    if spec["kind"] == "disk":
        try:
            ok, message = updater.update_weights_from_disk(spec["path"], "auto")
        except Exception as exc:  # SGLang's rollback itself failed: the reason is the finding
            ok, message = False, "the rollback failed too: " + _reason(exc)
        return {"ok": bool(ok), "message": message, "calls": 1}
    from safetensors.torch import load_file

    order = json.loads(Path(spec["buckets"], "buckets.json").read_text())
    updater.begin_weight_update()
    ok, message, calls = True, "", 0
    try:
        for k, names in enumerate(order):
            tensors = load_file(str(Path(spec["buckets"], f"bucket-{k:05d}.safetensors")))
            calls += 1
            ok, message = updater.load_weights_from_distributed([(n, tensors[n]) for n in names])
            if not ok:
                break
    finally:
        updater.end_weight_update(run_post_load=False)  # a load ran, so SGLang skips post_load_weights here
    return {"ok": bool(ok), "message": message, "calls": calls}


# --------------------------------------------------------------------------------------------- comparing
def state(model) -> dict[str, dict[str, Any]]:
    out = {}
    for name, p in model.named_parameters():
        out[name] = {"cls": type(p).__name__, "shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch."),
                     "format_ue8m0": getattr(p, "format_ue8m0", None), "loader": hasattr(p, "weight_loader"),
                     "tensor": p.data.detach().clone()}
    return out


def differences(updated: dict[str, dict[str, Any]], fresh: dict[str, dict[str, Any]]) -> list[str]:
    """'<parameter>: <what differs> (updated vs fresh load)' for each parameter that is not as a fresh load."""
    out = [f"{n}: missing after the update" for n in fresh if n not in updated]
    out += [f"{n}: not in a fresh load" for n in updated if n not in fresh]
    for name in (n for n in fresh if n in updated):
        a, b = updated[name], fresh[name]
        for key in ("cls", "shape", "dtype", "format_ue8m0", "loader"):
            if a[key] != b[key]:
                what = "has a weight_loader" if key == "loader" else key
                out.append(f"{name}: {what} {a[key]} vs {b[key]}")
                break
        else:
            ta, tb = _bytes(a["tensor"]), _bytes(b["tensor"])
            if not torch.equal(ta, tb):
                out.append(f"{name}: values differ ({int((ta != tb).sum())} bytes)")
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def not_restored(checkpoint: str) -> list[str]:
    """Parameters whose layout `restore_weights_before_loading` (what every update starts with) leaves different
    from the layout the loader writes into (a freshly built model): class, shape, dtype or `format_ue8m0`."""
    from sglang.srt.model_loader.loader import DefaultModelLoader

    built, _, _ = build(checkpoint)
    expected = {n: {k: v for k, v in d.items() if k != "tensor"} for n, d in state(built).items()}
    del built
    model, loader, model_config = build(checkpoint)
    if not first_load(model, loader, model_config)["ok"]:
        return []
    DefaultModelLoader.restore_weights_before_loading(model, CPU)
    out = []
    for name, now in state(model).items():
        want = expected.get(name)
        if want is None:
            out.append(f"{name}: not a parameter of a freshly built model")
            continue
        for key in ("cls", "shape", "dtype", "format_ue8m0", "loader"):
            if now[key] != want[key] and not (key == "format_ue8m0" and not now[key] and not want[key]):
                what = "has a weight_loader" if key == "loader" else key
                out.append(f"{name}: {what} {now[key]} after restore, {want[key]} when built")
                break
    return out


def dump(model, path: str) -> None:
    """Every parameter as SGLang holds it (safetensors, written to a temporary name and renamed)."""
    from safetensors.torch import save_file

    tensors = {n: p.data.detach().contiguous().clone() for n, p in model.named_parameters()}
    tmp = path + ".partial"
    save_file(tensors, tmp)
    os.replace(tmp, path)


def _reason(exc: BaseException) -> str:
    """The exception and the innermost SGLang frame it came from (what a user must look at)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "sglang" in f.filename]
    where = f" [{Path(frames[-1].filename).name}:{frames[-1].lineno} {frames[-1].name}]" if frames else ""
    text = f"{type(exc).__name__}: {exc}".strip()
    notes = getattr(exc, "__notes__", None)
    if notes:
        text += " (" + "; ".join(notes) + ")"
    return text + where


# ------------------------------------------------------------------------------------------------ a case
def run_case(case: dict[str, Any]) -> dict[str, Any]:
    start = time.monotonic()
    result: dict[str, Any] = {"name": case["name"]}
    try:
        return _run_case(case, result)
    finally:
        result["seconds"] = round(time.monotonic() - start, 2)


def _run_case(case: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    with mode(case.get("mode", {})):
        try:
            model, loader, model_config = build(case["base"])
        except Exception as exc:
            result["build"] = {"ok": False, "error": _reason(exc)}
            return result
        result["first_load"] = first_load(model, loader, model_config)
        if not result["first_load"]["ok"]:
            return result
        if case.get("dump"):
            dump(model, case["dump"])
        spec = case.get("update")
        if spec is None:
            return result
        result["not_restored"] = not_restored(case["base"])
        result["update"] = update(model, model_config, spec)
        if not result["update"]["ok"]:
            return result
        updated = state(model)
        del model
        fresh_model, fresh_loader, fresh_config = build(case["base"])
        fresh = first_load(fresh_model, fresh_loader, fresh_config, spec["path"])
        if not fresh["ok"]:
            result["fresh_load"] = fresh
            return result
        result["differences"] = differences(updated, state(fresh_model))
    return result


def main() -> None:
    spec = json.loads(sys.argv[1])
    start = time.monotonic()
    setup(dict(spec.get("server_args") or {"model_path": spec["cases"][0]["base"]}))
    setup_seconds = round(time.monotonic() - start, 2)
    results = [run_case(case) for case in spec["cases"]]
    print("PROBE " + json.dumps({"cases": results, "setup_seconds": setup_seconds}), flush=True)


if __name__ == "__main__":
    main()
