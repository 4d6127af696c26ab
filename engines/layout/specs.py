"""Planner inputs (cluster, Megatron parallelism, actor and rollout knobs) and outputs (memory, traffic, Plan).

Inputs are frozen, keyword-only dataclasses; each field's docstring says which launcher flag it mirrors and
how to fix it when a rule rejects it. GB means 1e9 bytes throughout.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from engines.layout.shape import ModelShape

GB = 1e9


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """Nodes and devices. The actor gets `nodes - rollout_nodes` nodes; rollout_nodes=0 colocates both."""

    nodes: int
    """Nodes in the Ray cluster (Miles --num-nodes). Fix: the node count you actually have."""
    gpus_per_node: int = 8
    """Accelerators per node (--num-gpus-per-node)."""
    hbm_gb: float = 288.0
    """Device memory per accelerator in GB (1e9 B, vendor nominal): MI355X 288, H200 141."""
    host_memory_gb: float = 2048.0
    """Host RAM per node in GB; holds the offloaded optimizer state. Fix: your nodes' RAM (free -g)."""
    rollout_nodes: int = 0
    """Nodes given to SGLang rollout (--rollout-num-nodes); 0 = colocated. Fix: keep it below `nodes`."""
    intra_node_gbps: float = 400.0
    """Per-GPU collective bandwidth inside a node, GB/s (xGMI / NVLink); only ranks layouts."""
    inter_node_gbps: float = 50.0
    """Per-GPU bandwidth across nodes, GB/s (one 400 Gb/s NIC per GPU); only ranks layouts."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1 or self.rollout_nodes < 0:
            raise ValueError("nodes and gpus_per_node must be >= 1 and rollout_nodes >= 0.")

    @property
    def colocated(self) -> bool:
        return self.rollout_nodes == 0

    @property
    def actor_nodes(self) -> int:
        return self.nodes if self.colocated else self.nodes - self.rollout_nodes

    @property
    def actor_world(self) -> int:
        return self.actor_nodes * self.gpus_per_node

    @property
    def rollout_gpus(self) -> int:
        return (self.nodes if self.colocated else self.rollout_nodes) * self.gpus_per_node


@dataclass(frozen=True, kw_only=True)
class ParallelSpec:
    """Megatron actor parallelism (the --*-parallel-size flags); DP and EDP are derived."""

    tp: int = 1
    """--tensor-model-parallel-size: must divide the attention heads (64) and the actor world."""
    pp: int = 1
    """--pipeline-model-parallel-size: layers % pp == 0 unless first/last stage sizes are given."""
    ep: int = 1
    """--expert-model-parallel-size: must divide the routed experts (256); ETP*EP*PP must divide the world."""
    etp: int | None = None
    """--expert-tensor-parallel-size; None = Megatron's default (= tp). Must divide moe_intermediate_size."""
    cp: int = 1
    """--context-parallel-size; DeepSeek-V4 in Miles needs --allgather-cp when > 1."""
    first_stage_layers: int | None = None
    """--decoder-first-pipeline-num-layers; the middle stages share the rest evenly."""
    last_stage_layers: int | None = None
    """--decoder-last-pipeline-num-layers (the seed: 10, so 43 = 11 + 11 + 11 + 10)."""
    sequence_parallel: bool | None = None
    """--sequence-parallel; None = on exactly when tp > 1 (what Miles' launcher passes)."""

    def __post_init__(self) -> None:
        if min(self.tp, self.pp, self.ep, self.cp, self.etp or 1) < 1:
            raise ValueError("tp, pp, ep, etp and cp must all be >= 1.")

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def sp(self) -> bool:
        return self.tp > 1 if self.sequence_parallel is None else self.sequence_parallel


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    """Actor-side knobs that size memory and traffic."""

    max_tokens_per_gpu: int = 8192
    """--max-tokens-per-gpu: tokens packed into one micro-batch per GPU (per CP rank) when `packed`."""
    micro_batching: Literal["packed", "per-sample"] = "packed"
    """How a DP rank's samples become micro-batches. packed: up to max_tokens_per_gpu tokens each (Megatron's
    --use-dynamic-batch-size; our CPU trainer). per-sample: one sample each (Miles' DeepSeek-V4 training runs
    --qkv-format bshd --micro-batch-size 1, which forbids dynamic batches, so --max-tokens-per-gpu does not size
    its micro-batches: conformance A5). Cluster presets must say per-sample."""
    recompute: Literal["full", "selective", "none"] = "full"
    """Activation recompute: full = --recompute-granularity full --recompute-method uniform --recompute-num-layers 1."""
    optimizer_offload: float = 1.0
    """Fraction of Adam state in host memory (--optimizer-cpu-offload [--optimizer-offload-fraction]); 0 = device."""
    distributed_optimizer: bool = True
    """Shard Adam state over DP (dense) / EDP (experts), Megatron --use-distributed-optimizer."""
    fp32_grads: bool = True
    """Main gradients in fp32 (--accumulate-allreduce-grads-in-fp32): 4 B per parameter, else 2 B."""
    rollout_batch_size: int = 32
    """Prompts per rollout (--rollout-batch-size)."""
    n_samples_per_prompt: int = 8
    """Responses per prompt (--n-samples-per-prompt)."""
    num_steps_per_rollout: int = 1
    """Optimizer steps per rollout (--num-steps-per-rollout): global batch = rollout_batch * n / steps."""
    max_prompt_len: int = 2048
    """Longest prompt in tokens (DAPO-Math prompts stay under ~1.2k)."""
    max_response_len: int = 4096
    """--rollout-max-response-len."""
    reserve_gb: float = 6.0
    """Per-GPU runtime overhead: HIP/CUDA context, RCCL/NCCL buffers, TE workspaces, fragmentation."""

    @property
    def global_batch(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt // self.num_steps_per_rollout

    @property
    def sample_tokens(self) -> int:
        return self.max_prompt_len + self.max_response_len

    def micro_batch_tokens(self, cp: int) -> int:
        """Tokens one GPU holds per micro-batch: the packing budget, or the longest sample split over CP."""
        return self.max_tokens_per_gpu if self.micro_batching == "packed" else math.ceil(self.sample_tokens / cp)


@dataclass(frozen=True, kw_only=True)
class RolloutSpec:
    """SGLang rollout engines (Miles --rollout-num-gpus-per-engine, --sglang-*)."""

    engine_tp: int = 4
    """--sglang-tp-size = GPUs per engine (--rollout-num-gpus-per-engine); rollout GPUs % engine_tp == 0."""
    engine_ep: int = 4
    """--sglang-ep-size: must divide engine_tp (SGLang's moe_tp = tp / ep) and the routed experts."""
    engine_dp: int = 1
    """--sglang-dp-size (DP attention inside the engine): must divide engine_tp."""
    max_running_requests: int = 48
    """--sglang-max-running-requests: sizes the per-request sliding-window state."""
    max_total_tokens: int = 524288
    """--sglang-max-total-tokens: the KV pool per engine, in tokens; must hold one full request."""
    context_length: int = 16384
    """--context-length: longest prompt + response SGLang accepts."""
    mem_fraction_static: float = 0.85
    """Share of HBM SGLang may take for weights + KV (--sglang-mem-fraction-static)."""
    expert_format: Literal["fp8", "fp4"] = "fp8"
    """Routed experts as served: fp8 (the FP8 repackage Miles uses) or native fp4 (0.5 B + UE8M0 per 32)."""
    kv_bytes_per_elem: float = 2.0
    """Bytes per cached KV element (BF16 = 2; FP8 cache = 1)."""
    reserve_gb: float = 6.0
    """Per-GPU overhead outside the static pool: context, graphs, sampling buffers."""


@dataclass(frozen=True, kw_only=True)
class LayoutInput:
    """Everything a plan depends on."""

    model: ModelShape
    cluster: ClusterSpec
    parallel: ParallelSpec
    train: TrainSpec = field(default_factory=TrainSpec)
    rollout: RolloutSpec = field(default_factory=RolloutSpec)

    def replace(self, **parts: Any) -> "LayoutInput":
        return dataclasses.replace(self, **parts)


@dataclass(frozen=True)
class StageMemory:
    """Estimated device memory (GB) of one GPU in one pipeline stage."""

    stage: int
    layers: int
    params: float
    grads: float
    optimizer: float
    optimizer_host: float
    activations: float
    logits: float
    reserve: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.logits + self.reserve

    def biggest(self) -> tuple[str, float]:
        parts = {"parameters": self.params, "gradients": self.grads, "optimizer state": self.optimizer,
                 "activations": self.activations, "logits": self.logits}
        return max(parts.items(), key=lambda kv: kv[1])


@dataclass(frozen=True)
class RolloutMemory:
    """Estimated device memory (GB) of one SGLang GPU."""

    weights: float
    kv_cache: float
    request_state: float
    reserve: float
    kv_bytes_per_token: float

    @property
    def static(self) -> float:
        return self.weights + self.kv_cache + self.request_state

    @property
    def total(self) -> float:
        return self.static + self.reserve


@dataclass(frozen=True)
class CommEstimate:
    """Bytes each GPU moves per optimizer step, per collective kind, and the seconds that takes."""

    bytes: dict[str, float]
    seconds: dict[str, float]
    cross_node: tuple[str, ...]
    micro_batches: int

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())


@dataclass
class Plan:
    """A checked layout: `feasible` is False exactly when `reasons` is non-empty."""

    input: LayoutInput
    dp: int
    edp: int
    pipeline_layers: list[int]
    stages: list[StageMemory]
    rollout: RolloutMemory | None
    host_gb_per_node: float
    comm: CommEstimate | None
    reasons: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def feasible(self) -> bool:
        return not self.reasons

    @property
    def actor_gb(self) -> float:
        return max((s.total for s in self.stages), default=0.0)

    def to_json(self) -> dict[str, Any]:
        """The `v4rl plan --json` object."""
        p = self.input.parallel
        return {
            "feasible": self.feasible,
            "layout": {"tp": p.tp, "pp": p.pp, "ep": p.ep, "etp": p.expert_tp, "cp": p.cp, "dp": self.dp,
                       "edp": self.edp, "sequence_parallel": p.sp, "pipeline_layers": self.pipeline_layers},
            "memory_gb_per_gpu": {"actor": round(self.actor_gb, 2),
                                  "rollout": round(self.rollout.total, 2) if self.rollout else 0.0},
            "capacity_gb_per_gpu": self.input.cluster.hbm_gb,
            "reasons": list(self.reasons),
            "warnings": list(self.warnings),
            "actor_stages": [dict(dataclasses.asdict(s), total=round(s.total, 2)) for s in self.stages],
            "rollout": (dict(dataclasses.asdict(self.rollout), total=round(self.rollout.total, 2))
                        if self.rollout else None),
            "host_gb_per_node": round(self.host_gb_per_node, 1),
            "communication": (None if self.comm is None else {
                "bytes_per_gpu_per_step": {k: round(v) for k, v in self.comm.bytes.items()},
                "seconds_per_step": {k: round(v, 4) for k, v in self.comm.seconds.items()},
                "total_seconds": round(self.comm.total_seconds, 4), "cross_node": list(self.comm.cross_node),
                "micro_batches": self.comm.micro_batches}),
        }


class InfeasibleLayout(ValueError):
    """Raised by callers that must fail fast (the Prefect preflight); carries the plan."""

    def __init__(self, plan: Plan) -> None:
        super().__init__("infeasible parallel layout:\n  " + "\n  ".join(plan.reasons))
        self.plan = plan

