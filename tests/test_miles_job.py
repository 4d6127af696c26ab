"""The Miles job v4rl builds (engines/miles: model_args, train_args, env, command, submit) on CPU.

What is pinned: model flags follow config.json (and fail naming a missing key), every layout the planner
accepts gets a complete argv with its parallel sizes, the runtime env carries the site network to every rank
and keeps values whole, the submit is `ray job submit --address ... -- python3 <miles>/train.py` and nothing
else (no ray stop, no pkill), a missing site value or an infeasible layout stops before anything is submitted,
and the launch plan shows only what the submitted argv holds. Miles' own code judges the same job in
tests/conformance/test_miles_*.py. NUM_GPUS = 0; about 10 s.

    .venv/bin/python -m pytest tests/test_miles_job.py -q
"""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from engines.presets.flash import flash_config
from engines.layout import InfeasibleLayout, rank_layouts
from engines.miles.launch import launch_plan
from engines.profiles import get_profile
from engines.presets.runs import SEED_RUN, resolve
from engines.profiles.site import Site, SiteError
from engines.miles import (MilesJob, ModelConfigError, build_command, model_args, parse_flags, prepare_job,
                                 run_job, runtime_env_json, submit_argv)
from engines.miles.model_args import num

SITE = Site(ray_address="http://10.0.0.1:8265", master_addr="10.0.0.1", socket_ifname="ens50f0",
            ib_hca="rdma0,rdma1")


def _job(tmp_path: Path | None = None, **kw) -> MilesJob:
    save = str(tmp_path / "save") if tmp_path else "/ckpt/run"
    return MilesJob(run_id="r1", hf_checkpoint="/models/V4-Flash-FP8", ref_load="/models/V4-Flash_torch_dist",
                    save_dir=save, **kw)


# ------------------------------------------------------------------------------------------- model flags
def test_flash_config_is_the_presets_model():
    import dataclasses

    from engines.layout import ModelShape, dsv4_flash_shape
    from engines.model.config import ModelConfig
    from engines.presets.models import dsv4_flash_model_config

    cfg = ModelConfig.from_hf_dict(flash_config())
    assert dataclasses.asdict(cfg) == dataclasses.asdict(dsv4_flash_model_config())
    assert ModelShape.from_config(cfg) == dsv4_flash_shape()


def test_model_flags_follow_config_json():
    cfg = flash_config() | {"num_hidden_layers": 4, "compress_ratios": [0, 0, 4, 128, 0], "n_routed_experts": 16,
                            "num_hash_layers": 2, "swiglu_limit": 7.5, "rms_norm_eps": 1e-5}
    flags = parse_flags(model_args(cfg))
    assert flags["--num-layers"] == ["4"] and flags["--moe-layer-freq"] == ["[1,1,1,1]"]
    assert flags["--dsv4-compress-ratios"] == ["0", "0", "4", "128", "0"] and flags["--num-experts"] == ["16"]
    assert flags["--dsv4-n-hash-layers"] == ["2"] and flags["--activation-func-clamp-value"] == ["7.5"]
    assert flags["--norm-epsilon"] == ["1e-5"] and flags["--spec"] == list(
        ("miles_plugins.models.deepseek_v4.deepseek_v4", "get_dsv4_spec"))
    no_limit = parse_flags(model_args(flash_config() | {"swiglu_limit": 0}))
    assert "--activation-func-clamp-value" not in no_limit and "--no-bias-swiglu-fusion" not in no_limit


@pytest.mark.parametrize("drop, named", [("compress_ratios", "compress_ratios"), ("q_lora_rank", "q_lora_rank"),
                                         ("sliding_window", "sliding_window / window_size")])
def test_missing_config_key_is_named(drop, named):
    cfg = flash_config()
    cfg.pop(drop)
    with pytest.raises(ModelConfigError, match=f"ckpt/config.json has no {named}.*release format"):
        model_args(cfg, source="ckpt/config.json")


def test_bad_model_configs_are_refused():
    with pytest.raises(ModelConfigError, match="rope_scaling has no 'factor'"):
        model_args(flash_config() | {"rope_scaling": {"type": "yarn"}})
    with pytest.raises(ModelConfigError, match="compress_ratios has 3 entries"):
        model_args(flash_config() | {"compress_ratios": [0, 4, 128]})
    with pytest.raises(ModelConfigError, match="model_type 'llama'"):
        model_args(flash_config() | {"model_type": "llama"})


def test_numbers_are_written_as_miles_writes_them():
    assert [num(v) for v in (16.0, 1e-6, 0.28, 0, 1.5, 160000.0, 2.5e-7)] == \
        ["16", "1e-6", "0.28", "0", "1.5", "160000", "2.5e-7"]


def test_flags_parse_like_argparse():
    assert parse_flags(["--a", "1", "-2", "--b", "--c", "x", "y", "--a", "3"]) == {
        "--a": ["3"], "--b": [], "--c": ["x", "y"]}
    with pytest.raises(ValueError, match="starts with a value"):
        parse_flags(["x", "--a"])


# --------------------------------------------------------------------------------------------- layouts
def test_every_layout_the_planner_accepts_gets_a_complete_job():
    _, inp = resolve(SEED_RUN.name)
    plans = [p for p in rank_layouts(inp, 12) if p.feasible]
    assert len(plans) >= 5
    for plan in plans:
        p = plan.input.parallel
        overrides = {"tp": p.tp, "pp": p.pp, "ep": p.ep, "etp": p.expert_tp, "cp": p.cp,
                     "pp_first": p.first_stage_layers, "pp_last": p.last_stage_layers}
        preset, inp2 = resolve(SEED_RUN.name, overrides)
        flags = build_command(preset, _job(), site=SITE, cluster=inp2.cluster).flag_values()
        assert flags["--tensor-model-parallel-size"] == [str(p.tp)] and flags["--expert-model-parallel-size"] == \
            [str(p.ep)] and flags["--pipeline-model-parallel-size"] == [str(p.pp)]
        assert ("--sequence-parallel" in flags) == (p.tp > 1) and ("--allgather-cp" in flags) == (p.cp > 1)
        assert flags["--actor-num-nodes"] == ["2"] and flags["--rollout-num-gpus"] == ["16"]


def test_named_settings_switch_their_flags():
    fp8 = build_command(resolve(SEED_RUN.name, {"fp8_training": True, "rollout_routing_replay": True,
                                                "fault_tolerance": True})[0], _job()).flag_values()
    assert fp8["--fp8-recipe"] == ["blockwise"] and "--no-gradient-accumulation-fusion" in fp8
    assert {"--use-rollout-routing-replay", "--use-fault-tolerance"} <= set(fp8)
    assert fp8["--pause-generation-mode"] == ["in_place"]  # replay never with Miles' retract (radixark/miles#3277)
    bf16 = build_command(SEED_RUN, _job()).flag_values()
    assert "--bf16" in bf16 and not {"--fp8-format", "--use-rollout-routing-replay", "--use-fault-tolerance",
                                     "--pause-generation-mode"} & set(bf16)


def test_eval_datasets_and_data_paths():
    preset, _ = resolve(SEED_RUN.name, {"eval_datasets": [["aime", "/d/aime.jsonl"], ["math500", "m/500.jsonl"]],
                                        "prompt_data": "/d/train.jsonl"})
    flags = build_command(preset, _job(data_dir="/data")).flag_values()
    assert flags["--eval-prompt-data"] == ["aime", "/d/aime.jsonl", "math500", "/data/m/500.jsonl"]
    assert flags["--prompt-data"] == ["/d/train.jsonl"] and flags["--save-interval"] == ["20"]


# ------------------------------------------------------------------------------------- env and submit
def test_runtime_env_carries_the_site_network_and_keeps_values_whole():
    job = _job(extra_env={"NCCL_DEBUG_SUBSYS": "INIT, NET", "MY_FLAGS": "a b  c"})
    command = build_command(SEED_RUN, job, site=SITE)
    env = json.loads(runtime_env_json(command))["env_vars"]
    assert env == command.env and env["MY_FLAGS"] == "a b  c" and env["NCCL_DEBUG_SUBSYS"] == "INIT, NET"
    assert {k: env[k] for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "NCCL_IB_HCA",
                                "NCCL_IB_GID_INDEX", "MASTER_ADDR")} == {
        "NCCL_SOCKET_IFNAME": "ens50f0", "GLOO_SOCKET_IFNAME": "ens50f0", "TP_SOCKET_IFNAME": "ens50f0",
        "NCCL_IB_HCA": "rdma0,rdma1", "NCCL_IB_GID_INDEX": "1", "MASTER_ADDR": "10.0.0.1"}
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and env["NCCL_ALGO"] == "Ring"
    assert env["PYTHONPATH"] == "/workspace/miles:/root/Megatron-LM"
    with pytest.raises(ValueError, match="one-line strings; fix \\['BAD'\\]"):
        build_command(SEED_RUN, _job(extra_env={"BAD": "a\nb"}), site=SITE)


def test_job_runs_sglang_without_the_fp8_wo_a_gemm(monkeypatch):
    """SGLang's default fp8 wo_a path does not round-trip an online update (conformance C9) and fails the first
    load when o_lora_rank is not a multiple of 128 (C8): every SGLang engine of the job gets the variable at 0,
    on MI355X too, whose Miles launcher leaves SGLang's default; the job's own extras may set it back."""
    from engines.rollout import update_settings

    flash = build_command(SEED_RUN, _job(), site=SITE, hf_config=flash_config())
    tiny = build_command(SEED_RUN, _job(), site=SITE, hf_config=flash_config() | {"o_lora_rank": 64})
    assert flash.env["SGLANG_OPT_FP8_WO_A_GEMM"] == "0" == tiny.env["SGLANG_OPT_FP8_WO_A_GEMM"]
    assert "SGLANG_OPT_FP8_WO_A_GEMM" not in get_profile("mi355x").miles_env  # v4rl's setting, not the profile's
    mine = build_command(SEED_RUN, _job(extra_env={"SGLANG_OPT_FP8_WO_A_GEMM": "1"}), site=SITE,
                         hf_config=flash_config())
    assert mine.env["SGLANG_OPT_FP8_WO_A_GEMM"] == "1"
    # once SGLang's default round-trips (a new pin, the SGLang model suite passing), only o_lora_rank decides
    monkeypatch.setattr(update_settings, "DEFAULT_WO_A_ROUND_TRIPS", True)
    assert "SGLANG_OPT_FP8_WO_A_GEMM" not in build_command(SEED_RUN, _job(), site=SITE, hf_config=flash_config()).env
    tiny = build_command(SEED_RUN, _job(), site=SITE, hf_config=flash_config() | {"o_lora_rank": 64})
    assert tiny.env["SGLANG_OPT_FP8_WO_A_GEMM"] == "0"


def test_submit_is_ray_job_submit_to_the_existing_cluster():
    command = build_command(SEED_RUN, _job(miles_dir="/opt/miles"), site=SITE)
    argv = submit_argv(command, SITE)
    assert argv[:5] == ["ray", "job", "submit", "--address", "http://10.0.0.1:8265"]
    assert argv[argv.index("--") + 1:] == ["python3", "/opt/miles/train.py", *command.argv]
    assert json.loads(argv[argv.index("--runtime-env-json") + 1]) == {"env_vars": command.env}
    assert not {"stop", "start", "pkill"} & set(argv[:argv.index("--")])
    with pytest.raises(SiteError, match="ray_address"):
        submit_argv(command, Site(master_addr="10.0.0.1"))


def test_site_names_each_missing_parameter():
    with pytest.raises(SiteError) as err:
        Site(master_addr="10.0.0.1").require(get_profile("mi355x"))
    message = str(err.value)
    assert "ray_address (RAY_ADDRESS)" in message and "socket_ifname (NCCL_SOCKET_IFNAME)" in message
    assert "ib_hca (NCCL_IB_HCA)" in message and "master_addr" not in message and "nothing was submitted" in message
    assert Site(head_ip="10.0.0.1", socket_ifname="eth0", ib_hca="mlx5").require(get_profile("mi355x"))


# ------------------------------------------------------------------------------------ run_job end to end
def _fake_ray(tmp_path: Path, body: str) -> dict[str, str]:
    """A `ray` executable first on PATH that records its argv (one JSON line per call) and runs `body`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "ray"
    script.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                      f"open({str(tmp_path / 'calls.jsonl')!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
                      + textwrap.dedent(body))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def _calls(tmp_path: Path) -> list[list[str]]:
    path = tmp_path / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_run_job_submits_the_prepared_job(tmp_path, monkeypatch):
    for key, value in _fake_ray(tmp_path, """
        print("Job 'raysubmit_v4rl1' submitted successfully", flush=True)
        print("[2026-06-01] metrics.py:88 - perf 0: {'perf/rollout_time': 812.4}", flush=True)
        print("[2026-06-01] log_utils.py:541 - step 0: {'train/pg_loss': -0.01, 'train/step': 0}", flush=True)
        assert os.environ["RAY_ADDRESS"] == "http://10.0.0.1:8265"
    """).items():
        monkeypatch.setenv(key, value)
    job = _job(tmp_path, log_dir=str(tmp_path / "logs"))
    prepared = prepare_job(SEED_RUN.name, job, site=SITE)
    outcome = run_job(SEED_RUN.name, job, site=SITE, prepared=prepared, kill_grace_s=2.0)
    assert outcome.ray_job_id == "raysubmit_v4rl1" and outcome.last("step").metrics["train/pg_loss"] == -0.01
    # the submit, then `ray job logs` for what the stream missed (nothing here: the fake prints the same lines)
    assert _calls(tmp_path) == [prepared.submit_argv[1:], ["job", "logs", "raysubmit_v4rl1"]]
    assert (tmp_path / "logs" / "r1.log").read_text().count("\n") == 3


@pytest.mark.parametrize("site, overrides, error", [
    (Site(ray_address="http://10.0.0.1:8265", socket_ifname="eth0", ib_hca="mlx5"), None, SiteError),
    (Site(master_addr="10.0.0.1", socket_ifname="eth0", ib_hca="mlx5"), None, SiteError),
    (SITE, {"pp": 4}, InfeasibleLayout),  # 43 layers on 4 stages without stage sizes
    (SITE, {"tp": 3}, InfeasibleLayout),
])
def test_bad_input_stops_before_anything_is_submitted(tmp_path, monkeypatch, site, overrides, error):
    for key, value in _fake_ray(tmp_path, "").items():
        monkeypatch.setenv(key, value)
    with pytest.raises(error):
        run_job(SEED_RUN.name, _job(tmp_path), site=site, overrides=overrides)
    assert _calls(tmp_path) == []


# ----------------------------------------------------------------------------------------- launch plan
def test_launch_plan_shows_only_what_the_submitted_argv_holds():
    plan = launch_plan(SEED_RUN.name, site=SITE, job=_job())
    submitted = plan["miles_submit"]
    argv = submitted[submitted.index("--") + 3:]
    assert argv == plan["miles"]["argv"] and plan["miles"]["entrypoint"] == "train.py"
    flags = parse_flags(argv)
    shown = [p["args"] for n in plan["nodes"] for p in n["processes"] if p["kind"] in ("megatron-rank", "sglang-engine")]
    for args in shown:
        for flag, values in parse_flags(args).items():
            assert flags.get(flag) == values, f"{flag} {values} shown but the argv has {flags.get(flag)}"
    driver = next(p for n in plan["nodes"] for p in n["processes"] if p["kind"] == "miles-driver")
    assert driver["argv"] == submitted


# --------------------------------------------------------------------------- preflight helpers and the CLI
def test_preflight_names_values_miles_resolved_differently():
    from engines.upstream.miles_preflight import compare_resolved, expected_values

    preset, inp = resolve(SEED_RUN.name)
    want = expected_values(preset, _job(), inp.cluster)
    assert want["global_batch_size"] == 256 and want["load"] == "/models/V4-Flash_torch_dist"  # no tracker: ref
    got = {**want, "eval_datasets": [{"name": "aime", "path": "/root/datasets/aime-2024/aime-2024.jsonl",
                                      "n_samples_per_eval_prompt": 8, "max_response_len": 4096, "top_p": 0.7}],
           "pipeline_model_parallel_size": 2, "save_interval": None}
    assert compare_resolved(want, got) == ["pipeline_model_parallel_size: v4rl meant 4, Miles resolved 2",
                                           "save_interval: v4rl meant 20, Miles resolved None"]


def test_preflight_names_a_missing_dataset_file(tmp_path):
    from engines.upstream.miles_preflight import local_problems

    (tmp_path / "train.jsonl").write_text("{}\n")
    preset, _ = resolve(SEED_RUN.name, {"prompt_data": str(tmp_path / "train.jsonl"),
                                        "eval_datasets": [["aime", str(tmp_path / "absent.jsonl")]]})
    problems = local_problems(preset, _job(), check_data=True)
    assert len(problems) == 1 and "eval dataset 'aime' (--eval-prompt-data)" in problems[0]
    assert "absent.jsonl does not exist" in problems[0] and local_problems(preset, _job(), check_data=False) == []


def _plan(*args: str):
    from typer.testing import CliRunner

    from v4rl.cli import app

    return CliRunner().invoke(app, ["plan", *args])


def test_plan_json_carries_the_miles_job_and_the_pin():
    out = _plan("--preset", "dsv4-flash-mi355x", "--json", "--ray-address", "http://10.0.0.1:8265")
    assert out.exit_code == 0, out.output
    miles = json.loads(out.output)["miles"]
    assert miles["entrypoint"] == "train.py" and miles["argv"][:2] == ["--disable-bias-linear", "--num-layers"]
    assert miles["pin"]["miles"] == "31f1ca961" and miles["submit"][4] == "http://10.0.0.1:8265"
    assert miles["seed_command"]["miles"] == "a8684732f" and miles["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    text = _plan("--preset", "dsv4-flash-mi355x")
    assert "Miles job: train.py for Miles 31f1ca961 with Megatron-LM miles-main 2e64d788b" in text.output
    assert _plan("--preset", "dsv4-flash-mi355x", "--eval-data", "aime").exit_code != 0  # NAME=PATH required


def test_plain_plan_imports_no_engine_check():
    import subprocess

    code = ("import sys, v4rl.cmd_plan, v4rl.plan_miles, engines.miles.launch; "
            "bad = [m for m in ('torch', 'engines.upstream.miles_preflight', 'engines.upstream.miles_launcher_compare') "
            "if m in sys.modules]; sys.exit(str(bad) if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_pipeline_parameters_become_the_miles_job(tmp_path):
    from prefect.logging import disable_run_logger

    from flows.params import PipelineParams
    from tasks.preflight import preflight

    p = PipelineParams.preset_defaults("dsv4-flash-mi355x", runs_root=str(tmp_path), steps=40, eval_interval=5,
                                       ray_address="http://10.0.0.1:8265", master_addr="10.0.0.1")
    assert p.miles_overrides() == {"num_rollout": 40, "rollout_batch_size": 32, "n_samples_per_prompt": 8,
                                   "eval_interval": 5, "n_samples_per_eval_prompt": 8, "lr": 1e-6}
    job = p.miles_job()
    assert (job.ref_load, job.save_dir) == (str(p.run_dir / "torch_dist"), str(p.run_dir / "miles-checkpoints"))
    flags = build_command(resolve(p.preset, p.miles_overrides())[0], job, site=p.site()).flag_values()
    # one job per run: it saves on the preset's grid (20), not at every evaluation
    assert flags["--num-rollout"] == ["40"] and flags["--save-interval"] == ["20"] and flags["--eval-interval"] == ["5"]
    assert p.model_copy(update={"save_interval": 10}).miles_overrides()["save_interval"] == 10
    with disable_run_logger(), pytest.raises(SiteError, match="(?s)socket_ifname.*ib_hca"):  # before Miles is asked
        preflight.fn(p.preset, backend=p.backend())


def test_a_failed_jobs_actors_are_waited_out_before_the_run_goes_on(tmp_path, monkeypatch):
    """Ray ends a dead driver's actors after marking its job failed; one kept training and saved a rollout while
    the retry prepared (the cluster-rehearsal saw it). The runner asks the state API until none is alive."""
    from engines.miles.runner import wait_job_actors

    for key, value in _fake_ray(tmp_path, """
        calls = [json.loads(x) for x in open(os.environ["CALLS"])]
        if sys.argv[1:3] == ["list", "jobs"]:
            print(json.dumps([{"job_id": "05000000", "submission_id": "raysubmit_x", "status": "FAILED"}]))
        elif sys.argv[1:3] == ["list", "actors"]:
            assert "job_id=05000000" in sys.argv and "state=ALIVE" in sys.argv
            alive = sum(c[:2] == ["list", "actors"] for c in calls) <= 2  # alive when asked twice, then gone
            print(json.dumps([{"class_name": "MegatronTrainRayActor", "state": "ALIVE"}]) if alive
                  else "No resource in the cluster")
    """).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("CALLS", str(tmp_path / "calls.jsonl"))
    assert wait_job_actors("raysubmit_x") == "the actors of job raysubmit_x have ended"
    assert [c[:2] for c in _calls(tmp_path)] == [["list", "jobs"]] + [["list", "actors"]] * 3
