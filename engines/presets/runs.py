"""Named run presets, CLI-style overrides, and the preflight planner entry point.

    from engines.presets.runs import preflight_plan, resolve
    plan = preflight_plan("dsv4-flash-mi355x", {"pp": 4, "pp_last": 10})   # raises InfeasibleLayout if not
    preset, layout_input = resolve("dsv4-flash-mi355x", {"num_rollout": 20})

Presets:
  dsv4-flash-mi355x         the seed's run: 2 rollout + 2 actor nodes of 8 MI355X, TP1 PP4 EP4 (last stage 10 layers)
  dsv4-flash-mi355x-1node   Miles' own launcher preset for 1 actor node (colocated, TP8 EP8)
  dsv4-flash-mi355x-32gpu   Miles' own launcher preset for 32 actor GPUs (colocated, TP4 PP4 EP8, 11+11+11+10)
  cluster-rehearsal         the seed's Miles job at the rehearsal's sizes on a local Ray head (logical GPUs), the
                            Miles-legal tiny model: the deployment `rl-pipeline/cluster-rehearsal` runs it
  tiny-cpu                  the embedded default (no Miles)
The two `-1node` / `-32gpu` presets reproduce `scripts/amd/run_deepseek_v4.py train` at Miles 31f1ca961
setting by setting (tests/conformance/test_miles_launcher.py records that launcher and compares).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from engines.presets.flash import flash_config
from engines.layout import (ClusterSpec, InfeasibleLayout, LayoutInput, ModelShape, ParallelSpec, Plan,
                            RolloutSpec, TrainSpec, dsv4_flash_shape, plan_layout, tiny_cpu_shape)
from engines.profiles import HardwareProfile, get_profile
from engines.presets.spec import AlgorithmSpec, DataSpec, EvalSpec, MilesSettings, RunPreset
from rl.correction_setting import RolloutCorrection
from rl.known_fields import check_known_fields

SEED_RUN = RunPreset(
    name="dsv4-flash-mi355x",
    description="The seed run: DeepSeek-V4-Flash GRPO on 4 x 8 MI355X, 2 rollout + 2 actor nodes, TP1 PP4 EP4.",
    model=dsv4_flash_shape, hf_config=flash_config, profile="mi355x", nodes=4, rollout_nodes=2,
    parallel=ParallelSpec(tp=1, pp=4, ep=4, etp=1, cp=1, last_stage_layers=10),
    train=TrainSpec(max_tokens_per_gpu=8192, micro_batching="per-sample", recompute="full", optimizer_offload=1.0,
                    rollout_batch_size=32, n_samples_per_prompt=8, num_steps_per_rollout=1, max_prompt_len=2048,
                    max_response_len=4096),
    rollout=RolloutSpec(engine_tp=4, engine_ep=4, engine_dp=1, max_running_requests=48, max_total_tokens=524288,
                        context_length=16384, mem_fraction_static=0.5),  # 0.5: Miles' DeepSeek-V4 launcher
    num_rollout=200, eval=EvalSpec(interval=10, n_samples_per_prompt=8, n_problems=30),  # AIME 2024's 30
)

# Miles' AMD launcher (scripts/amd/run_deepseek_v4.py `train`, --mode normal) for the two layouts it has a
# preset for; every value below is the launcher's (its `_get_parallel_config`, rollout/eval/perf args).
_MILES_LAUNCHER_TRAIN = TrainSpec(max_tokens_per_gpu=2048, micro_batching="per-sample", recompute="full",
                                  optimizer_offload=1.0,
                                  rollout_batch_size=32, n_samples_per_prompt=8, num_steps_per_rollout=1,
                                  max_prompt_len=2048, max_response_len=8192)
_MILES_LAUNCHER_ROLLOUT = RolloutSpec(engine_tp=4, engine_ep=4, engine_dp=1, max_running_requests=48,
                                      max_total_tokens=524288, context_length=16384, mem_fraction_static=0.5)
_MILES_LAUNCHER_EVAL = EvalSpec(n_problems=30)  # AIME 2024's 30: the whole set, which is what Miles evaluates
MILES_1NODE_RUN = RunPreset(
    name="dsv4-flash-mi355x-1node",
    description="Miles' launcher preset for 1 actor node: 8 MI355X colocated, TP8 (SP) EP8.",
    model=dsv4_flash_shape, hf_config=flash_config, profile="mi355x", nodes=1, rollout_nodes=0,
    parallel=ParallelSpec(tp=8, pp=1, ep=8, etp=1, cp=1),
    train=_MILES_LAUNCHER_TRAIN, rollout=_MILES_LAUNCHER_ROLLOUT, num_rollout=3000, eval=_MILES_LAUNCHER_EVAL,
)
MILES_32GPU_RUN = RunPreset(
    name="dsv4-flash-mi355x-32gpu",
    description="Miles' launcher preset for 32 actor GPUs: 4 x 8 MI355X colocated, TP4 (SP) PP4 EP8, 11+11+11+10.",
    model=dsv4_flash_shape, hf_config=flash_config, profile="mi355x", nodes=4, rollout_nodes=0,
    parallel=ParallelSpec(tp=4, pp=4, ep=8, etp=1, cp=1, first_stage_layers=11, last_stage_layers=10),
    # 4 actor nodes: the launcher keeps a quarter of Adam on GPU and the train weights resident
    train=dataclasses.replace(_MILES_LAUNCHER_TRAIN, optimizer_offload=0.75), rollout=_MILES_LAUNCHER_ROLLOUT,
    num_rollout=3000, eval=_MILES_LAUNCHER_EVAL, miles=MilesSettings(offload_train=False),
)
# The embedded run, as `v4rl train`, the rl-pipeline form (PipelineParams) and `v4rl plan --preset tiny-cpu` all run
# it: 100 steps of 128 prompts x 8 samples at lr 1e-4, 8 new tokens at temperature 1, evaluated on 200 held-out
# problems x 8 samples every 10 steps (docs/results.md measured exactly this).
TINY_RUN = RunPreset(
    name="tiny-cpu",
    description="The embedded default: the tiny DeepSeek-V4 on one CPU, rollout and trainer colocated, no Miles.",
    model=tiny_cpu_shape, profile="cpu", nodes=1, rollout_nodes=0, parallel=ParallelSpec(),
    train=TrainSpec(max_tokens_per_gpu=8192, recompute="none", optimizer_offload=0.0, rollout_batch_size=128,
                    n_samples_per_prompt=8, num_steps_per_rollout=1, max_prompt_len=192, max_response_len=8,
                    reserve_gb=0.5),
    rollout=RolloutSpec(engine_tp=1, engine_ep=1, engine_dp=1, max_running_requests=128, max_total_tokens=65536,
                        context_length=512, mem_fraction_static=0.5, expert_format="fp4", kv_bytes_per_elem=4.0,
                        reserve_gb=0.5),
    num_rollout=100, seed=0, mode="normal",
    data=DataSpec(prompt_data="", chat_template_kwargs=None, temperature=1.0),
    eval=EvalSpec(interval=10, n_samples_per_prompt=8, n_problems=200, max_response_len=8,
                  datasets=(("held-out", ""),)),
    algorithm=AlgorithmSpec(lr=1e-4),
)


def tiny_miles_shape() -> ModelShape:
    """The shape of engines/presets/models.py tiny_miles_config (the rehearsal's Miles-legal tiny model); imports
    the model package (torch) when called, as a preset's model is only when planned."""
    from engines.presets.models import tiny_miles_config

    return ModelShape.from_config(tiny_miles_config())


# The seed's job as the cluster-rehearsal deployment runs it on this host (flows/params.py PipelineParams.engines,
# engines/upstream/rehearsal/cluster_run.py): the rehearsal's sizes (engines/upstream/rehearsal/job.py ROLLOUT_SIZES,
# FULL_CHANGES; tests/test_one_definition.py keeps them equal), the Miles-legal tiny model, one logical GPU for the
# actor and one for the external engine (two "nodes" of one), so that Miles' parser, checking the job that is
# submitted, resolves every value to this preset's.
REHEARSAL_RUN = dataclasses.replace(
    SEED_RUN, name="cluster-rehearsal",
    description="The seed's Miles job at the rehearsal's sizes on a local Ray head with logical GPUs: the tiny "
                "Miles-legal DeepSeek-V4, 3 rollouts of 2 prompts x 2, evaluated every rollout.",
    model=tiny_miles_shape, hf_config=None, nodes=2, rollout_nodes=1, gpus_per_node=1,
    parallel=ParallelSpec(),
    train=dataclasses.replace(SEED_RUN.train, rollout_batch_size=2, n_samples_per_prompt=2, max_response_len=24,
                              optimizer_offload=0.0),
    rollout=dataclasses.replace(SEED_RUN.rollout, engine_tp=1, engine_ep=1),
    num_rollout=3, data=dataclasses.replace(SEED_RUN.data, prompt_data="train.jsonl"),
    eval=dataclasses.replace(SEED_RUN.eval, interval=1, n_samples_per_prompt=4, n_problems=4, max_response_len=24,
                             datasets=(("aime", "eval.jsonl"),)),
    algorithm=dataclasses.replace(SEED_RUN.algorithm, lr=1e-3),
    miles=dataclasses.replace(SEED_RUN.miles, save_interval=1),
)
SHORT_RUNS: dict[str, dict[str, Any]] = {
    "demo": dict(steps=8, n_eval=128),
    "nightly": dict(steps=4, eval_interval=4, prompts_per_step=32, n_eval=64),
}
"""The smaller tiny-cpu runs, as overrides of TINY_RUN in the form's names (RUN_NUMBERS): `v4rl demo` (about two
minutes; its eval_interval follows --steps, halfway and at the end) and the nightly validation (flows/nightly.py).
The demo trains the preset's 128 prompts x 8 samples per step, so that it shows learning: 8 such steps raise
held-out pass@1 0.295 -> 0.379 on 128 problems (± 0.022, beyond twice the noise); 10 steps of 32 prompts, the
demo until 2026-12-06, moved it +0.010 on 64 problems (± 0.028) and lr 3e-4 on them made it worse (-0.090)."""
RUN_PRESETS: dict[str, RunPreset] = {p.name: p for p in (SEED_RUN, MILES_1NODE_RUN, MILES_32GPU_RUN, REHEARSAL_RUN,
                                                          TINY_RUN)}

# override key -> (section, field); "pp" clears the preset's first/last stage sizes (give pp_first/pp_last too).
# Sections: parallel/train/rollout (planner inputs), cluster (ClusterSpec), run (RunPreset itself),
# eval/algorithm/data/miles (the Miles job only).
OVERRIDES: dict[str, tuple[str, str]] = {
    "tp": ("parallel", "tp"), "pp": ("parallel", "pp"), "ep": ("parallel", "ep"), "etp": ("parallel", "etp"),
    "cp": ("parallel", "cp"), "pp_first": ("parallel", "first_stage_layers"),
    "pp_last": ("parallel", "last_stage_layers"), "sequence_parallel": ("parallel", "sequence_parallel"),
    "nodes": ("cluster", "nodes"), "rollout_nodes": ("cluster", "rollout_nodes"),
    "gpus_per_node": ("cluster", "gpus_per_node"), "hbm_gb": ("cluster", "hbm_gb"),
    "host_memory_gb": ("cluster", "host_memory_gb"),
    "max_tokens_per_gpu": ("train", "max_tokens_per_gpu"), "micro_batching": ("train", "micro_batching"),
    "recompute": ("train", "recompute"),
    "optimizer_offload": ("train", "optimizer_offload"), "rollout_batch_size": ("train", "rollout_batch_size"),
    "n_samples_per_prompt": ("train", "n_samples_per_prompt"),
    "num_steps_per_rollout": ("train", "num_steps_per_rollout"), "max_response_len": ("train", "max_response_len"),
    "max_prompt_len": ("train", "max_prompt_len"),
    "sglang_tp": ("rollout", "engine_tp"), "sglang_ep": ("rollout", "engine_ep"), "sglang_dp": ("rollout", "engine_dp"),
    "max_running_requests": ("rollout", "max_running_requests"), "max_total_tokens": ("rollout", "max_total_tokens"),
    "context_length": ("rollout", "context_length"), "mem_fraction_static": ("rollout", "mem_fraction_static"),
    "num_rollout": ("run", "num_rollout"), "mode": ("run", "mode"), "seed": ("run", "seed"),
    "eval_interval": ("eval", "interval"), "n_samples_per_eval_prompt": ("eval", "n_samples_per_prompt"),
    "eval_problems": ("eval", "n_problems"), "temperature": ("data", "temperature"),
    "eval_datasets": ("eval", "datasets"), "eval_max_response_len": ("eval", "max_response_len"),
    "prompt_data": ("data", "prompt_data"), "input_key": ("data", "input_key"), "label_key": ("data", "label_key"),
    "lr": ("algorithm", "lr"), "use_tis": ("algorithm", "use_tis"),
    "rollout_correction": ("algorithm", "rollout_correction"), "loss_aggregation": ("algorithm", "loss_aggregation"),
    "fp8_training": ("miles", "fp8_training"), "rollout_routing_replay": ("miles", "rollout_routing_replay"),
    "fault_tolerance": ("miles", "fault_tolerance"), "save_interval": ("miles", "save_interval"),
    "miles_generation": ("miles", "generation"), "dsv4_impl": ("miles", "dsv4_impl"),
}
_SECTIONS = ("parallel", "cluster", "train", "rollout", "run", "eval", "algorithm", "data", "miles")
RUN_NUMBERS: dict[str, str] = {
    "steps": "num_rollout", "prompts_per_step": "rollout_batch_size", "n_samples": "n_samples_per_prompt",
    "lr": "lr", "eval_interval": "eval_interval", "n_eval": "eval_problems",
    "eval_samples": "n_samples_per_eval_prompt", "seed": "seed",
    "max_new_tokens": "max_response_len", "temperature": "temperature", "max_tokens_per_gpu": "max_tokens_per_gpu",
}
"""A run's numbers as `v4rl train`, the rl-pipeline form and the embedded loop name them -> their OVERRIDES key (the
preset field they are): the one translation between the two vocabularies (steps / num_rollout, ...)."""


def run_numbers(preset: RunPreset | str) -> dict[str, Any]:
    """The preset's numbers under RUN_NUMBERS' names: what `v4rl train`, PipelineParams and the embedded trainer
    default to, and what `v4rl plan` plans.

    >>> run_numbers("tiny-cpu")["steps"], run_numbers("dsv4-flash-mi355x")["prompts_per_step"]
    (100, 32)
    """
    preset = get_run_preset(preset) if isinstance(preset, str) else preset
    out = {}
    for name, key in RUN_NUMBERS.items():
        section, field = OVERRIDES[key]
        out[name] = getattr(preset if section == "run" else getattr(preset, section), field)
    return out


def preset_name(name: str) -> str:
    """The canonical spelling of a preset name: case and `_` / `-` do not matter (`tiny_cpu` is `tiny-cpu`), so
    every command and flow parameter accepts the same spellings. ValueError naming the closest known preset and
    listing all of them otherwise.

    >>> preset_name("Tiny_CPU")
    'tiny-cpu'
    """
    import difflib

    canonical = str(name).strip().lower().replace("_", "-")
    if canonical in RUN_PRESETS:
        return canonical
    close = difflib.get_close_matches(canonical, sorted(RUN_PRESETS), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ValueError(f"unknown preset {name!r}; {hint}known: {', '.join(sorted(RUN_PRESETS))}")


def get_run_preset(name: str) -> RunPreset:
    """The named run preset (any spelling `preset_name` accepts); ValueError listing the known names otherwise."""
    return RUN_PRESETS[preset_name(name)]


def apply_overrides(preset: RunPreset, overrides: Mapping[str, Any] | None) -> tuple[RunPreset, dict[str, Any]]:
    """(the preset with CLI-style overrides applied, ClusterSpec overrides); keys of OVERRIDES, None ignored.

    Two more keys: "profile" (a hardware profile name) and "model_config" (a HF config.json to plan instead
    of the preset's model; reading it imports the model package, so it costs the torch import once).
    """
    given = {k: v for k, v in (overrides or {}).items() if v is not None and k not in ("profile", "model_config")}
    check_known_fields(given, OVERRIDES, "preset overrides")
    parts: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    if "pp" in given:  # an explicit PP takes its stage sizes from pp_first/pp_last only, not from the preset
        parts["parallel"].update(first_stage_layers=None, last_stage_layers=None)
    for key, value in given.items():
        section, name = OVERRIDES[key]
        if key == "rollout_correction":  # a mode name or the setting's dict (a task's JSON arguments)
            value = RolloutCorrection.coerce(value)
        parts[section][name] = tuple(map(tuple, value)) if key == "eval_datasets" else value
    cluster = parts.pop("cluster")
    model_config = (overrides or {}).get("model_config")
    return dataclasses.replace(
        preset, nodes=cluster.pop("nodes", preset.nodes),
        rollout_nodes=cluster.pop("rollout_nodes", preset.rollout_nodes),
        **parts["run"],
        **{name: dataclasses.replace(getattr(preset, name), **parts[name])
           for name in ("parallel", "train", "rollout", "eval", "algorithm", "data", "miles")},
        profile=(overrides or {}).get("profile") or preset.profile,
        model=_model_from(model_config) if model_config else preset.model,
        hf_config=_config_from(model_config) if model_config else preset.hf_config,
    ), cluster


def _model_from(config_json: str) -> Callable[[], ModelShape]:
    shape = ModelShape.from_hf_config(config_json)  # read once, up front: a bad path fails here (ValueError)
    return lambda: shape


def _config_from(config_json: str) -> Callable[[], dict[str, Any]]:
    import json
    from pathlib import Path

    path = Path(config_json)
    raw = json.loads((path / "config.json" if path.is_dir() else path).read_text())  # a checkpoint dir: its config
    return lambda: dict(raw)


def layout_input(preset: RunPreset, cluster_overrides: Mapping[str, Any] | None = None,
                 profile: HardwareProfile | None = None) -> LayoutInput:
    """The planner input for a preset on its (or the given) hardware profile."""
    prof = profile or get_profile(preset.profile)
    cluster = ClusterSpec(nodes=preset.nodes, rollout_nodes=preset.rollout_nodes,
                          gpus_per_node=preset.gpus_per_node or prof.gpus_per_node,
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
