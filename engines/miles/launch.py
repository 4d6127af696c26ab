"""Cluster launch plans (what runs where) as JSON; re-exports the run presets and the preflight entry point.

`launch_plan` lists the exact processes per node: Ray head/workers, the `ray job submit` of the Miles job v4rl
builds (its whole `train.py` argv and runtime env), every Megatron rank with its grid coordinates, parallel
flags and environment, every SGLang engine with its GPUs and the engine flags of that same argv, and the Ray
placement group Miles builds. Presets, overrides and `preflight_plan` live in engines/presets/runs.py and the
`Site` in engines/profiles/site.py (both below this module and engines/miles, which imports neither this module).

    plan = preflight_plan("dsv4-flash-mi355x", {"pp": 4, "pp_last": 10})   # raises InfeasibleLayout if not
    print(json.dumps(launch_plan("dsv4-flash-mi355x", site=Site(head_ip="10.0.0.1")), indent=1))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engines.layout import InfeasibleLayout, plan_layout
from engines.profiles import get_profile
from engines.presets.runs import (MILES_1NODE_RUN, MILES_32GPU_RUN, OVERRIDES, RUN_PRESETS, SEED_RUN, TINY_RUN,
                                 apply_overrides, get_run_preset, layout_input, preflight_plan, resolve)
from engines.presets.spec import RunPreset
from engines.profiles.site import Site
from engines import miles

__all__ = ["InfeasibleLayout", "MILES_1NODE_RUN", "MILES_32GPU_RUN", "OVERRIDES", "RUN_PRESETS", "RunPreset",
           "SEED_RUN", "Site", "TINY_RUN", "apply_overrides", "get_run_preset", "launch_plan", "layout_input",
           "preflight_plan", "resolve"]

PARALLEL_FLAGS = ("--tensor-model-parallel-size", "--sequence-parallel", "--pipeline-model-parallel-size",
                  "--pipeline-model-parallel-layout", "--decoder-first-pipeline-num-layers",
                  "--decoder-last-pipeline-num-layers", "--context-parallel-size", "--allgather-cp",
                  "--expert-model-parallel-size", "--expert-tensor-parallel-size")
"""The Megatron parallel flags of the Miles job a launch plan shows per actor rank."""


def _coords(rank: int, sizes: list[tuple[str, int]]) -> dict[str, int]:
    """Megatron's rank -> grid coordinates for an order like tp-cp-ep-dp-pp (first varies fastest)."""
    out = {}
    for name, size in sizes:
        out[name], rank = rank % size, rank // size
    return out


def launch_plan(preset_name: str, overrides: Mapping[str, Any] | None = None, *, site: Site | None = None,
                job: miles.MilesJob | None = None) -> dict[str, Any]:
    """Every process of the cluster run, per node, as a JSON-able dict (see the module docstring).

    `job` holds the paths and run id; without one the plan shows ${HF_CHECKPOINT}-style placeholders.
    Everything shown for the Miles job is taken from the one argv and env that would be submitted.
    """
    preset, inp = resolve(preset_name, overrides)
    profile, site = get_profile(preset.profile), site or Site()
    job = job or miles.MilesJob.placeholder(preset, profile)
    plan = plan_layout(inp)
    c, p, r = inp.cluster, inp.parallel, inp.rollout
    command = miles.build_command(preset, job, site=site, cluster=c, profile=profile)
    submit = miles.submit_argv(command, site) if site.resolved_ray_address else \
        miles.submit_argv(command, Site(ray_address="${RAY_ADDRESS}"))
    flags = command.flag_values()
    # the parallel flags exactly as the job has them (a stage split or, for Miles' generation 2, a layout string)
    megatron_args = [a for flag in flags if flag in PARALLEL_FLAGS for a in (flag, *flags[flag])]
    engine_args = [a for flag in ("--rollout-num-gpus-per-engine", *(f for f in flags if f.startswith("--sglang-")))
                   for a in (flag, *flags[flag])]
    stage_start = [sum(plan.pipeline_layers[:i]) for i in range(len(plan.pipeline_layers))]
    nodes: list[dict[str, Any]] = []
    for n in range(c.nodes):
        gpus = f"--num-gpus={c.gpus_per_node}"
        ray = (f"ray start --head --node-ip-address={site.ip(0)} --port=6379 {gpus}" if n == 0
               else f"ray start --address={site.ip(0)}:6379 --node-ip-address={site.ip(n)} {gpus}")
        role = "actor+rollout" if c.colocated else ("actor" if n < c.actor_nodes else "rollout")
        nodes.append({"index": n, "ip": site.ip(n), "role": role,
                      "processes": [{"kind": "ray-head" if n == 0 else "ray-worker", "command": ray}]})
    nodes[0]["processes"].append({"kind": "miles-driver", "argv": submit, "env": site.env(profile),
                                  "log": job.log_path})
    nodes[0]["processes"].append({"kind": "miles-router", "note": "FastAPI proxy in front of the SGLang engines, "
                                                                  "started by Miles on the driver's node"})
    dense = [("tp", p.tp), ("cp", p.cp), ("dp", max(plan.dp, 1)), ("pp", p.pp)]
    expert = [("etp", p.expert_tp), ("ep", p.ep), ("edp", max(plan.edp, 1)), ("pp", p.pp)]
    for rank in range(c.actor_world if plan.pipeline_layers else 0):
        d, e = _coords(rank, dense), _coords(rank, expert)
        stage = d["pp"]
        nodes[rank // c.gpus_per_node]["processes"].append({
            "kind": "megatron-rank", "rank": rank, "local_gpu": rank % c.gpus_per_node,
            "coords": {"tp": d["tp"], "cp": d["cp"], "dp": d["dp"], "pp": stage, "ep": e["ep"], "etp": e["etp"],
                       "edp": e["edp"]},
            "layers": [stage_start[stage], stage_start[stage] + plan.pipeline_layers[stage]],
            "ray": {"num_gpus": 0.4, "bundle": rank}, "args": megatron_args, "env": command.env})
    first_rollout = 0 if c.colocated else c.actor_world
    engines = c.rollout_gpus // r.engine_tp if r.engine_tp else 0
    for i in range(engines):
        gpu = first_rollout + i * r.engine_tp
        node = gpu // c.gpus_per_node
        nodes[node]["processes"].append({
            "kind": "sglang-engine", "engine": i, "gpus": list(range(gpu % c.gpus_per_node,
                                                                     gpu % c.gpus_per_node + r.engine_tp)),
            "ray": {"num_gpus": 0.2, "bundle": gpu}, "args": engine_args, "env": command.env})
    return {
        "preset": preset.name, "profile": profile.name, "accelerator": profile.accelerator,
        "docker_image": profile.docker_image, "fp8_dtype": profile.fp8_dtype, "feasible": plan.feasible,
        "reasons": plan.reasons,
        "cluster": {"nodes": c.nodes, "gpus_per_node": c.gpus_per_node, "actor_nodes": c.actor_nodes,
                    "rollout_nodes": c.rollout_nodes, "colocated": c.colocated},
        "env": site.env(profile),
        "ray": {"resources_per_node": {"GPU": c.gpus_per_node},
                "placement_group": {"bundle": {"GPU": 1, "CPU": 1}, "strategy": "PACK",
                                    "bundles": max(c.actor_world, c.rollout_gpus) if c.colocated
                                    else c.actor_world + c.rollout_gpus,
                                    "actor_bundles": [0, c.actor_world],
                                    "rollout_bundles": [first_rollout, first_rollout + c.rollout_gpus]}},
        "miles": command.to_json(), "miles_submit": submit,
        "nodes": nodes,
    }
