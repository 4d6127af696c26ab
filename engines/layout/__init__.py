"""Parallel layout planner for DeepSeek-V4 RL: Megatron actor + SGLang rollout, checked before a cluster is spent.

Pure functions over frozen dataclasses, no torch and no I/O, so preflight answers in milliseconds:

    from engines.layout import plan_layout, rank_layouts, LayoutInput, ClusterSpec, ParallelSpec, dsv4_flash_shape
    plan = plan_layout(LayoutInput(model=dsv4_flash_shape(), cluster=ClusterSpec(nodes=4, rollout_nodes=2),
                                   parallel=ParallelSpec(pp=4, ep=4, last_stage_layers=10)))
    plan.feasible, plan.reasons, plan.to_json()

`plan_layout` checks every rule (rules.py: Megatron divisibility incl. MoE parallel folding, pipeline
coverage, batch splits, SGLang engine shapes), estimates per-GPU memory on both sides and host RAM
(estimate.py), and adds a rejection naming the biggest consumer and its fix when something does not fit.
`rank_layouts` enumerates TP/PP/EP/ETP/CP for the same cluster and sorts the feasible plans by estimated
communication time per optimizer step (TP all-reduce, PP send/recv, EP all-to-all, CP, gradient sync).
"""

from __future__ import annotations

import math

from engines.layout.estimate import actor_memory, communication, host_memory_per_node, rollout_memory
from engines.layout.rules import balanced_stages, check_rules, pipeline_split
from engines.layout.shape import (CSA, HCA, SLIDING, ModelShape, dsv4_flash_shape, kv_bytes_per_token, layer_params,
                                  tiny_cpu_shape, total_params)
from engines.layout.specs import (ClusterSpec, CommEstimate, InfeasibleLayout, LayoutInput, ParallelSpec, Plan,
                                  RolloutMemory, RolloutSpec, StageMemory, TrainSpec)

__all__ = ["CSA", "ClusterSpec", "CommEstimate", "HCA", "InfeasibleLayout", "LayoutInput", "ModelShape",
           "ParallelSpec", "Plan", "RolloutMemory", "RolloutSpec", "SLIDING", "StageMemory", "TrainSpec",
           "balanced_stages", "dsv4_flash_shape", "kv_bytes_per_token", "layer_params", "pipeline_split",
           "plan_layout", "rank_layouts", "tiny_cpu_shape", "total_params"]

_FIXES = {
    "parameters": "spread the weights: raise --pp or --ep (routed experts are most of them) or add actor nodes",
    "gradients": "spread the weights: raise --pp or --ep or add actor nodes (fp32 main grads are 4 B/param)",
    "optimizer state": "offload it to host memory (--optimizer-offload 1.0) or raise --ep / DP to shard it",
    "activations": "use --recompute full, lower --max-tokens-per-gpu, or raise --cp / --tp",
    "logits": "lower --max-tokens-per-gpu or raise --tp (the logits are vocab-parallel)",
}


def plan_layout(inp: LayoutInput) -> Plan:
    """Check the rules, estimate memory and traffic, and return the Plan (feasible iff no reasons)."""
    reasons, warnings, dp, edp, stages = check_rules(inp)
    c, r = inp.cluster, inp.rollout
    stage_mem = actor_memory(inp, stages, dp, edp) if stages else []
    rollout = rollout_memory(inp)
    host = host_memory_per_node(inp, stage_mem)
    comm = communication(inp, stages, dp, edp) if stages else None
    if stage_mem:
        worst = max(stage_mem, key=lambda s: s.total)
        name, gb = worst.biggest()
        if worst.total > c.hbm_gb:
            reasons.append(f"[actor-memory] pipeline stage {worst.stage} ({worst.layers} layers) needs "
                           f"~{worst.total:,.0f} GB per GPU but the device has {c.hbm_gb:,.0f} GB; biggest "
                           f"consumer: {name} ({gb:,.0f} GB); fix: {_FIXES[name]}.")
        elif worst.total > 0.9 * c.hbm_gb:
            warnings.append(f"[actor-memory] stage {worst.stage} uses ~{worst.total:,.0f} of {c.hbm_gb:,.0f} GB "
                            "(> 90%); fragmentation may still OOM.")
    if host > c.host_memory_gb:
        reasons.append(f"[host-memory] offloaded optimizer state needs ~{host:,.0f} GB of host RAM per actor node "
                       f"but nodes have {c.host_memory_gb:,.0f} GB; fix: lower --optimizer-offload, raise --ep/--pp "
                       "or add actor nodes.")
    if rollout.static > r.mem_fraction_static * c.hbm_gb:
        part = "weights" if rollout.weights >= rollout.kv_cache else "KV cache"
        fix = ("raise --sglang-tp / --sglang-ep (more GPUs per engine) or --mem-fraction-static" if part == "weights"
               else "lower --sglang-max-total-tokens or --sglang-max-running-requests")
        reasons.append(f"[rollout-memory] an SGLang GPU needs ~{rollout.static:,.0f} GB for weights + KV "
                       f"(weights {rollout.weights:,.0f}, KV {rollout.kv_cache:,.1f}) but mem_fraction_static "
                       f"{r.mem_fraction_static} x {c.hbm_gb:,.0f} GB allows {r.mem_fraction_static * c.hbm_gb:,.0f}; "
                       f"biggest consumer: {part}; fix: {fix}.")
    if c.colocated and stage_mem:
        warnings.append("[colocated] rollout and actor share GPUs: relies on Miles --offload-train/--offload-rollout "
                        "swapping one side out while the other runs.")
    return Plan(input=inp, dp=dp, edp=edp, pipeline_layers=stages, stages=stage_mem, rollout=rollout,
                host_gb_per_node=host, comm=comm, reasons=reasons, warnings=warnings)


def _divisors(n: int, cap: int) -> list[int]:
    return [d for d in range(1, min(n, cap) + 1) if n % d == 0]


def rank_layouts(inp: LayoutInput, limit: int = 10, *, include_infeasible: bool = False) -> list[Plan]:
    """Enumerate TP/CP/PP/EP/ETP for this cluster; return the feasible plans, least communication first.

    Plans above 90% of device memory sort after those with headroom (fragmentation makes them risky).
    """
    c, m = inp.cluster, inp.model
    world, plans = c.actor_world, []
    for tp in _divisors(m.num_heads, c.gpus_per_node):
        for cp in (1, 2):
            for pp in _divisors(world // tp, min(m.num_layers, 64)):
                if world % (tp * cp * pp):
                    continue
                first, last = balanced_stages(m.num_layers, pp)
                for ep in _divisors(m.n_routed_experts, world // pp):
                    for etp in sorted({1, tp}):
                        if world % (etp * ep * pp):
                            continue
                        par = ParallelSpec(tp=tp, pp=pp, ep=ep, etp=etp, cp=cp, first_stage_layers=first,
                                           last_stage_layers=last)
                        plan = plan_layout(inp.replace(parallel=par))
                        if plan.feasible or include_infeasible:
                            plans.append(plan)
    plans.sort(key=lambda pl: (not pl.feasible, pl.actor_gb > 0.9 * c.hbm_gb,
                               pl.comm.total_seconds if pl.comm else math.inf, pl.actor_gb))
    return plans[:limit]
