"""Does each CPU step of the pipeline fit this machine's memory for this checkpoint? Estimated, before any runs.

The pipeline's CPU steps load the model in different ways (closed forms over the config's parameter counts,
engines/layout/shape.py; P = every parameter, S = the checkpoint's stored bytes: FP8 linears 1 B + block
scales, routed experts FP4 0.5 B + a UE8M0 scale per 32 or FP8 1 B, the rest BF16):

  convert     streaming (checkpoints/convert.py): each worker holds one tensor at a time, its stored bytes,
              the fp32 decode and the BF16 output; the largest is the embedding or the head (vocab x hidden)
  verify      megatron-core loads ~1 GiB batches of BF16 boxes, each compared with the source decoded again
              (checkpoints/convert.py verify_torch_dist): about four batches and the largest box live
  cpu-align   engines/align (today's CPU gate): the trainer's fp32 master weights (4 P) while our rollout
              engine holds the checkpoint as stored (S) with fp32 runtime copies (4 P) and an fp32 model of
              them for the layer-by-layer localisation (4 P): 12 P + S at its peak
  cpu-eval    tasks/evaluate.py: our rollout engine with the checkpoint as stored and fp32 runtime copies

plus the interpreter with torch, transformers and megatron-core imported (BASE_BYTES, measured on the tiny
model, whose weights are a few MB). `check_cpu_fit` refuses the first step that needs more than the machine
has (physical memory, or the cgroup limit when lower), naming the step, the estimate and the memory.

    from engines.layout.cpu_fit import check_cpu_fit
    check_cpu_fit("/data/DeepSeek-V4-Flash-FP8/config.json", ("convert", "verify", "cpu-align"))
    # CpuFitError: CPU step 'cpu-align' needs ~3,526 GB for ... but this machine has 24.7 GB; ...

Tests: `.venv/bin/python -m pytest tests/test_cpu_fit.py -q`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from engines.layout.shape import ModelShape, embedding_params, layer_params

GB = 1e9
CPU_STEPS = ("convert", "verify", "cpu-align", "cpu-eval")
"""Every CPU step the estimate knows, in pipeline order."""
BASE_BYTES = {"convert": 1.0 * GB, "verify": 1.0 * GB, "cpu-align": 1.5 * GB, "cpu-eval": 1.2 * GB}
"""Resident size of the step's process with its libraries and nothing of the model (tests/test_cpu_fit.py
measures the tiny model's steps below these)."""
WORKER_BYTES = 0.3 * GB
"""What one forked conversion worker adds besides its tensor (its own torch thread pools and buffers)."""
VERIFY_BATCH_BYTES = 1 << 30
"""verify_torch_dist's default batch_bytes."""
_FIXES = {
    "convert": "lower the conversion workers (`v4rl convert --workers N`) or use a machine with more memory",
    "verify": "use a machine with more memory (verification streams ~1 GiB batches)",
    "cpu-align": "run the alignment gate on the cluster's engines (a GPU preset: SGLang generates, Megatron "
                 "rescores through Miles) or align a smaller checkpoint on CPU",
    "cpu-eval": "evaluate on the cluster (a GPU preset: Miles' own evaluation) or use a smaller checkpoint",
}


class CpuFitError(ValueError):
    """A CPU step whose estimated memory exceeds the machine's; names the step, the estimate and the fix."""


@dataclass(frozen=True)
class StepMemory:
    """Estimated peak resident memory of one CPU step."""

    step: str
    parts: tuple[tuple[str, float], ...]
    """(what, bytes) making up the peak, largest first."""

    @property
    def bytes(self) -> float:
        return sum(b for _, b in self.parts)

    def describe(self) -> str:
        return ", ".join(f"{what} {b / GB:,.1f} GB" for what, b in self.parts)


@dataclass(frozen=True)
class ModelBytes:
    """Parameter counts and stored bytes of one checkpoint (module docstring: P, S)."""

    params: int
    stored: float
    largest_tensor: int
    """Elements of the biggest single tensor (what a conversion worker holds at once)."""

    @classmethod
    def of(cls, shape: ModelShape, *, expert_dtype: str = "fp4") -> "ModelBytes":
        if expert_dtype not in ("fp4", "fp8", "bf16"):
            raise ValueError(f"expert_dtype must be fp4, fp8 or bf16 (config.json's expert_dtype), got {expert_dtype!r}")
        expert_b = {"fp4": 0.5 + 1 / 32, "fp8": 1 + 4 / 128 ** 2, "bf16": 2.0}[expert_dtype]
        first, last = embedding_params(shape)
        params, stored = first + last, 2.0 * (first + last)
        for layer in range(shape.num_layers):
            lp = layer_params(shape, layer)
            params += lp.fp8 + lp.other + lp.experts
            stored += lp.fp8 * (1 + 4 / 128 ** 2) + lp.other * 2.0 + lp.experts * expert_b
        H, nh, hd = shape.hidden_size, shape.num_heads, shape.head_dim
        largest = max(shape.vocab_size * H, nh * hd * shape.q_lora_rank, shape.o_groups * shape.o_lora_rank * H,
                      shape.moe_intermediate_size * H)
        return cls(params=params, stored=stored, largest_tensor=largest)


def step_memory(model: ModelBytes, step: str, *, workers: int = 1) -> StepMemory:
    """The peak of one CPU step (module docstring), as parts."""
    p = model.params
    if step == "convert":
        worker = model.largest_tensor * (2 + 4 + 2)  # stored (<= bf16) + fp32 decode + bf16 out
        parts = [("process", BASE_BYTES[step]), (f"{workers} workers x (largest tensor + buffers)",
                                                  workers * (worker + WORKER_BYTES))]
    elif step == "verify":
        parts = [("process", BASE_BYTES[step]), ("batches loaded and decoded for comparison",
                                                  4 * VERIFY_BATCH_BYTES + model.largest_tensor * 2 * 2)]
    elif step == "cpu-align":
        parts = [("process", BASE_BYTES[step]), ("trainer fp32 master weights", 4 * p),
                 ("rollout engine fp32 runtime copies", 4 * p), ("fp32 model for localisation", 4 * p),
                 ("checkpoint as stored", model.stored)]
    elif step == "cpu-eval":
        parts = [("process", BASE_BYTES[step]), ("rollout engine fp32 runtime copies", 4 * p),
                 ("checkpoint as stored", model.stored)]
    else:
        raise ValueError(f"unknown CPU step {step!r}; known: {', '.join(CPU_STEPS)}")
    return StepMemory(step, tuple(sorted(parts, key=lambda x: -x[1])))


def machine_memory_bytes() -> int:
    """Physical memory, or the cgroup's limit when it is lower (a container's real ceiling)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def _model_of(config: str | Path | ModelShape, expert_dtype: str | None) -> tuple[ModelShape, str, str]:
    if isinstance(config, ModelShape):
        return config, expert_dtype or "fp4", "the given model shape"
    path = Path(config)
    if path.is_dir() or path.suffix != ".json":  # a checkpoint directory
        path = path / "config.json"
    if not path.is_file():
        raise CpuFitError(f"{path} does not exist: the CPU-fit check reads the checkpoint's config.json (the "
                          "hf_checkpoint the pipeline converts); check the path on the machine that runs the flow")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CpuFitError(f"{path} is not readable JSON ({exc}); give the checkpoint's config.json") from None
    return ModelShape.from_hf_config(str(path)), expert_dtype or raw.get("expert_dtype") or "fp4", str(path)


def check_cpu_fit(config: str | Path | ModelShape, steps: Iterable[str], *, memory_bytes: int | None = None,
                  workers: int | None = None, expert_dtype: str | None = None) -> list[StepMemory]:
    """Estimate every step in `steps` for this checkpoint; CpuFitError at the first that does not fit.

    `config`: a config.json (or its directory) or a ModelShape; `memory_bytes`: default the machine's;
    `workers`: conversion workers (default one per core, as the convert task runs)."""
    shape, experts, where = _model_of(config, expert_dtype)
    model = ModelBytes.of(shape, expert_dtype=experts)
    memory = memory_bytes if memory_bytes is not None else machine_memory_bytes()
    if workers is None:  # the convert task's default: one worker per usable core (checkpoints/workers.py)
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    out = []
    for step in steps:
        est = step_memory(model, step, workers=workers)
        if est.bytes > memory:
            raise CpuFitError(
                f"CPU step {step!r} needs ~{est.bytes / GB:,.1f} GB for {where} ({model.params / 1e9:,.2f}B "
                f"parameters, {model.stored / GB:,.1f} GB stored: {est.describe()}) but this machine has "
                f"{memory / GB:,.1f} GB; fix: {_FIXES[step]}")
        out.append(est)
    return out
