"""What a Miles job start and a Miles save cost in storage traffic, and what a run's job shape costs in all.

Counted from the preset's model shape (engines/layout/shape.py, exact parameter counts) and layout:

  save      Megatron writes the actor's BF16 weights (2 B/param) and, unless `--no-save-optim`, its optimizer
            state: fp32 master weights + Adam m and v (12 B/param), torch_dist, once per save
  start     the actor loads its checkpoint: a fresh run reads --ref-load (BF16 weights, 2 B/param; no
            optimizer: Miles loads it as a finetune), a resumed run reads --load (weights + optimizer unless
            --no-save-optim); every SGLang engine reads the HF rollout checkpoint from storage (FP8 linears with
            fp32 128x128-block scales, BF16 rest, routed experts FP8 or FP4 + UE8M0 per 32 as the preset serves)
  seconds   bytes / the site's storage bandwidth (a plan option): the accelerators idle while it streams

These are lower bounds: ranks that hold a replica of a tensor (data parallel) each read it, SGLang's tensor-
parallel ranks each open every shard file, and a job start also costs Ray placement, SGLang's startup (Miles'
AMD launcher allows --sglang-watchdog-timeout 1800 for GEMM tuning) and Megatron's build, which no byte count
shows.

    costs = job_costs("dsv4-flash-mi355x", storage_gb_per_s=5.0)
    run_costs(costs, steps=200, eval_interval=10, save_interval=20)   # one job per segment vs one job per run
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

WEIGHT_BYTES = 2
"""BF16 actor weights, per parameter."""
OPTIMIZER_BYTES = 12
"""fp32 master weights + Adam exp_avg + exp_avg_sq, per parameter (Megatron's distributed optimizer state)."""
DEFAULT_STORAGE_GB_PER_S = 5.0
"""Sustained bandwidth of a site's shared checkpoint storage for one job, GB/s (a parallel file system or an
all-flash NAS serving a few nodes; an NFS server is often nearer 1). Measure yours and pass `--storage-gb-per-s`."""
GB = 1e9


@dataclass(frozen=True)
class JobCosts:
    """Storage bytes of one Miles job start and one save, for a preset; seconds at `storage_gb_per_s`."""

    preset: str
    params: int
    """Trainable parameters of the model."""
    save_weights_bytes: int
    """BF16 weights written per save."""
    save_optimizer_bytes: int
    """Optimizer state written per save (0 with --no-save-optim)."""
    start_fresh_bytes: int
    """Actor checkpoint read by a job that starts from --ref-load (our converted checkpoint)."""
    start_resume_bytes: int
    """Actor checkpoint read by a job that resumes from --load (weights + optimizer unless --no-save-optim)."""
    sglang_engines: int
    """SGLang engines the job starts; each reads the rollout checkpoint."""
    rollout_checkpoint_bytes: int
    """One read of the HF rollout checkpoint."""
    storage_gb_per_s: float

    @property
    def save_bytes(self) -> int:
        return self.save_weights_bytes + self.save_optimizer_bytes

    @property
    def sglang_bytes(self) -> int:
        return self.sglang_engines * self.rollout_checkpoint_bytes

    def seconds(self, n_bytes: float) -> float:
        return n_bytes / (self.storage_gb_per_s * GB)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(save_bytes=self.save_bytes, sglang_bytes=self.sglang_bytes,
                   save_seconds=self.seconds(self.save_bytes),
                   start_fresh_seconds=self.seconds(self.start_fresh_bytes + self.sglang_bytes),
                   start_resume_seconds=self.seconds(self.start_resume_bytes + self.sglang_bytes))
        return out


def job_costs(preset_name: str, overrides: Mapping[str, Any] | None = None, *,
              storage_gb_per_s: float = DEFAULT_STORAGE_GB_PER_S, save_optim: bool = True) -> JobCosts:
    """The storage cost of one job start and one save of the preset (with planner overrides)."""
    from engines.layout.shape import embedding_params, layer_params, total_params
    from engines.presets.runs import resolve

    if storage_gb_per_s <= 0:
        raise ValueError(f"--storage-gb-per-s must be > 0 (the site storage bandwidth, GB/s), got {storage_gb_per_s}")
    preset, inp = resolve(preset_name, overrides)
    shape, rollout, cluster = inp.model, inp.rollout, inp.cluster
    params = total_params(shape)
    layers = [layer_params(shape, i) for i in range(shape.num_layers)]
    fp8, other, experts = (sum(lp.fp8 for lp in layers), sum(lp.other for lp in layers),
                           sum(lp.experts for lp in layers))
    expert_bytes = 1 + 4 / (128 * 128) if rollout.expert_format == "fp8" else 0.5 + 1 / 32
    rollout_bytes = experts * expert_bytes + fp8 * (1 + 4 / (128 * 128)) + 2 * other + 2 * sum(embedding_params(shape))
    rollout_gpus = cluster.rollout_gpus if cluster.rollout_nodes else cluster.nodes * cluster.gpus_per_node
    weights = WEIGHT_BYTES * params
    optimizer = OPTIMIZER_BYTES * params if save_optim else 0
    return JobCosts(preset=preset.name, params=params, save_weights_bytes=weights, save_optimizer_bytes=optimizer,
                    start_fresh_bytes=weights, start_resume_bytes=weights + optimizer,
                    sglang_engines=max(1, rollout_gpus // max(1, rollout.engine_tp)),
                    rollout_checkpoint_bytes=int(rollout_bytes), storage_gb_per_s=storage_gb_per_s)


@dataclass(frozen=True)
class RunShape:
    """Job starts, loads and saves of one run, and their storage bytes and seconds."""

    jobs: int
    fresh_starts: int
    resumes: int
    saves: int
    bytes_read: int
    bytes_written: int
    seconds: float


def _shape(costs: JobCosts, *, jobs: int, fresh: int, resumes: int, saves: int) -> RunShape:
    read = fresh * costs.start_fresh_bytes + resumes * costs.start_resume_bytes + jobs * costs.sglang_bytes
    written = saves * costs.save_bytes
    return RunShape(jobs, fresh, resumes, saves, read, written, costs.seconds(read + written))


def run_costs(costs: JobCosts, *, steps: int, eval_interval: int, save_interval: int) -> dict[str, RunShape]:
    """{"one job per segment": what v4rl did before, "one job per run": what it does now}.

    Before: Miles' eval-only job for step 0, then one job per eval_interval segment, each saving at its end with
    --save-interval set to eval_interval (steps / eval_interval saves), each after the first resuming from --load.
    Now: one job; saves every save_interval rollouts and at the last (Miles' should_run_periodic_action)."""
    for name, value in (("steps", steps), ("eval_interval", eval_interval), ("save_interval", save_interval)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    segments = math.ceil(steps / eval_interval)
    before = _shape(costs, jobs=segments + 1, fresh=2, resumes=segments - 1, saves=segments)
    saves = steps // save_interval + (1 if steps % save_interval else 0)
    after = _shape(costs, jobs=1, fresh=1, resumes=0, saves=saves)
    return {"one job per segment": before, "one job per run": after}
