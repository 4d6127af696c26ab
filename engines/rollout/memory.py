"""Memory occupation release/resume with SGLang 0.5.23's contract, on the CPU engine.

SGLang (`/release_memory_occupation`, `/resume_memory_occupation`, body `{"tags": [...] | null}`; null or [] means
every tag; `managers/scheduler_components/weight_updater.py`) pauses its torch_memory_saver regions by tag:
  kv_cache    the KV pool; the radix cache is flushed
  weights     the model's parameters (their static state is stashed and restored on resume)
  cuda_graph  captured graphs
It must be called while the engine is idle (an assertion there), the reply is HTTP 200 with a null body, and
without `--enable-memory-saver` the pauses are no-ops (the adapter does nothing): only the flush happens.
Miles' orders (`SGLangEngine.release_memory_occupation` flushes first; train.py, `ray/rollout/server_group.py`):
release all (null) at start and at engine recovery, then resume `weights`, push weights, resume `kv_cache` +
`cuda_graph`; each step releases `cuda_graph` + `kv_cache` + `weights` (--offload-rollout-level's default) and
resumes the same way.

While regions are released SGLang keeps serving: its scheduler never reads the released tags when it admits a
request (`offload_tags` only picks DP attention's gather group), so without --enable-memory-saver generation,
/health and every control endpoint answer as usual (with it, a request would compute on paused memory).

What the embedded engine frees (its memory is host RAM), and what it serves meanwhile:
  kv_cache    the prefix cache (prefilled sequences kept for reuse); no request holds KV when idle, and a
              request allocates its own, so requests run while it is released, as SGLang's would
  weights     with enable_memory_saver: every runtime tensor a weight update rebuilds (the dequantized fp32/bf16
              copies, the bulk of the engine's memory) and the fused kernels' packed copies of them; the stored
              FP8/FP4 checkpoint tensors stay (like SGLang's `enable_weights_cpu_backup`), so resume rebuilds
              the runtime copies from them: an update that arrives while released lands in the store and takes
              effect at resume. Nothing can compute then: a new request is answered at once (HTTP 503,
              WEIGHTS_RELEASED) and requests queued before the release wait for the resume. Without
              enable_memory_saver nothing is freed (SGLang's no-op adapter) and requests run.
  cuda_graph  nothing (accepted: there are no graphs on CPU)
Release while requests run is refused with SGLang's message; an unknown tag or resuming a tag that is not
released is refused with the tags to use.

    engine.release_memory_occupation(["weights"], free_weights=True)   # the engine runs the helpers below
    engine.resume_memory_occupation(None)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from engines.model import DeepseekV4

KV_CACHE, WEIGHTS, CUDA_GRAPH = "kv_cache", "weights", "cuda_graph"
ALL_TAGS: tuple[str, ...] = (KV_CACHE, WEIGHTS, CUDA_GRAPH)
"""SGLang 0.5.23's GPU_MEMORY_ALL_TYPES (sglang/srt/constants.py), in its order."""
NOT_IDLE = "release_memory_occupation should be called only when server is idle."
"""SGLang's assertion message when requests run."""
WEIGHTS_RELEASED = ("the engine's weights are released (/release_memory_occupation with --enable-memory-saver); "
                    'POST /resume_memory_occupation {"tags": ["weights"]} before generating')
"""The answer to a request that arrives while the runtime weights are freed."""


class MemoryOccupationError(ValueError):
    """A release/resume request the engine refuses; the message says which tags to send."""


def normalize_tags(tags: Sequence[str] | None) -> list[str]:
    """SGLang's reading of `tags`: null or [] is every tag; each tag must be one SGLang knows."""
    tags = list(tags or ALL_TAGS)
    unknown = [t for t in tags if t not in ALL_TAGS]
    if unknown:
        raise MemoryOccupationError(f"tags {unknown} are not memory regions; send a subset of {list(ALL_TAGS)} "
                                    "(or null for all)")
    return list(dict.fromkeys(tags))


class MemoryRegions:
    """Which regions are released, and the freed runtime tensors' layout (scheduler thread only)."""

    def __init__(self) -> None:
        self.released: set[str] = set()
        self._layout: dict[str, tuple[torch.Size, torch.dtype]] | None = None

    @property
    def weights_freed(self) -> bool:
        return self._layout is not None

    def release(self, tags: list[str], model: DeepseekV4, prefix_cache, free_weights: bool, *, busy: bool) -> int:
        """Release `tags` unless requests hold KV (`busy`); returns the bytes freed."""
        if busy:
            raise MemoryOccupationError(NOT_IDLE)
        freed = 0
        if KV_CACHE in tags:
            prefix_cache.clear()
        if WEIGHTS in tags and free_weights and self._layout is None:
            self._layout, freed = free_runtime_weights(model)
        self.released.update(tags)
        return freed

    def resume(self, tags: list[str], model: DeepseekV4, rebuild: Callable[[], None]) -> None:
        missing = [t for t in tags if t not in self.released]
        if missing:
            raise MemoryOccupationError(f"tags {missing} are not released (released: {sorted(self.released)}); "
                                        "resume only what /release_memory_occupation released")
        if WEIGHTS in tags and self._layout is not None:
            reallocate_runtime_weights(model, self._layout)
            self._layout = None
            rebuild()  # from the stored FP8/FP4 tensors, updates received while released included
        self.released.difference_update(tags)


def free_runtime_weights(model: DeepseekV4) -> tuple[dict[str, tuple[torch.Size, torch.dtype]], int]:
    """Replace every tensor of the model's state dict (what `rebuild_runtime` writes) by an empty one and drop
    the fused kernels' packed copies. Returns the freed tensors' shapes and dtypes and the bytes freed."""
    layout: dict[str, tuple[torch.Size, torch.dtype]] = {}
    freed = 0
    for name, t in _state_tensors(model):
        layout[name] = (t.shape, t.dtype)
        freed += t.numel() * t.element_size()
        t.data = torch.empty(0, dtype=t.dtype)
    _drop_fused_plans(model)
    return layout, freed


def reallocate_runtime_weights(model: DeepseekV4, layout: dict[str, tuple[torch.Size, torch.dtype]]) -> None:
    """Give every freed tensor its storage back (contents undefined until `rebuild_runtime` fills them)."""
    for name, t in _state_tensors(model):
        shape, dtype = layout[name]
        t.data = torch.empty(shape, dtype=dtype)
    _drop_fused_plans(model)


def _state_tensors(model: DeepseekV4) -> Iterable[tuple[str, torch.Tensor]]:
    """The Parameter / persistent-buffer objects behind `model.state_dict()` (swapping `.data` keeps every
    reference to them, e.g. the fused model's, valid)."""
    for name in model.state_dict():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        yield name, getattr(module, leaf)


def _drop_fused_plans(model: DeepseekV4) -> None:
    model.fused.drop_packed_weights()  # packed weight copies, rebuilt on first use
