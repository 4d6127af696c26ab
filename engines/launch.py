"""Run presets, the preflight entry point, and cluster launch plans (what runs where) as JSON.

A `RunPreset` is one RL run's shape: model, hardware profile, nodes split between rollout and actor, Megatron
parallelism, batch and sampling sizes, SGLang limits, eval cadence. `preflight_plan` turns a preset plus
overrides into a checked `engines.layout.Plan` (the Prefect preflight task calls it and fails fast);
`launch_plan` lists the exact processes per node: Ray head/workers, the Miles driver command, every Megatron
rank with its grid coordinates, arguments and environment, every SGLang engine with its GPUs and arguments,
and the Ray placement group Miles builds.

    plan = preflight_plan("dsv4-flash-mi355x", {"pp": 4, "pp_last": 10})   # raises InfeasibleLayout if not
    print(json.dumps(launch_plan("dsv4-flash-mi355x", site=Site(head_ip="10.0.0.1")), indent=1))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engines.layout import (ClusterSpec, InfeasibleLayout, LayoutInput, ModelShape, ParallelSpec, Plan,
                            RolloutSpec, TrainSpec, dsv4_flash_shape, plan_layout, tiny_cpu_shape)
from engines.profiles import HardwareProfile, get_profile

if TYPE_CHECKING:
    from engines.train.miles import MilesJob


@dataclass(frozen=True, kw_only=True)
class RunPreset:
    """One named RL run: everything the planner, the launch plan and the Miles command line need."""

    name: str
    description: str
    model: Callable[[], ModelShape]
    """Model shape provider (cheap: no torch)."""
    profile: str
    """Hardware profile name (engines.profiles)."""
    nodes: int
    """--num-nodes."""
    rollout_nodes: int
    """--rollout-num-nodes (0 = colocated); the actor gets the rest (--actor-num-nodes)."""
    parallel: ParallelSpec
    train: TrainSpec
    rollout: RolloutSpec
    num_rollout: int = 200
    """--num-rollout: rollout steps of the run."""
    mode: str = "normal"
    """Miles launcher --mode (normal adds DAPO over-sampling and the nonzero-std filter)."""
    enable_eval: bool = True
    """--enable-eval."""
    eval_interval: int = 10
    """--eval-interval: evaluate every N rollouts."""
    n_samples_per_eval_prompt: int = 8
    """--n-samples-per-eval-prompt (pass@k up to k = this)."""
    eval_dataset: str = "aime-2024"
    use_tis: bool = True
    """--use-tis: truncated importance sampling on the train/rollout mismatch."""


SEED_RUN = RunPreset(
    name="dsv4-flash-mi355x",
    description="The seed run: DeepSeek-V4-Flash GRPO on 4 x 8 MI355X, 2 rollout + 2 actor nodes, TP1 PP4 EP4.",
    model=dsv4_flash_shape, profile="mi355x", nodes=4, rollout_nodes=2,
    parallel=ParallelSpec(tp=1, pp=4, ep=4, etp=1, cp=1, last_stage_layers=10),
    train=TrainSpec(max_tokens_per_gpu=8192, recompute="full", optimizer_offload=1.0, rollout_batch_size=32,
                    n_samples_per_prompt=8, num_steps_per_rollout=1, max_prompt_len=2048, max_response_len=4096),
    rollout=RolloutSpec(engine_tp=4, engine_ep=4, engine_dp=1, max_running_requests=48, max_total_tokens=524288,
                        context_length=16384, mem_fraction_static=0.5),  # 0.5: Miles' DeepSeek-V4 launcher
)
TINY_RUN = RunPreset(
    name="tiny-cpu",
    description="The embedded default: the tiny DeepSeek-V4 on one CPU, rollout and trainer colocated, no Miles.",
    model=tiny_cpu_shape, profile="cpu", nodes=1, rollout_nodes=0, parallel=ParallelSpec(),
    train=TrainSpec(max_tokens_per_gpu=2048, recompute="none", optimizer_offload=0.0, rollout_batch_size=16,
                    n_samples_per_prompt=8, num_steps_per_rollout=1, max_prompt_len=192, max_response_len=64,
                    reserve_gb=0.5),
    rollout=RolloutSpec(engine_tp=1, engine_ep=1, engine_dp=1, max_running_requests=128, max_total_tokens=65536,
                        context_length=512, mem_fraction_static=0.5, expert_format="fp4", kv_bytes_per_elem=4.0,
                        reserve_gb=0.5),
    num_rollout=300, mode="normal", eval_interval=25, n_samples_per_eval_prompt=8, eval_dataset="held-out",
)
RUN_PRESETS: dict[str, RunPreset] = {p.name: p for p in (SEED_RUN, TINY_RUN)}

# override key -> (section, field); "pp" clears the preset's first/last stage sizes (give pp_first/pp_last too)
OVERRIDES: dict[str, tuple[str, str]] = {
    "tp": ("parallel", "tp"), "pp": ("parallel", "pp"), "ep": ("parallel", "ep"), "etp": ("parallel", "etp"),
    "cp": ("parallel", "cp"), "pp_first": ("parallel", "first_stage_layers"),
    "pp_last": ("parallel", "last_stage_layers"), "sequence_parallel": ("parallel", "sequence_parallel"),
    "nodes": ("cluster", "nodes"), "rollout_nodes": ("cluster", "rollout_nodes"),
    "gpus_per_node": ("cluster", "gpus_per_node"), "hbm_gb": ("cluster", "hbm_gb"),
    "host_memory_gb": ("cluster", "host_memory_gb"),
    "max_tokens_per_gpu": ("train", "max_tokens_per_gpu"), "recompute": ("train", "recompute"),
    "optimizer_offload": ("train", "optimizer_offload"), "rollout_batch_size": ("train", "rollout_batch_size"),
    "n_samples_per_prompt": ("train", "n_samples_per_prompt"),
    "num_steps_per_rollout": ("train", "num_steps_per_rollout"), "max_response_len": ("train", "max_response_len"),
    "max_prompt_len": ("train", "max_prompt_len"),
    "sglang_tp": ("rollout", "engine_tp"), "sglang_ep": ("rollout", "engine_ep"), "sglang_dp": ("rollout", "engine_dp"),
    "max_running_requests": ("rollout", "max_running_requests"), "max_total_tokens": ("rollout", "max_total_tokens"),
    "context_length": ("rollout", "context_length"), "mem_fraction_static": ("rollout", "mem_fraction_static"),
}


def get_run_preset(name: str) -> RunPreset:
    """The named run preset; ValueError listing the known names otherwise."""
    try:
        return RUN_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(RUN_PRESETS))}") from None


def apply_overrides(preset: RunPreset, overrides: Mapping[str, Any] | None) -> tuple[RunPreset, dict[str, Any]]:
    """(the preset with CLI-style overrides applied, ClusterSpec overrides); keys of OVERRIDES, None ignored.

    Two more keys: "profile" (a hardware profile name) and "model_config" (a HF config.json to plan instead
    of the preset's model; reading it imports the model package, so it costs the torch import once).
    """
    given = {k: v for k, v in (overrides or {}).items() if v is not None and k not in ("profile", "model_config")}
    unknown = sorted(set(given) - set(OVERRIDES))
    if unknown:
        raise ValueError(f"unknown override(s) {unknown}; known: {', '.join(sorted(OVERRIDES))}")
    parts: dict[str, dict[str, Any]] = {"parallel": {}, "cluster": {}, "train": {}, "rollout": {}}
    if "pp" in given:  # an explicit PP takes its stage sizes from pp_first/pp_last only, not from the preset
        parts["parallel"].update(first_stage_layers=None, last_stage_layers=None)
    for key, value in given.items():
        section, name = OVERRIDES[key]
        parts[section][name] = value
    cluster = parts.pop("cluster")
    return dataclasses.replace(
        preset, nodes=cluster.pop("nodes", preset.nodes),
        rollout_nodes=cluster.pop("rollout_nodes", preset.rollout_nodes),
        parallel=dataclasses.replace(preset.parallel, **parts["parallel"]),
        train=dataclasses.replace(preset.train, **parts["train"]),
        rollout=dataclasses.replace(preset.rollout, **parts["rollout"]),
        profile=(overrides or {}).get("profile") or preset.profile,
        model=_model_from(overrides.get("model_config")) if overrides and overrides.get("model_config")
        else preset.model,
    ), cluster


def _model_from(config_json: str) -> Callable[[], ModelShape]:
    shape = ModelShape.from_hf_config(config_json)  # read once, up front: a bad path fails here (ValueError)
    return lambda: shape


def layout_input(preset: RunPreset, cluster_overrides: Mapping[str, Any] | None = None,
                 profile: HardwareProfile | None = None) -> LayoutInput:
    """The planner input for a preset on its (or the given) hardware profile."""
    prof = profile or get_profile(preset.profile)
    cluster = ClusterSpec(nodes=preset.nodes, rollout_nodes=preset.rollout_nodes, gpus_per_node=prof.gpus_per_node,
                          hbm_gb=prof.hbm_gb, host_memory_gb=prof.host_memory_gb,
                          intra_node_gbps=prof.intra_node_gbps, inter_node_gbps=prof.inter_node_gbps)
    cluster = dataclasses.replace(cluster, **dict(cluster_overrides or {}))
    return LayoutInput(model=preset.model(), cluster=cluster, parallel=preset.parallel, train=preset.train,
                       rollout=preset.rollout)


def resolve(preset_name: str, overrides: Mapping[str, Any] | None = None) -> tuple[RunPreset, LayoutInput]:
    """Preset + overrides -> (effective preset, planner input)."""
    preset, cluster = apply_overrides(get_run_preset(preset_name), overrides)
    return preset, layout_input(preset, cluster)


def preflight_plan(preset_name: str, overrides: Mapping[str, Any] | None = None, *,
                   raise_on_infeasible: bool = True) -> Plan:
    """Plan the preset's layout. Raises InfeasibleLayout (its .plan has reasons) unless raise_on_infeasible=False.

    Bad input (unknown preset or override, a size < 1) raises ValueError. Runs in milliseconds, no GPUs.
    """
    _, inp = resolve(preset_name, overrides)
    plan = plan_layout(inp)
    if raise_on_infeasible and not plan.feasible:
        raise InfeasibleLayout(plan)
    return plan


# ------------------------------------------------------------------------------------------- launch plans
@dataclass(frozen=True, kw_only=True)
class Site:
    """Site-specific values of the seed's `export`s and `ray start` lines; None renders as a ${VAR} reference."""

    head_ip: str | None = None
    """$HEAD_IP: node 0, Ray head and Miles driver."""
    worker_ips: tuple[str, ...] = ()
    """$WORKER_IP of nodes 1.. in order (Miles sorts placement bundles by node IP, so list them sorted)."""
    master_addr: str | None = None
    """MASTER_ADDR (torch.distributed rendezvous); None = head_ip."""
    ray_address: str | None = None
    """RAY_ADDRESS the Miles job is submitted to; None = http://<head_ip>:8265 (the Ray Jobs API)."""
    socket_ifname: str | None = None
    """NCCL_SOCKET_IFNAME: the NIC for bootstrap traffic."""
    gloo_socket_ifname: str | None = None
    """GLOO_SOCKET_IFNAME; defaults to socket_ifname."""
    tp_socket_ifname: str | None = None
    """TP_SOCKET_IFNAME (tensorpipe / RPC); defaults to socket_ifname."""
    ib_hca: str | None = None
    """NCCL_IB_HCA: the RDMA devices RCCL/NCCL may use (e.g. "rdma0,rdma1,...")."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """More cluster-wide exports."""

    def ip(self, node: int) -> str:
        if node == 0:
            return self.head_ip or "${HEAD_IP}"
        return self.worker_ips[node - 1] if node - 1 < len(self.worker_ips) else f"${{WORKER_IP_{node}}}"

    def env(self, profile: HardwareProfile) -> dict[str, str]:
        """The seed's exports, in its order: rendezvous, external Ray, unbuffered logs, interfaces, HCAs, GID."""
        ray = self.ray_address or (f"http://{self.head_ip}:8265" if self.head_ip else "${RAY_ADDRESS}")
        env = {"MASTER_ADDR": self.master_addr or self.head_ip or "${MASTER_ADDR}", "MILES_SCRIPT_EXTERNAL_RAY": "1",
               "RAY_ADDRESS": ray, "PYTHONUNBUFFERED": "1"}
        site = {"NCCL_SOCKET_IFNAME": self.socket_ifname, "NCCL_IB_HCA": self.ib_hca,
                "GLOO_SOCKET_IFNAME": self.gloo_socket_ifname or self.socket_ifname,
                "TP_SOCKET_IFNAME": self.tp_socket_ifname or self.socket_ifname}
        for key in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "NCCL_IB_HCA"):
            if key in profile.site_env:
                env[key] = site[key] or f"${{{key}}}"
        return {**env, **profile.comm_env, **self.extra_env}


def _coords(rank: int, sizes: list[tuple[str, int]]) -> dict[str, int]:
    """Megatron's rank -> grid coordinates for an order like tp-cp-ep-dp-pp (first varies fastest)."""
    out = {}
    for name, size in sizes:
        out[name], rank = rank % size, rank // size
    return out


def launch_plan(preset_name: str, overrides: Mapping[str, Any] | None = None, *, site: Site | None = None,
                job: MilesJob | None = None) -> dict[str, Any]:
    """Every process of the cluster run, per node, as a JSON-able dict (see the module docstring).

    `job` holds the paths and run id; without one the plan shows ${HF_CHECKPOINT}-style placeholders.
    """
    from engines.train import miles

    preset, inp = resolve(preset_name, overrides)
    profile, site = get_profile(preset.profile), site or Site()
    job = job or miles.MilesJob.placeholder(preset, profile)
    plan = plan_layout(inp)
    c, p, r = inp.cluster, inp.parallel, inp.rollout
    env = site.env(profile)
    rank_env = {**env, **profile.launcher_env, **job.extra_env}
    megatron_args = miles.megatron_parallel_args(preset)
    stage_start = [sum(plan.pipeline_layers[:i]) for i in range(len(plan.pipeline_layers))]
    nodes: list[dict[str, Any]] = []
    for n in range(c.nodes):
        gpus = f"--num-gpus={c.gpus_per_node}"
        ray = (f"ray start --head --node-ip-address={site.ip(0)} --port=6379 {gpus}" if n == 0
               else f"ray start --address={site.ip(0)}:6379 --node-ip-address={site.ip(n)} {gpus}")
        role = "actor+rollout" if c.colocated else ("actor" if n < c.actor_nodes else "rollout")
        nodes.append({"index": n, "ip": site.ip(n), "role": role,
                      "processes": [{"kind": "ray-head" if n == 0 else "ray-worker", "command": ray}]})
    nodes[0]["processes"].append({"kind": "miles-driver", "argv": miles.launcher_argv(preset, profile, job),
                                  "cwd": job.miles_dir, "env": env, "log": job.log_path})
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
            "ray": {"num_gpus": 0.4, "bundle": rank}, "args": megatron_args, "env": rank_env})
    first_rollout = 0 if c.colocated else c.actor_world
    engines = c.rollout_gpus // r.engine_tp if r.engine_tp else 0
    for i in range(engines):
        gpu = first_rollout + i * r.engine_tp
        node = gpu // c.gpus_per_node
        nodes[node]["processes"].append({
            "kind": "sglang-engine", "engine": i, "gpus": list(range(gpu % c.gpus_per_node,
                                                                     gpu % c.gpus_per_node + r.engine_tp)),
            "ray": {"num_gpus": 0.2, "bundle": gpu},
            "argv": miles.sglang_server_argv(preset, job, base_gpu_id=gpu % c.gpus_per_node), "env": rank_env})
    return {
        "preset": preset.name, "profile": profile.name, "accelerator": profile.accelerator,
        "docker_image": profile.docker_image, "fp8_dtype": profile.fp8_dtype, "feasible": plan.feasible,
        "reasons": plan.reasons,
        "cluster": {"nodes": c.nodes, "gpus_per_node": c.gpus_per_node, "actor_nodes": c.actor_nodes,
                    "rollout_nodes": c.rollout_nodes, "colocated": c.colocated},
        "env": env, "launcher_env": dict(profile.launcher_env),
        "ray": {"resources_per_node": {"GPU": c.gpus_per_node},
                "placement_group": {"bundle": {"GPU": 1, "CPU": 1}, "strategy": "PACK",
                                    "bundles": max(c.actor_world, c.rollout_gpus) if c.colocated
                                    else c.actor_world + c.rollout_gpus,
                                    "actor_bundles": [0, c.actor_world],
                                    "rollout_bundles": [first_rollout, first_rollout + c.rollout_gpus]}},
        "miles_command": miles.launcher_argv(preset, profile, job),
        "miles_train_args": miles.train_args(preset, profile, job),
        "nodes": nodes,
    }
