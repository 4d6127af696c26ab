"""Builds Miles' OWN DeepSeek-V4 Megatron model on CPU (or the meta device) and reports on it. Never imported by v4rl.

The body of a subprocess started by engines/upstream/miles_model_check.py (engines.upstream.sources.engine_python):
Megatron-LM first on sys.path, then Miles and SGLang's source, with `probes/standins/` (TransformerEngine's
module structure) ahead of them and GPU-only modules stubbed where their import fails. It runs, in order:

  1. Miles' own `parse_args` on `argv` (the model flags v4rl derives from config.json + a CPU training setup),
     with torch.cuda's device queries answering as the target accelerator;
  2. single-rank gloo + Miles' `_initialize_distributed` (Megatron's parallel state), Megatron's `get_model` on
     Miles' model provider and `--spec` (on the meta device when `meta`; the GPU materialisation is skipped);
  3. `keys`: `sharded_state_dict()` -> {key: [global shape, dtype]} of every ShardedTensor, and the TE
     `_extra_state` objects listed apart;
  4. for each of `load_dirs`: every parameter and buffer filled with a sentinel, then Miles' own
     `load_checkpoint` on that dir (release or numbered layout); the names still at the sentinel and every stdout
     line saying `will skip` are reported;
  5. `forward` (after the loads, with the numeric kernel stand-ins of `kernels` installed, a module path such as
     numeric_standins.py beside this file): one forward of `tokens`, per-layer sub-block outputs captured by
     forward hooks (forward_hooks.py) and the fp32 logits saved to `out_dir/forward-clean.pt`; then for each of
     `faults` ({"name", "param": a parameter-name suffix, "op": roll | swap | swap_with | zero | negate,
     "index", "other"}) the same forward with that one parameter changed, saved to `out_dir/forward-<name>.pt`.

The request is a JSON file (keys above); the answer is one JSON line after the marker line.

    python model_probe.py request.json
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

MARKER = "=== v4rl model probe ==="
SENTINEL = 12345.0
"""A value no loaded weight has (bf16 represents it exactly): whatever still holds it after a load was not loaded."""


# ------------------------------------------------------------------------------------------- CPU set-up
def patch_device(device: dict) -> None:
    """Answer torch.cuda's queries as the target accelerator, and send CUDA tensor factories to the CPU.

    Megatron asks the device what it is (validate_args, capability checks) and allocates some tensors with
    `device=torch.cuda.current_device()`; on a CPU machine those tensors live on the CPU instead.
    """
    import torch

    props = type("DeviceProperties", (), {"name": device["name"], "total_memory": int(device["total_memory"]),
                                          "major": device["capability"][0], "minor": device["capability"][1],
                                          "multi_processor_count": device.get("multi_processor_count", 0)})
    torch.cuda.get_device_capability = lambda *a, **k: tuple(device["capability"])
    torch.cuda.get_device_properties = lambda *a, **k: props()
    torch.cuda.get_device_name = lambda *a, **k: device["name"]
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.device_count = lambda: 1
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.is_current_stream_capturing = lambda: False  # no CUDA graphs on a CPU (Megatron's p2p asks, PP > 1)
    torch.cuda.manual_seed = lambda *a, **k: None
    torch.cuda.manual_seed_all = lambda *a, **k: None
    import torch._dynamo

    torch._dynamo.config.disable = True  # torch.compile'd helpers run eagerly (Inductor needs Triton, a GPU compiler)
    torch.cuda.nvtx.range_push = lambda *a, **k: None  # profiler ranges: nothing to mark on a CPU
    torch.cuda.nvtx.range_pop = lambda *a, **k: None
    torch.cuda.nvtx.range = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.Stream = _HostStream
    torch.cuda.Event = _HostEvent
    torch.cuda.current_stream = lambda *a, **k: _HostStream()
    torch.cuda.default_stream = lambda *a, **k: _HostStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.Tensor.record_stream = lambda self, *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self

    def on_cpu(factory):
        def made(*args, **kwargs):
            dev = kwargs.get("device")
            if dev is not None and (isinstance(dev, int) or "cuda" in str(dev)):
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)
        return made

    for name in ("empty", "zeros", "ones", "full", "arange", "tensor", "rand", "randn", "randint", "empty_like",
                 "zeros_like", "ones_like", "full_like", "as_tensor", "linspace", "eye"):
        setattr(torch, name, on_cpu(getattr(torch, name)))
    to = torch.Tensor.to

    def to_cpu(self, *args, **kwargs):
        args = tuple("cpu" if (isinstance(a, torch.device) and a.type == "cuda") or
                     (isinstance(a, str) and a.startswith("cuda")) else a for a in args)
        if "device" in kwargs and "cuda" in str(kwargs["device"]):
            kwargs["device"] = "cpu"
        return to(self, *args, **kwargs)

    torch.Tensor.to = to_cpu


class _HostStream:
    """A CUDA stream on a CPU machine: work is already in order, so waiting and recording do nothing."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event or _HostEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _HostEvent(_HostStream):
    """A CUDA event on a CPU machine (already complete)."""

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass


def init_single_rank(tmp: str) -> None:
    """A one-process gloo group through a file store (no port)."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)


def parse(argv: list[str], cache: str | None = None):
    """Miles' own parse_args on argv (Megatron's parser + Miles' arguments + both validations).

    `cache`: a pickle of the namespace parse_args returned for the same argv and trees (written when absent):
    parsing imports SGLang and takes most of a build's time, and several builds of one model share it."""
    import pickle

    if cache and Path(cache).is_file():
        cached = pickle.loads(Path(cache).read_bytes())
        if cached["argv"] == argv:
            return cached["args"]
    sys.argv = ["train.py", *argv]
    from miles.utils.arguments import parse_args

    args = parse_args()
    if cache:
        tmp = Path(cache).with_suffix(".partial")
        tmp.write_bytes(pickle.dumps({"argv": argv, "args": args}))
        os.replace(tmp, cache)
    return args


def build(args, *, meta: bool):
    """Megatron's get_model over Miles' model provider (the --spec), without DDP; meta stays meta."""
    import megatron.training.training as training
    from megatron.core.enums import ModelType
    from megatron.training.global_vars import set_args

    from miles.backends.megatron_utils import initialize
    from miles.backends.megatron_utils.model_provider import get_model_provider_func

    set_args(args)
    initialize._initialize_distributed(args)
    from megatron.core import tensor_parallel

    import torch
    import megatron.core.tensor_parallel.random as megatron_random

    # Megatron keeps per-parallel-group CUDA RNG states; on the CPU they are CPU generator states.
    megatron_random._set_cuda_rng_state = lambda state, device=-1, graph_safe=False: torch.set_rng_state(state)
    megatron_random._get_cuda_rng_state = lambda device=None, clone=False, graph_safe=False: torch.get_rng_state()
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    if meta:  # get_model materialises a meta model on the GPU; here it stays on the meta device
        training.to_empty_if_meta_device = lambda module, device=None: module
    return training.get_model(get_model_provider_func(args), ModelType.encoder_or_decoder, wrap_with_ddp=False)


# ------------------------------------------------------------------------------------------------- reports
def sharded_keys(model) -> dict:
    """{key: [global shape, dtype]} of the ShardedTensors the model asks a checkpoint for; objects apart."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories

    sd = model[0].sharded_state_dict()
    apply_factories(sd)  # e.g. linear_fc1 -> its gate and up chunks, as the loader sees them
    tensors, objects = {}, []
    for value in nested_values(sd):
        if isinstance(value, ShardedTensor):
            tensors[value.key] = [list(value.global_shape), str(value.dtype).replace("torch.", "")]
        elif isinstance(value, ShardedObject):
            objects.append(value.key)
        else:
            tensors.setdefault(getattr(value, "key", repr(type(value))), ["?", type(value).__name__])
    params = sum(p.numel() for p in model[0].parameters())
    return {"tensors": tensors, "objects": sorted(set(objects)), "parameters": int(params)}


def load_and_check(model, args, load_dir: str) -> dict:
    """Sentinel everywhere, then Miles' own load_checkpoint; what stayed at the sentinel and what it skipped."""
    import torch

    from miles.backends.megatron_utils.checkpoint import load_checkpoint

    module = model[0]
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.is_floating_point():
                tensor.fill_(SENTINEL)
            elif tensor.dtype in (torch.int32, torch.int64):
                tensor.fill_(int(SENTINEL))
    args.load = load_dir
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        iteration, _ = load_checkpoint(model, None, None, checkpointing_context={}, skip_load_to_model_and_opt=False)
    text = log.getvalue()
    sys.stderr.write(text[-20000:])
    at_sentinel, partly = [], {}
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if tensor.numel() and (tensor.is_floating_point() or tensor.dtype in (torch.int32, torch.int64)):
            left = int((tensor.double() == SENTINEL).sum())
            if left == tensor.numel():
                at_sentinel.append(name)
            elif left:
                partly[name] = left
    skipped = [line.strip() for line in text.splitlines() if "will skip" in line]
    return {"iteration": int(iteration), "at_sentinel": at_sentinel, "partly_at_sentinel": partly,
            "will_skip": skipped,
            "loaded_params": sum(1 for _ in module.parameters()) - len(at_sentinel)}


def forward(model, tokens: list[list[int]], path: Path) -> str:
    """One forward with per-layer sub-block outputs captured by hooks; saved as `path` (trace + fp32 logits)."""
    import torch

    from forward_hooks import capture  # probes/forward_hooks.py, beside this file

    module = model[0]
    module.eval()
    ids = torch.tensor(tokens, dtype=torch.long)
    B, S = ids.shape
    position_ids = torch.arange(S).unsqueeze(0).expand(B, S)
    with torch.no_grad(), capture(getattr(module, "module", module), B, S) as trace:
        logits = module(input_ids=ids, position_ids=position_ids, attention_mask=None)
    saved = {"trace": trace, "logits": logits.float()}
    try:  # Miles' own logprob computation (its training loss reads these), on the full (padded) vocab width
        import torch.distributed as dist

        from miles.backends.training_utils.loss_hub.math_utils import calculate_log_probs_and_entropy

        saved["miles_logprobs"] = calculate_log_probs_and_entropy(
            logits[0, :-1].float(), ids[0, 1:], dist.group.WORLD)[0].float()
    except Exception as exc:  # recorded, not hidden: the caller then computes logprobs from the logits
        saved["miles_logprobs_error"] = f"{type(exc).__name__}: {exc}"
    torch.save(saved, path)
    return str(path)


def plant(module, fault: dict):
    """Change one loaded parameter as a fault would (the checkpoint Miles loads differs there); returns undo."""
    import torch

    params = dict(module.named_parameters())
    matches = [n for n in params if n.endswith(fault["param"])]
    if len(matches) != 1:
        raise KeyError(f"fault {fault['name']}: parameter ending {fault['param']!r} matches {matches}")
    param = params[matches[0]]
    saved = param.detach().clone()
    with torch.no_grad():
        if fault["op"] == "roll":  # e.g. the hash table shifted by one token
            param.copy_(torch.roll(saved, shifts=1, dims=0))
        elif fault["op"] == "swap":  # two entries of a small vector exchanged (e.g. mHC alphas)
            i, j = fault["index"]
            value = saved.clone()
            value[i], value[j] = saved[j], saved[i]
            param.copy_(value)
        elif fault["op"] == "swap_with":  # two one-element parameters exchanged (Megatron's split mHC alphas)
            other = params[[n for n in params if n.endswith(fault["other"])][0]]
            other_saved = other.detach().clone()
            param.copy_(other_saved)
            other.copy_(saved)
        elif fault["op"] == "zero":
            param.zero_()
        elif fault["op"] == "negate":
            param.copy_(-saved)
        else:
            raise ValueError(f"fault {fault['name']}: unknown op {fault['op']!r}")

    def undo():
        with torch.no_grad():
            param.copy_(saved)
            if fault["op"] == "swap_with":
                other.copy_(other_saved)
    return undo


_T0 = None


def _mark(what: str) -> None:
    """Stage timings on stderr (the caller shows them when a build is slow)."""
    import time

    global _T0
    _T0 = _T0 or time.time()
    sys.stderr.write(f"[model_probe] {what} at {time.time() - _T0:.1f}s\n")


def probe(request: dict) -> dict:
    answer: dict = {"ok": False, "stage": "import"}
    with tempfile.TemporaryDirectory(prefix="v4rl-model-probe-") as tmp:
        try:
            patch_device(request["device"])
            init_single_rank(tmp)
            kernels: dict = {}
            if request.get("kernels"):  # numeric stand-ins of the GPU kernels (forwards only)
                import runpy

                kernels = runpy.run_path(request["kernels"], run_name="numeric_standins")
            answer["stage"] = "parse"
            _mark("start")
            args = parse(request["argv"], request.get("args_cache"))
            _mark("parsed")
            answer["stage"] = "build"
            model = build(args, meta=bool(request.get("meta")))
            _mark("built")
            if "patch_miles_kernels" in kernels:
                answer["patched_kernels"] = kernels["patch_miles_kernels"]()
            answer["padded_vocab_size"] = int(args.padded_vocab_size)
            if "keys" in request["do"]:
                answer["stage"] = "keys"
                answer["keys"] = sharded_keys(model)
            answer["loads"] = []
            for load_dir in request.get("load_dirs", []):
                answer["stage"] = f"load {load_dir}"
                try:
                    answer["loads"].append({"dir": load_dir, **load_and_check(model, args, load_dir)})
                except Exception as exc:  # Miles refusing the checkpoint (its own guard) is check (b)'s outcome
                    answer["loads"].append({"dir": load_dir, "refused": f"{type(exc).__name__}: {exc}",
                                            "at_sentinel": [], "will_skip": []})
            answer["built_and_loaded"] = True  # keys and loads are in; a forward failure below leaves them
            refused = [load["dir"] for load in answer["loads"] if "refused" in load]
            if "forward" in request["do"] and refused:
                answer["forward_skipped"] = f"not run: Miles refused to load {refused[0]}"
            elif "forward" in request["do"]:
                answer["stage"] = "forward"
                out = Path(request["out_dir"])
                answer["forwards"] = {"clean": forward(model, request["tokens"], out / "forward-clean.pt")}
                module = getattr(model[0], "module", model[0])
                for fault in request.get("faults", []):
                    answer["stage"] = f"forward with fault {fault['name']}"
                    undo = plant(module, fault)
                    try:
                        answer["forwards"][fault["name"]] = forward(model, request["tokens"],
                                                                    out / f"forward-{fault['name']}.pt")
                    finally:
                        undo()
            answer["ok"] = True
        except BaseException as exc:  # report every failure with its stage; the caller names the fix
            answer["error"] = f"{type(exc).__name__}: {exc}"
            answer["traceback"] = traceback.format_exc()[-6000:]
    return answer


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    with open(sys.argv[1]) as f:
        req = json.load(f)
    result = probe(req)
    stubs = sys.modules.get("engine_stubs")
    result["stubbed"] = sorted(set(getattr(stubs, "STUBBED", [])))
    print(MARKER)
    print(json.dumps(result))
