"""Import stubs for GPU-only modules, so that a real engine's pure-Python code imports on a CPU machine.

Used inside the subprocesses that run SGLang's, Miles' or Megatron-LM's own code for conformance checks and
the cluster preflight (engines/upstream/sources.py `engine_python`); never by v4rl's library code. Only this
module and the standard library are imported here, so it loads before torch or the engine.

A stub is made for a module only when (a) its name is at or under one of the given roots and (b) no real
finder found it: the finder sits at the END of `sys.meta_path`, so every module that really exists is imported
for real, and an engine change that needs a new GPU-only module shows up as an ImportError, not silently.
`STUBBED` records every stubbed name (the conformance suite prints it).

    import engines.upstream.stubs as stubs
    stubs.activate(["sgl_kernel", "flashinfer"])
    import sglang.srt.server_args           # imports; sgl_kernel.* resolve to stubs
    print(stubs.STUBBED)
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
import typing
from collections.abc import Iterable

# GPU-only packages SGLang, Miles and Megatron-LM import at module level (CUDA/ROCm kernels and their JITs).
GPU_ONLY_ROOTS: tuple[str, ...] = (
    "sgl_kernel", "sglang_kernel", "flashinfer", "flash_attn", "flash_mla", "sgl_flash_mla", "deep_gemm",
    "sgl_deep_gemm", "deep_ep", "sgl_deep_ep", "triton", "tilelang", "quack", "cutlass", "cuda", "nvshmem",
    "pynvml", "aiter", "vllm", "transformer_engine", "apex", "torch_memory_saver", "humming", "kernels",
    "decord",
    # Not GPU-only, but PyPI's builds fail to import beside a CPU torch (and SGLang imports them at module level
    # for multimodal models).
    "torchvision", "torchaudio", "torchcodec",
)
STUBBED: list[str] = []
STUB_VERSION = "0.0.0+v4rl.stub"


class StubCalled(RuntimeError):
    """Code asked a stubbed GPU-only module for a value (a call with no arguments, e.g. a device query)."""


class _StubType(type):
    """A class whose every attribute, call and item is another stub: enough for what modules do at import time
    (decorators, decorator factories, base classes, annotations, config objects). A call with one callable
    argument returns it (a decorator); a call with no arguments is a query for a value the machine cannot
    give (a device, a capability) and raises StubCalled, which the engines' own CPU fallbacks catch."""

    def __getattr__(cls, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stub_class(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        if not args and not kwargs:
            raise StubCalled(f"{cls.__qualname__}() is a stub of a GPU-only module (engines/upstream/stubs.py)")
        return _stub_class(f"{cls.__qualname__}()")

    def __getitem__(cls, item):
        return _stub_class(f"{cls.__qualname__}[]")

    def __iter__(cls):
        return iter(())

    def __len__(cls) -> int:
        return 0

    def __bool__(cls) -> bool:
        return False

    def __or__(cls, other):  # `StubA | StubB` in annotations must stay a real Union (torch asserts on one)
        return typing.Union[cls, other]

    def __ror__(cls, other):
        return typing.Union[other, cls]

    def __int__(cls) -> int:
        return 0

    def __index__(cls) -> int:
        return 0

    def __float__(cls) -> float:
        return 0.0


def _stub_class(qualname: str) -> type:
    return _StubType(qualname.rsplit(".", 1)[-1], (), {"__qualname__": qualname, "__module__": "engine_stub"})


class StubModule(types.ModuleType):
    """A stubbed module: a package (submodules import), every attribute a stub class."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _stub_class(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stubs modules under `roots` that no real finder found (it must stay last on sys.meta_path)."""

    def __init__(self, roots: Iterable[str]) -> None:
        self.roots = tuple(roots)

    def covers(self, name: str) -> bool:
        return any(name == root or name.startswith(root + ".") for root in self.roots)

    def find_spec(self, fullname, path=None, target=None):
        if not self.covers(fullname):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = StubModule(spec.name)
        module.__path__ = []
        # Libraries that probe optional packages (transformers) find the stub in sys.modules; a version below
        # any minimum makes them treat it as unusable instead of failing to parse a missing one.
        module.__version__ = STUB_VERSION
        return module

    def exec_module(self, module) -> None:
        STUBBED.append(module.__name__)


def activate(roots: Iterable[str] = GPU_ONLY_ROOTS) -> StubFinder:
    """Append a StubFinder for `roots` to sys.meta_path (idempotent per root set) and return it."""
    finder = StubFinder(roots)
    for existing in sys.meta_path:
        if isinstance(existing, StubFinder) and existing.roots == finder.roots:
            return existing
    sys.meta_path.append(finder)
    return finder
