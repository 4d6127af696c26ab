"""The parallel layout planner: the seed's layout fits, the classic mistakes are rejected with rule and fix,
and the parameter estimates agree with the real tensors. NUM_GPUS = 0; runs in about a second.

    .venv/bin/python -m pytest tests/test_layout.py -q
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from engines.miles.launch import preflight_plan, resolve
from engines.layout import (CSA, HCA, ClusterSpec, InfeasibleLayout, LayoutInput, ModelShape, ParallelSpec,
                            balanced_stages, dsv4_flash_shape, kv_bytes_per_token, plan_layout, rank_layouts,
                            tiny_cpu_shape, total_params)

SEED = "dsv4-flash-mi355x"


def _rules(plan) -> list[str]:
    return [r.split("]")[0].lstrip("[") for r in plan.reasons]


# ------------------------------------------------------------------------------------------ the seed layout
def test_seed_layout_fits_288gb_with_offload():
    plan = preflight_plan(SEED)
    assert plan.feasible, plan.reasons
    lay = plan.to_json()["layout"]
    assert (lay["tp"], lay["pp"], lay["ep"], lay["etp"], lay["cp"]) == (1, 4, 4, 1, 1)
    assert plan.pipeline_layers == [11, 11, 11, 10] and sum(plan.pipeline_layers) == 43
    assert (plan.dp, plan.edp) == (4, 1)  # 16 actor GPUs: DP = 16 / (1*4*1), EDP = 16 / (1*4*4)
    assert plan.input.cluster.hbm_gb == 288.0 and plan.actor_gb < 288.0
    assert all(s.optimizer == 0.0 and s.optimizer_host > 100 for s in plan.stages)  # Adam state lives on the host
    assert plan.rollout.total < 288.0 and plan.host_gb_per_node < plan.input.cluster.host_memory_gb


def test_seed_layout_without_offload_runs_out_of_memory_on_optimizer_state():
    plan = preflight_plan(SEED, {"optimizer_offload": 0.0}, raise_on_infeasible=False)
    assert _rules(plan) == ["actor-memory"]
    assert "biggest consumer: optimizer state" in plan.reasons[0] and "--optimizer-offload" in plan.reasons[0]


def test_tp1_pp1_ep1_on_one_node_is_rejected_naming_the_biggest_consumer():
    plan = preflight_plan(SEED, {"tp": 1, "pp": 1, "ep": 1, "nodes": 1, "rollout_nodes": 0},
                          raise_on_infeasible=False)
    assert not plan.feasible and "actor-memory" in _rules(plan)
    reason = next(r for r in plan.reasons if r.startswith("[actor-memory]"))
    assert "biggest consumer: gradients" in reason and "288 GB" in reason and "fix:" in reason
    with pytest.raises(InfeasibleLayout) as err:
        preflight_plan(SEED, {"tp": 1, "pp": 1, "ep": 1, "nodes": 1, "rollout_nodes": 0})
    assert err.value.plan.reasons == plan.reasons


# --------------------------------------------------------------------------------- rejections with the fix
def test_stages_that_do_not_cover_43_layers_are_rejected_with_the_split_that_does():
    plan = preflight_plan(SEED, {"pp": 4}, raise_on_infeasible=False)  # --pp clears the preset's --pp-last
    assert _rules(plan) == ["pp-layer-split"]
    assert "43 layers" in plan.reasons[0] and "fix: --pp 4 --pp-last 10" in plan.reasons[0]
    plan = preflight_plan(SEED, {"pp": 4, "pp_first": 11, "pp_last": 11}, raise_on_infeasible=False)
    assert _rules(plan) == ["pp-layer-split"] and "21 layers left for 2 middle stages" in plan.reasons[0]
    assert preflight_plan(SEED, {"pp": 4, "pp_last": 10}).pipeline_layers == [11, 11, 11, 10]


def test_ep_that_does_not_divide_256_experts_is_rejected():
    plan = preflight_plan(SEED, {"ep": 3}, raise_on_infeasible=False)
    assert "experts-ep" in _rules(plan)
    reason = next(r for r in plan.reasons if r.startswith("[experts-ep]"))
    assert "256 routed experts" in reason and "fix: EP in [1, 2, 4, 8, 16, 32, 64]" in reason


def test_world_size_the_parallel_sizes_do_not_divide_is_rejected():
    plan = preflight_plan(SEED, {"nodes": 5}, raise_on_infeasible=False)  # 3 actor nodes = 24 GPUs
    assert "world-expert" in _rules(plan)
    reason = next(r for r in plan.reasons if r.startswith("[world-expert]"))
    assert "ETP*EP*PP = 1*4*4 = 16" in reason and "24 GPUs" in reason and "fix: EP in [1, 2]" in reason
    plan = preflight_plan(SEED, {"cp": 3}, raise_on_infeasible=False)
    assert _rules(plan)[0] == "world-dense" and "TP*PP*CP = 1*4*3 = 12" in plan.reasons[0]
    assert "fix:" in plan.reasons[0]


def test_moe_parallel_folding_makes_tp8_pp8_ep8_on_64_gpus_legal():
    """Miles' H200 recipe, called 'mathematically impossible' under classic DP rules: EP need not divide DP."""
    inp = LayoutInput(model=dsv4_flash_shape(), cluster=ClusterSpec(nodes=8, hbm_gb=141.0),
                      parallel=ParallelSpec(tp=8, pp=8, ep=8, etp=1, first_stage_layers=4, last_stage_layers=3))
    plan = plan_layout(inp)
    assert plan.dp == 1 and plan.edp == 1  # DP 64/(8*8) = 1, yet EP = 8: experts fold over the TP ranks
    assert not [r for r in _rules(plan) if r.startswith(("world", "pp-", "experts", "heads"))], plan.reasons
    assert plan.pipeline_layers == [4, 6, 6, 6, 6, 6, 6, 3]


def test_per_sample_micro_batches_are_sized_by_the_longest_sample_not_the_packing_budget():
    def activations(**over):
        return [s.activations for s in preflight_plan(SEED, over, raise_on_infeasible=False).stages]

    assert activations(max_tokens_per_gpu=8192) == activations(max_tokens_per_gpu=16384)
    packed = activations(max_tokens_per_gpu=16384, micro_batching="packed")
    assert all(p > s for p, s in zip(packed, activations()))  # 16384 packed tokens > one 6144-token sample


def test_batch_sample_and_rollout_rules():
    assert "batch-steps" in _rules(preflight_plan(SEED, {"num_steps_per_rollout": 3}, raise_on_infeasible=False))
    packed = {"max_tokens_per_gpu": 4096, "micro_batching": "packed"}
    assert "sample-fits" in _rules(preflight_plan(SEED, packed, raise_on_infeasible=False))
    # Miles' DeepSeek-V4 micro-batches are one sample each (bshd): the packing budget does not bound them
    per_sample = preflight_plan(SEED, {"max_tokens_per_gpu": 4096}, raise_on_infeasible=False)
    assert "sample-fits" not in _rules(per_sample)
    assert per_sample.comm.micro_batches == 32 * 8 // per_sample.dp
    bad = preflight_plan(SEED, {"sglang_ep": 3, "max_total_tokens": 8192}, raise_on_infeasible=False)
    assert {"rollout-tp-ep", "rollout-experts-ep", "rollout-kv-tokens"} <= set(_rules(bad))
    assert "sp-needs-tp" in _rules(preflight_plan(SEED, {"sequence_parallel": True}, raise_on_infeasible=False))


def test_bad_input_is_a_value_error_not_a_rejection():
    with pytest.raises(ValueError, match="preset overrides: unknown field .tensor_parallel."):
        preflight_plan(SEED, {"tensor_parallel": 2})
    with pytest.raises(ValueError, match="unknown preset"):
        preflight_plan("dsv4-pro")
    with pytest.raises(ValueError, match=">= 1"):
        preflight_plan(SEED, {"tp": 0})


# ---------------------------------------------------------------------------------- estimates vs. tensors
def test_model_shapes_match_the_presets():
    from engines.presets.models import dsv4_flash_model_config, tiny_cpu_model_config

    assert ModelShape.from_config(dsv4_flash_model_config()) == dsv4_flash_shape()
    assert ModelShape.from_config(tiny_cpu_model_config()) == tiny_cpu_shape(), \
        "engines/presets/models.py tiny_cpu_model_config changed: update engines/layout/shape.py tiny_cpu_shape()"


def test_parameter_estimates_agree_with_the_real_tensors():
    from engines.model import DeepseekV4, ModelConfig
    from engines.model.params import native_param_specs
    from engines.presets.models import dsv4_flash_model_config, tiny_cpu_model_config

    def table_count(cfg) -> int:
        return sum(math.prod(s.shape) for s in native_param_specs(cfg).values() if s.kind != "int64")

    tiny = tiny_cpu_model_config()
    real = sum(p.numel() for p in DeepseekV4(tiny).parameters())
    plan = preflight_plan("tiny-cpu")  # TP = PP = EP = 1: the one GPU holds every parameter, 2 B each
    estimate = plan.stages[0].params * 1e9 / 2
    assert abs(estimate - real) / real < 0.01 and total_params(tiny_cpu_shape()) == real == table_count(tiny)

    two_layer = ModelConfig(num_hidden_layers=2, layer_types=[CSA, HCA], mlp_layer_types=["hash_moe", "moe"])
    assert abs(total_params(ModelShape.from_config(two_layer)) - table_count(two_layer)) / table_count(two_layer) < 0.01
    flash = table_count(dsv4_flash_model_config())
    assert abs(total_params(dsv4_flash_shape()) - flash) / flash < 0.01 and 283e9 < flash < 286e9


def test_kv_bytes_per_token_follow_the_shared_single_head_architecture():
    shape = dsv4_flash_shape()
    assert shape.layer_types.count(CSA) == 21 and shape.layer_types.count(HCA) == 20
    # 21 CSA layers x (512 + 128) / 4 + 20 HCA layers x 512 / 128 = 3440 elements, 2 B each
    assert kv_bytes_per_token(shape, 2.0) == 3440 * 2
    plan = preflight_plan(SEED)
    assert plan.rollout.kv_cache == pytest.approx(524288 * 6880 / 1e9)


def test_balanced_stages_and_ranking():
    assert balanced_stages(43, 4) == (None, 10) and balanced_stages(43, 8) == (4, 3)
    assert balanced_stages(44, 4) == (None, None)
    _, inp = resolve(SEED)
    ranked = rank_layouts(inp, limit=5)
    assert ranked and all(p.feasible for p in ranked)
    secs = [p.comm.total_seconds for p in ranked if p.actor_gb <= 0.9 * 288]
    assert secs == sorted(secs)


def test_planner_imports_no_torch():
    code = "import sys, engines.miles.launch, v4rl.cmd_plan; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ------------------------------------------------------------------------------------------------- the CLI
def test_cli_plan_json_and_exit_codes():
    from v4rl.cli import app

    runner = CliRunner()
    ok = runner.invoke(app, ["plan", "--preset", SEED, "--json"])
    assert ok.exit_code == 0, ok.output
    obj = json.loads(ok.output)
    assert obj["feasible"] is True and obj["reasons"] == []
    assert obj["layout"]["pipeline_layers"] == [11, 11, 11, 10]
    assert set(obj["layout"]) >= {"tp", "pp", "ep", "etp", "cp", "dp", "pipeline_layers"}
    assert set(obj["memory_gb_per_gpu"]) == {"actor", "rollout"}
    bad = runner.invoke(app, ["plan", "--preset", SEED, "--pp", "4", "--json"])
    assert bad.exit_code == 2 and json.loads(bad.output)["reasons"][0].startswith("[pp-layer-split]")
    table = runner.invoke(app, ["plan", "--preset", SEED, "--ep", "3"])
    assert table.exit_code == 2 and "[experts-ep]" in table.output
    assert runner.invoke(app, ["plan", "--preset", "nope"]).exit_code == 1
    tiny = runner.invoke(app, ["plan", "--preset", "tiny-cpu", "--json", "--rank", "2"])
    assert tiny.exit_code == 0 and json.loads(tiny.output)["alternatives"]


def test_an_infeasible_plan_prints_only_why_and_the_fix():
    """The memory table, the Miles job and its storage cost of a layout that cannot run would only mislead."""
    from v4rl.cli import app

    runner = CliRunner()
    out = runner.invoke(app, ["plan", "--preset", SEED, "--hbm-gb", "100"])
    assert out.exit_code == 2, out.output
    lines = out.stdout.splitlines()
    rejected = [line for line in lines if line.startswith("rejected ")]
    assert [r.split()[1] for r in rejected] == ["[actor-memory]", "[rollout-memory]"], out.stdout
    assert all("fix: " in r for r in rejected)  # each reason on one line, with its fix, pasteable
    for shown_only_when_feasible in ("actor memory per GPU", "rollout per GPU", "Miles job", "storage cost",
                                     "communication per step"):
        assert shown_only_when_feasible not in out.stdout, (shown_only_when_feasible, out.stdout)
    assert lines[-1] == "infeasible" and "--rank 5" in out.stdout
    ranked = runner.invoke(app, ["plan", "--preset", SEED, "--pp", "4", "--rank", "2"])
    assert ranked.exit_code == 2 and "feasible layouts, least communication first" in ranked.stdout
    assert "Miles job" not in ranked.stdout


def test_help_lists_every_preset_and_names_options_in_full():
    """`--help` is laid out wide enough that no option name is cut (rich's default of 80 columns cut
    --prompts-per-step), and `plan --help` lists the presets from the registry."""
    from engines.presets.runs import RUN_PRESETS
    from v4rl.cli import app

    runner = CliRunner()
    train = runner.invoke(app, ["train", "--help"])
    assert train.exit_code == 0 and "…" not in train.stdout
    for option in ("--prompts-per-step", "--max-grader-error-ratio", "--rollout-expert-dtype"):
        assert option in train.stdout, option
    plan = runner.invoke(app, ["plan", "--help"])
    assert "…" not in plan.stdout
    flat = " ".join(plan.stdout.replace("│", " ").split())
    assert all(name in flat for name in RUN_PRESETS), (sorted(RUN_PRESETS), flat)


def test_plan_a_real_config_json(tmp_path):
    """A DeepSeek-V4-Flash config.json in the shipped (legacy compress_ratios, 43 + MTP) form plans like the preset."""
    from engines.presets.models import DSV4_FLASH_COMPRESS_RATIOS

    config = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
              "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64, "head_dim": 512,
              "q_lora_rank": 1024, "qk_rope_head_dim": 64, "o_groups": 8, "o_lora_rank": 1024,
              "compress_ratios": list(DSV4_FLASH_COMPRESS_RATIOS), "num_hash_layers": 3, "sliding_window": 128,
              "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6, "moe_intermediate_size": 2048,
              "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "hc_mult": 4,
              "num_nextn_predict_layers": 1, "expert_dtype": "fp4",
              "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                      "scale_fmt": "ue8m0", "activation_scheme": "dynamic"}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    plan = preflight_plan(SEED, {"model_config": str(path)})
    assert plan.input.model == dsv4_flash_shape() and plan.to_json() == preflight_plan(SEED).to_json()
    with pytest.raises(ValueError, match="cannot read model config"):
        preflight_plan(SEED, {"model_config": str(tmp_path / "missing.json")})
