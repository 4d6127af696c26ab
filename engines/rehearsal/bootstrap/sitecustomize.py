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
    --rollout-external --debug-rollout-only it reserves no bundle, yet create_training_models still places one
    (idle) actor per GPU (ray/train/actor_factory.py:89) and one SGLangEngine actor per external engine
    (ray/rollout/server_group.py:91) in bundles: IndexError before any rollout. The rehearsal reserves the actor's
    logical GPUs and lets both share them.
    Applied only where V4RL_REHEARSAL_WORKAROUNDS names it; the substitution table lists it."""
    real = module._get_placement_group_layout

    def layout(args):
        if args.rollout_external and args.debug_rollout_only:
            # (bundles, rollout offset): the idle actor and Miles' SGLangEngine actors for the external engines
            # (0.2 GPU each, server_group.py:91 indexes the rollout bundles) share the actor's logical GPUs
            return args.actor_num_nodes * args.actor_num_gpus_per_node, 0
        return real(args)

    module._get_placement_group_layout = layout


def _cpu_device(_module):
    """Miles' train actor (even the idle one of --debug-rollout-only) sets its CUDA device and allocates on it: the
    model probes' stand-in (engines/train/miles/probes/model_probe.py `patch_device`) answers as the cluster's
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
    a rehearsal listens beyond 127.0.0.1. Groups of more ranks keep their own store."""
    real = module.init_process_group

    def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None,
                           *args, **kwargs):
        size = world_size if world_size != -1 else int(os.environ.get("WORLD_SIZE", "-1"))
        if store is None and init_method in (None, "env://") and size == 1:
            import torch.distributed as dist  # complete by the time a group is made

            store, rank, world_size = dist.HashStore(), 0, 1
        return real(backend, None if store is not None else init_method, timeout, world_size, rank, store,
                    *args, **kwargs)

    module.init_process_group = init_process_group


def _skip_dashboard_columns(module):
    """--save-debug-rollout-data also writes a parquet mirror for Miles' dashboard through polars; the polars of
    SGLang 0.5.23's dependency folder lacks its compiled runtime (`pl.DataFrame`: NameError PyDataFrame, at
    miles/ray/rollout/debug_data.py:55) and the dump Miles trains from is written after it. Miles' own path for
    a machine without polars (its ImportError branch: no parquet, the .pt still written) is taken instead."""
    module.save_dashboard_columns = lambda samples, path: None


_AFTER_IMPORT_ALWAYS = {"miles.ray.train_actor": _cpu_device, "megatron.core.tensor_parallel.random": _cpu_rng,
                        "torch.distributed.distributed_c10d": _in_process_store}
_WORKAROUNDS = {"placement": ("miles.ray.placement_group", _place_idle_actor),
                "dashboard": ("miles.ray.rollout.debug_data", _skip_dashboard_columns)}
_AFTER_IMPORT = {**_AFTER_IMPORT_ALWAYS, **{_WORKAROUNDS[w][0]: _WORKAROUNDS[w][1]
                    for w in (os.environ.get("V4RL_REHEARSAL_WORKAROUNDS") or "").split(",") if w in _WORKAROUNDS},
                 **{name: _add_miles_sglang_names for name in MILES_SGLANG_NAMES},
                 "megatron.training.arguments": _answer_device}


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
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


class _NoFusedOptimizers(importlib.abc.MetaPathFinder):
    """Stage train: TE's and apex's fused optimizers (GPU kernels) are absent, as on a machine without them, so
    Megatron takes its own fallback (megatron/core/optimizer/__init__.py, distrib_optimizer.py: torch's AdamW /
    Adam); otherwise the GPU-only stubs would answer with a stub FusedAdam."""

    NAMES = ("transformer_engine.pytorch.optimizers", "apex.optimizers", "apex")

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
