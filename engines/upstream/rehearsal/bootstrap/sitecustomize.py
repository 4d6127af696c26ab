"""Loaded by every Python process of a rehearsal (Miles' driver, Ray's workers, Miles' actors) because this folder
is first on their PYTHONPATH: the CPU stand-ins, injected from outside, so that Miles' files run unmodified.

  - GPU-only imports (sgl_kernel, flashinfer, transformer_engine, ...) resolve to stubs (engines/upstream/stubs.py),
    plus `sglang.srt.entrypoints.openai.encoding_dsv4` (Miles' own SGLang branch has it, upstream 0.5.23 lacks it);
  - SGLang 0.5.23's ServerArgs is a msgspec Struct and Miles calls `dataclasses.fields()` on it (Miles' SGLang
    branch has a dataclass): `dataclasses.fields` answers for a Struct with its fields;
  - names Miles imports from its own SGLang branch that upstream 0.5.23 lacks get placeholders (MILES_SGLANG_NAMES);
  - Megatron's validate_args asks the accelerator for its capability: answered as V4RL_REHEARSAL_DEVICE says.
Only the standard library is imported here; the patches apply when their module is first imported.
"""

import importlib.abc
import importlib.util
import json
import os
import sys

import dataclasses

_STUBS = os.environ.get("V4RL_ENGINE_STUBS")
if _STUBS:
    _spec = importlib.util.spec_from_file_location("engine_stubs", _STUBS)
    _stubs = importlib.util.module_from_spec(_spec)
    sys.modules["engine_stubs"] = _stubs
    _spec.loader.exec_module(_stubs)
    _stubs.activate(json.loads(os.environ.get("V4RL_STUB_ROOTS") or "null") or _stubs.GPU_ONLY_ROOTS)


def _struct_fields(real_fields):
    """`dataclasses.fields` that also answers for a msgspec Struct (SGLang 0.5.23's ServerArgs): its fields."""

    def fields(class_or_instance):
        if not hasattr(class_or_instance, "__dataclass_fields__") and hasattr(class_or_instance, "__struct_fields__"):
            import msgspec

            return tuple(msgspec.structs.fields(class_or_instance))
        return real_fields(class_or_instance)

    return fields


def _answer_device(_module):
    import torch

    device = json.loads(os.environ.get("V4RL_REHEARSAL_DEVICE") or "{}")
    if not device:
        return
    props = type("DeviceProperties", (), {"name": device["name"], "total_memory": int(device["total_memory"]),
                                          "major": device["capability"][0], "minor": device["capability"][1],
                                          "multi_processor_count": 0})
    torch.cuda.get_device_capability = lambda *a, **k: tuple(device["capability"])
    torch.cuda.get_device_properties = lambda *a, **k: props()


MILES_SGLANG_NAMES = {
    "sglang.srt.distributed.parallel_state": ("ParallelismContext", "RankParallelismConfig"),
}
"""Names Miles imports from its own SGLang branch (sglang-miles) that upstream SGLang 0.5.23's modules lack; Miles
uses them only for its P2P weight transfer (not the broadcast a rehearsal runs), so placeholders suffice."""


def _add_miles_sglang_names(module):
    for name in MILES_SGLANG_NAMES[module.__name__]:
        if not hasattr(module, name):
            setattr(module, name, type(name, (), {"__module__": module.__name__, "__doc__": "placeholder (v4rl)"}))


def _place_idle_actor(module):
    """Miles defect (both vendored generations, miles/ray/placement_group.py `_get_placement_group_layout`): with
    --rollout-external it reserves no rollout bundle ((0, 0) with --debug-rollout-only, (actor, actor) otherwise:
    the rollout bundles start past the last one), yet RolloutServerGroup.start_engines places one SGLangEngine
    actor per external engine (0.2 GPU, ray/rollout/server_group.py:91) into a rollout bundle, and with
    --debug-rollout-only create_training_models still places the idle actor (ray/train/actor_factory.py:89):
    IndexError before any rollout. The rehearsal lets Miles' SGLangEngine actors share the actor's logical GPUs.
    Applied only where V4RL_REHEARSAL_WORKAROUNDS names it and this Miles has the function; the substitution table
    lists it."""
    real = getattr(module, "_get_placement_group_layout", None)
    if real is None:  # a Miles without the defective function (e.g. the seed's PR-head): nothing to work around
        return

    def layout(args):
        if args.rollout_external and not args.debug_train_only:
            # (bundles, rollout offset): the actor's GPUs, shared by Miles' SGLangEngine actors
            return args.actor_num_nodes * args.actor_num_gpus_per_node, 0
        return real(args)

    module._get_placement_group_layout = layout


def _bucket_for_converter(module):
    """Miles defect (e9e19b223, miles/backends/megatron_utils/update_weight/update_weight_from_distributed/mixin.py
    `_gather_and_update_non_expert_weights`, line 124): the broadcast update converts each gathered parameter with
    `convert_to_hf(...)` but no `bucket`, while DeepSeek-V4's converter packs a hyper-connection site's three alphas
    from that bucket (megatron_to_hf/deepseekv4.py `_packed_alphas`: TypeError 'NoneType' object is not
    subscriptable at line 55, in the very first broadcast). The tensor update path passes it
    (hf_weight_iterator_direct.py: the atomic update group's params). The rehearsal gives the broadcast path the same
    bucket: the update unit just gathered (`_all_gather_update_unit`, which keeps an atomic group together).
    Applied only where V4RL_REHEARSAL_WORKAROUNDS names it; the substitution table lists it."""
    import inspect

    mixin = getattr(module, "DistBucketedWeightUpdateMixin", None)
    if mixin is None or not hasattr(mixin, "_all_gather_update_unit"):
        return
    if "bucket" not in inspect.signature(module.convert_to_hf).parameters:
        return  # 31f1ca961: convert_to_hf has no bucket parameter, its converter packs nothing from one
    real_gather, real_convert, unit = mixin._all_gather_update_unit, module.convert_to_hf, {}

    def gather(self, update_unit):
        gathered, size = real_gather(self, update_unit)
        unit.clear()
        unit.update(gathered)
        return gathered, size

    def convert(args, model_name, name, param, quantization_config=None, bucket=None):
        if bucket is None and name in unit:
            bucket = dict(unit)
        return real_convert(args, model_name, name, param, quantization_config, bucket=bucket)

    mixin._all_gather_update_unit, module.convert_to_hf = gather, convert


def _cpu_device(_module):
    """Miles' train actor (even the idle one of --debug-rollout-only) sets its CUDA device and allocates on it: the
    model probes' stand-in (engines/upstream/probes/model_probe.py `patch_device`) answers as the cluster's
    accelerator and sends CUDA tensor factories to the CPU."""
    probe = os.environ.get("V4RL_REHEARSAL_DEVICE_PATCH")
    device = json.loads(os.environ.get("V4RL_REHEARSAL_DEVICE") or "{}")
    if probe and device:
        spec = importlib.util.spec_from_file_location("v4rl_model_probe", probe)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.patch_device(device)
        _empty_device_memory(int(device["total_memory"]))
    kernels = os.environ.get("V4RL_REHEARSAL_KERNELS")
    if kernels:  # stage train: the GPU kernels' math (numeric_standins.py) before Miles imports its model
        import runpy

        runpy.run_path(kernels, run_name="numeric_standins")
        _cuda_tensor_types()


def _cuda_tensor_types() -> None:
    """Megatron's mixed-precision optimizers accept only parameters whose `tensor.type()` names a CUDA type
    (core/optimizer/distrib_optimizer.py, optimizer.py: 'torch.cuda.BFloat16Tensor', ...); the device stand-in keeps
    "CUDA" tensors on the CPU, so a CPU tensor names the CUDA type it stands for. Calls with a type still convert."""
    import torch

    real = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        name = real(self, dtype, non_blocking, **kwargs)
        if dtype is None and self.device.type == "cpu" and name.startswith("torch.") and "cuda" not in name:
            return "torch.cuda." + name[len("torch."):]
        return name

    torch.Tensor.type = type_


def _empty_device_memory(total: int) -> None:
    """Miles' actor logs its memory around clear_memory (miles/utils/memory_utils.py print_memory): answer as an
    empty device of the cluster's size. Not a measurement: a rehearsal has no HBM (docs/rehearsal.md)."""
    import torch

    torch.cuda.mem_get_info = lambda *a, **k: (total, total)
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
        setattr(torch.cuda, name, lambda *a, **k: 0)


def _cpu_rng(module):
    """Megatron keeps per-parallel-group CUDA RNG states; on a CPU they are the CPU generator's (as the probes do)."""
    import torch

    module._set_cuda_rng_state = lambda state, device=-1, graph_safe=False: torch.set_rng_state(state)
    module._get_cuda_rng_state = lambda device=None, clone=False, graph_safe=False: torch.get_rng_state()
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)


def _in_process_store(module):
    """A one-rank process group (Miles' idle train actor) rendezvouses through an in-process HashStore instead of
    the env:// TCPStore, whose server PyTorch binds to every interface with no option to choose one: nothing of
    a rehearsal listens beyond 127.0.0.1. The actor's ranks of a multi-rank layout (job.py LAYOUTS) rendezvous
    through a FileStore under V4RL_REHEARSAL_STORE_DIR (one file per MASTER_ADDR:MASTER_PORT, the address Miles
    gave the ranks); other env:// groups of more ranks, and every group given its own store or address (Miles'
    weight-update group with the engine: tcp://), keep theirs."""
    real = module.init_process_group

    def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None,
                           *args, **kwargs):
        size = world_size if world_size != -1 else int(os.environ.get("WORLD_SIZE", "-1"))
        if store is None and init_method in (None, "env://") and size >= 1:
            import torch.distributed as dist  # complete by the time a group is made

            store_dir = os.environ.get("V4RL_REHEARSAL_STORE_DIR")
            if size == 1:
                store, rank, world_size = dist.HashStore(), 0, 1
            elif store_dir:
                os.makedirs(store_dir, exist_ok=True)
                name = f"{os.environ['MASTER_ADDR']}-{os.environ['MASTER_PORT']}"
                rank = rank if rank != -1 else int(os.environ["RANK"])
                store, world_size = dist.FileStore(os.path.join(store_dir, name), size), size
        return real(backend, None if store is not None else init_method, timeout, world_size, rank, store,
                    *args, **kwargs)

    module.init_process_group = init_process_group
    _split_sizes_as_ints(module)


def _split_sizes_as_ints(module):
    """Megatron's MoE all-to-all (tensor_parallel/mappings.py _AllToAll, from the alltoall token dispatcher with
    EP > 1) passes its split sizes as CPU tensors; the torch of Miles' images takes any sequence of ints there,
    this machine's torch 2.13 binding only ints (TypeError: all_to_all_single(): incompatible function arguments).
    The same sizes as Python ints; the tensors exchanged are unchanged."""
    real = module.all_to_all_single

    def ints(sizes):
        return sizes.tolist() if hasattr(sizes, "tolist") else sizes

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        return real(output, input, ints(output_split_sizes), ints(input_split_sizes), *args, **kwargs)

    module.all_to_all_single = all_to_all_single


TORCH_RENAMED_COLLECTIVES = ("all_gather_single", "all_gather_single_coalesced", "reduce_scatter_single",
                             "reduce_scatter_single_coalesced", "all_to_all_single")
"""ProcessGroup methods this machine's torch (2.13) calls for all_gather_into_tensor, reduce_scatter_tensor and
all_to_all_single, where the torch of Miles' images calls _allgather_base, _reduce_scatter_base, alltoall_base."""


def _forward_renamed_collectives(module):
    """Miles wraps every non-gloo process group of more than one rank in its ReloadableProcessGroup
    (miles/utils/reloadable_process_group.py: a bare ProcessGroup subclass that forwards each collective method to
    the real group by name). It forwards the older torch's method names; torch 2.13 (this venv's) calls renamed ones
    (TORCH_RENAMED_COLLECTIVES), which then hit the bare base class: `No backend type associated with device type
    cpu`, first in Megatron's MoE dispatcher (token_dispatcher.py:587). The same forwarding, for the new names;
    the groups, their members and what is sent are Miles' and Megatron's. Only layouts of more than one rank wrap
    groups (a one-rank group stays bare): the substitution table lists it there."""
    cls = getattr(module, "ReloadableProcessGroup", None)
    if cls is None or not hasattr(cls, "_fwd"):
        return
    for name in TORCH_RENAMED_COLLECTIVES:
        if name not in vars(cls):
            setattr(cls, name, lambda self, *a, _name=name, **kw: self._fwd(_name, *a, **kw))


ROUTER_READY_TIMEOUT_S = 300
"""Seconds Miles waits for the sglang-router it spawns to accept connections (Miles: 30)."""


def _patient_router_start(module):
    """Miles spawns its sglang-router in a fresh interpreter (multiprocessing spawn) and gives it 30 s to listen
    (miles/ray/rollout/router_manager.py start_router: wait_for_server_ready(..., timeout=30)). On 2 shared cores,
    with 4 actor ranks importing torch and Megatron at the same moment (--layout pp2-ep2), the spawned interpreter
    took longer: `Server at 127.0.0.1:<port> not ready after 30s`, twice. The same wait (a dead router still fails
    at once), ROUTER_READY_TIMEOUT_S long; nothing else of the start changes."""
    real = getattr(module, "wait_for_server_ready", None)
    if real is None:  # a Miles that waits for its router otherwise
        return

    def wait_for_server_ready(host, port, process=None, timeout=30):
        return real(host, port, process, timeout=max(timeout, ROUTER_READY_TIMEOUT_S))

    module.wait_for_server_ready = wait_for_server_ready


def _skip_dashboard_columns(module):
    """--save-debug-rollout-data also writes a parquet mirror for Miles' dashboard through polars; the polars of
    SGLang 0.5.23's dependency folder lacks its compiled runtime (`pl.DataFrame`: NameError PyDataFrame, at
    miles/ray/rollout/debug_data.py:55) and the dump Miles trains from is written after it. Miles' own path for
    a machine without polars (its ImportError branch: no parquet, the .pt still written) is taken instead."""
    module.save_dashboard_columns = lambda samples, path: None


def _record_broadcasts(module):
    """Stage full: what Miles' actor broadcasts into the engine, recorded from outside for the weight check. Miles'
    own `update_weights_from_distributed` (its broadcast of one bucket of converted HF tensors) is wrapped to keep
    a CPU copy of every tensor before it is sent; after each whole update (UpdateWeightFromDistributed
    .update_weights: pause, every bucket, end_weight_update, continue) the copies are written to
    V4RL_REHEARSAL_BROADCASTS/broadcast-v<version>.safetensors, beside the engine's own checksums of its runtime
    tensors asked right then (`/weights_checker` checksum, before Miles generates again) in broadcast-v<version>.json.
    Miles' files and what it sends are unchanged; only the rank that sends records."""
    out, engine = os.environ["V4RL_REHEARSAL_BROADCASTS"], os.environ["V4RL_REHEARSAL_ENGINE_URL"]
    real_send, sent = module.update_weights_from_distributed, {}

    def send(group_name, group, weight_version, rollout_engines, converted_named_tensors, *args, **kwargs):
        for name, tensor in converted_named_tensors:
            sent[name] = tensor.detach().to("cpu", copy=True).contiguous()
        return real_send(group_name, group, weight_version, rollout_engines, converted_named_tensors, *args, **kwargs)

    module.update_weights_from_distributed = send
    real_update = module.UpdateWeightFromDistributed.update_weights

    def update_weights(self, *args, **kwargs):
        sent.clear()
        result = real_update(self, *args, **kwargs)
        if sent:
            _write_broadcast(out, engine, self.weight_version, dict(sent), *_pipeline_stage())
        sent.clear()
        return result

    module.UpdateWeightFromDistributed.update_weights = update_weights


def _gloo_weight_group(module):
    """Stage full: Miles opens its weight-update group with the engines as `nccl` (miles/utils/distributed_utils.py
    init_process_group, from update_weight_from_distributed/broadcast.py); on a CPU it is gloo, as v4rl's engine
    runs its side (engines/rollout/distributed_update.py). gloo has no float8 type, so a float8 tensor (FP8 weights,
    UE8M0 scales) travels as its bytes, as the engine receives it (launcher.wire_view): never a value change."""
    import torch
    import torch.distributed as dist

    real_init, real_broadcast = module.init_process_group, dist.broadcast

    def init_process_group(backend=None, *args, **kwargs):
        return real_init("gloo" if str(backend).lower() == "nccl" else backend, *args, **kwargs)

    def broadcast(tensor, *args, **kwargs):
        if tensor.dtype.is_floating_point and tensor.element_size() == 1:
            tensor = tensor.view(torch.uint8)
        return real_broadcast(tensor, *args, **kwargs)

    module.init_process_group, dist.broadcast = init_process_group, broadcast


def _fp8_cast_in_torch(module):
    """Stage full: Miles quantizes each weight it broadcasts to the checkpoint's FP8 blocks with a triton kernel
    (miles/utils/fp8_kernel.py `_blockwise_cast_to_fp8_triton`: no triton on a CPU). The same math in torch, from
    the kernel: per (BLOCK_M, BLOCK_N) block, scale = max(amax, 1e-10) / 448 (fp32), q = clamp(x * (1 / scale),
    -448, 448) cast to float8_e4m3fn; returns (q, scale) shaped as the kernel's."""
    import torch

    def blockwise_cast_to_fp8(x, block_size=None):
        bm, bn = (block_size[0], block_size[1]) if block_size else (128, 128)
        m, n = x.shape
        rows, cols = -(-m // bm), -(-n // bn)
        padded = torch.zeros(rows * bm, cols * bn, dtype=torch.float32, device=x.device)
        padded[:m, :n] = x.float()
        blocks = padded.view(rows, bm, cols, bn)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-10) / module.fp8_max
        inv = 1.0 / scale
        q = (blocks * inv[:, None, :, None]).clamp(module.fp8_min, module.fp8_max).to(torch.float8_e4m3fn)
        return q.view(rows * bm, cols * bn)[:m, :n].contiguous(), scale

    module.blockwise_cast_to_fp8_triton = blockwise_cast_to_fp8


BROADCAST_CHECKSUM_TIMEOUT_S = 300
"""Seconds the engine may take to checksum its runtime tensors after a broadcast (a tiny model: well under one)."""


BROADCAST_PARTS_TIMEOUT_S = 300
"""Seconds the first pipeline stage's recorder waits for the other stages' parts of the same broadcast."""


def _pipeline_stage():
    """(this rank's pipeline stage, the number of stages): with PP > 1 each stage's source rank broadcasts its own
    layers into the engine (Miles' group miles-pp_<stage>), so each records its own part."""
    from megatron.core import parallel_state as mpu

    return mpu.get_pipeline_model_parallel_rank(), mpu.get_pipeline_model_parallel_world_size()


def _write_broadcast(out, engine, version, sent, stage=0, stages=1):
    """Stage `stage`'s part of broadcast `version` (broadcast-v<version>.safetensors, with PP > 1
    broadcast-v<version>.pp<stage>.safetensors); stage 0 then waits for every other stage's part and writes the
    record (broadcast-v<version>.json: the parts and the engine's checksums, asked once all stages have sent:
    Miles' update_weights ends with a barrier of all ranks)."""
    import time
    import urllib.request

    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"broadcast-v{version}")
    parts = [stem + (f".pp{i}" if stages > 1 else "") + ".safetensors" for i in range(stages)]
    save_file(sent, parts[stage] + ".tmp")
    os.replace(parts[stage] + ".tmp", parts[stage])
    if stage != 0:
        return
    deadline = time.monotonic() + BROADCAST_PARTS_TIMEOUT_S
    while not all(os.path.exists(part) for part in parts):
        if time.monotonic() > deadline:
            raise TimeoutError(f"broadcast v{version}: the other pipeline stages' parts never came ({parts})")
        time.sleep(0.2)
    request = urllib.request.Request(engine + "/weights_checker", data=json.dumps({"action": "checksum"}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=BROADCAST_CHECKSUM_TIMEOUT_S) as reply:
        ranks = json.load(reply)["ranks"]
    record = {"version": int(version), "tensors": [os.path.basename(part) for part in parts],
              "engine_checksums": ranks[0]["checksums"]}
    with open(stem + ".json.tmp", "w") as f:
        json.dump(record, f)
    os.replace(stem + ".json.tmp", stem + ".json")


_AFTER_IMPORT_ALWAYS = {"miles.ray.train_actor": _cpu_device, "megatron.core.tensor_parallel.random": _cpu_rng,
                        "torch.distributed.distributed_c10d": _in_process_store,
                        "miles.utils.reloadable_process_group": _forward_renamed_collectives,
                        "miles.ray.rollout.router_manager": _patient_router_start}
_WORKAROUNDS = {"placement": ("miles.ray.placement_group", _place_idle_actor),
                "dashboard": ("miles.ray.rollout.debug_data", _skip_dashboard_columns),
                "broadcast_bucket": ("miles.backends.megatron_utils.update_weight.update_weight_from_distributed.mixin",
                                     _bucket_for_converter)}
_AFTER_IMPORT = {**_AFTER_IMPORT_ALWAYS, **{_WORKAROUNDS[w][0]: _WORKAROUNDS[w][1]
                    for w in (os.environ.get("V4RL_REHEARSAL_WORKAROUNDS") or "").split(",") if w in _WORKAROUNDS},
                 **{name: _add_miles_sglang_names for name in MILES_SGLANG_NAMES},
                 "megatron.training.arguments": _answer_device}
if os.environ.get("V4RL_REHEARSAL_BROADCASTS"):
    _AFTER_IMPORT["miles.backends.megatron_utils.update_weight.update_weight_from_distributed.broadcast"] = \
        _record_broadcasts
    _AFTER_IMPORT["miles.utils.distributed_utils"] = _gloo_weight_group
    _AFTER_IMPORT["miles.utils.fp8_kernel"] = _fp8_cast_in_torch


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a patch right after one of _AFTER_IMPORT's modules has executed (the real module, found normally)."""

    def find_spec(self, name, path, target=None):
        patch = _AFTER_IMPORT.get(name)
        if patch is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            try:
                patch(module)
            except Exception as exc:  # one line naming the patch, not a traceback through Miles' import
                raise RuntimeError(f"v4rl's rehearsal bootstrap cannot apply {patch.__name__} to {name}: "
                                   f"{type(exc).__name__}: {exc}; this Miles' code differs from the generations "
                                   "the rehearsal knows (docs/rehearsal.md)") from None

        spec.loader.exec_module = exec_module
        return spec


class _NoFusedOptimizers(importlib.abc.MetaPathFinder):
    """Stages train and full: apex (a second source of fused GPU optimizers) is absent, as on the cluster's ROCm
    image, so Megatron takes TE's FusedAdam: the TE stand-in's (probes/standins/transformer_engine/pytorch/
    optimizers.py, its update math in torch), whose save and load path is the cluster's. Megatron's other fallback,
    torch's AdamW, cannot resume (see that module); otherwise the GPU-only stubs would answer with a stub apex."""

    NAMES = ("apex.optimizers", "apex")

    def find_spec(self, name, path, target=None):
        if name in self.NAMES:
            raise ModuleNotFoundError(f"No module named {name!r} (v4rl rehearsal: no fused GPU optimizers)")
        return None


if os.environ.get("V4RL_REHEARSAL_KERNELS"):
    sys.meta_path.insert(0, _NoFusedOptimizers())
sys.meta_path.insert(0, _AfterImport())
dataclasses.fields = _struct_fields(dataclasses.fields)


def _exit_past_ray_destructors():
    """Ray 2.60.0 defect seen here: Miles' driver finishes train.py (exit status 0), Ray's own atexit shutdown runs,
    then the process hangs for ever in a C++ static destructor of `_raylet.so` (boost::asio::thread_pool::join,
    from __run_exit_handlers; gdb). Registered before `import ray`, this atexit handler runs after Ray's and ends
    the driver with its own status through os._exit, skipping only those destructors. Status: 1 after an
    unhandled exception, the code given to sys.exit, else 0. Only in the driver (V4RL_REHEARSAL_DRIVER)."""
    import atexit

    status = [0]
    real_hook, real_exit = sys.excepthook, sys.exit

    def hook(kind, value, tb):
        status[0] = 1
        real_hook(kind, value, tb)

    def exit_with(code=None):
        status[0] = code if isinstance(code, int) else (0 if code is None else 1)
        real_exit(code)

    def finish():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status[0])

    sys.excepthook, sys.exit = hook, exit_with
    atexit.register(finish)


if os.environ.get("V4RL_REHEARSAL_DRIVER") and sys.argv and os.path.realpath(sys.argv[0]) == os.path.realpath(
        os.environ["V4RL_REHEARSAL_DRIVER"]):
    _exit_past_ray_destructors()
