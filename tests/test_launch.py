"""Launch plans and the seed's launcher command reproduce the seed's launch command setting by setting.

The seed (seeds/dsv4-flash-rl-mi355x.md, "Launch commands") is copied below verbatim; every export, every
`ray start`, every launcher flag and every --extra-args / --extra-env-vars entry is parsed out of it and
checked against what engines.miles.launch and engines.miles produce. The seed's launcher command only parses on
Miles' PR-head a8684732f (`launcher_argv`, kept as a documented extra); the job v4rl submits is the `train.py`
job (tests/test_miles_job.py), and the launch plan shows that job. NUM_GPUS = 0.

    .venv/bin/python -m pytest tests/test_launch.py -q
"""

from __future__ import annotations

import json
import re
import shlex

import pytest

from engines.miles.launch import SEED_RUN, Site, get_run_preset, launch_plan
from engines.profiles import get_profile
from engines.miles import MilesJob, build_command, launcher_argv, parse_flags

SEED_LAUNCH = r"""
ray start --head --node-ip-address=$HEAD_IP --port=6379 --num-gpus=8
ray start --address=$HEAD_IP:6379 --node-ip-address=$WORKER_IP --num-gpus=8
export MASTER_ADDR=xxx
export MILES_SCRIPT_EXTERNAL_RAY=1
export RAY_ADDRESS=xxx
export PYTHONUNBUFFERED=1
export NCCL_SOCKET_IFNAME=xxx
export GLOO_SOCKET_IFNAME=xxx
export TP_SOCKET_IFNAME=xxx
export NCCL_IB_HCA=xxx
export NCCL_IB_GID_INDEX=1
RUN_ID=dsv4-fp8-4node-2roll-tp1-pp4-ep4-$(date +%Y%m%d_%H%M%S)
LOG=/workspace/miles/${RUN_ID}.log
/opt/venv/bin/python3 scripts/amd/run_deepseek_v4.py train \
--run-id "${RUN_ID}" \
--mode normal \
--enable-eval \
--num-nodes 4 \
--actor-num-nodes 2 \
--rollout-num-nodes 2 \
--num-rollout 200 \
--num-steps-per-rollout 1 \
--rollout-batch-size 32 \
--n-samples-per-prompt 8 \
--context-length 16384 \
--rollout-max-response-len 4096 \
--max-tokens-per-gpu 8192 \
--sglang-max-running-requests 48 \
--sglang-max-total-tokens 524288 \
--tensor-model-parallel-size 1 \
--pipeline-model-parallel-size 4 \
--decoder-last-pipeline-num-layers 10 \
--context-parallel-size 1 \
--expert-model-parallel-size 4 \
--expert-tensor-parallel-size 1 \
--extra-args '--wandb-team xxx --use-tis' \
--extra-env-vars 'TORCH_NCCL_DUMP_ON_TIMEOUT=1 TORCH_NCCL_TRACE_BUFFER_SIZE=200000
TORCH_FR_BUFFER_SIZE=200000 TORCH_NCCL_DESYNC_DEBUG=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=1
TORCH_NCCL_DEBUG_INFO_TEMP_FILE=/workspace/miles/nccl_fr_trace_ GPU_MAX_HW_QUEUES=2
NCCL_P2P_NET_CHUNKSIZE=262144' \
2>&1 | tee "${LOG}"
"""
SEED_IMAGE = "rlsys/miles:rocm7.2-mi35x-dsv4"


def _seed_exports() -> dict[str, str]:
    return dict(re.findall(r"^export (\w+)=(\S+)$", SEED_LAUNCH, flags=re.M))


def _seed_launcher_argv() -> list[str]:
    command = SEED_LAUNCH[SEED_LAUNCH.index("/opt/venv"):SEED_LAUNCH.index("2>&1")]
    return shlex.split(command.replace("\\\n", " "))


def _flags(argv: list[str]) -> dict[str, str | None]:
    """--flag value / bare --flag -> {flag: value or None}; the leading program words are skipped."""
    out: dict[str, str | None] = {}
    i = next(k for k, a in enumerate(argv) if a.startswith("--"))
    while i < len(argv):
        flag, value = argv[i], None
        if i + 1 < len(argv) and not re.fullmatch(r"--[\w-]+", argv[i + 1]):
            value = argv[i + 1]
            i += 1
        out[flag] = value
        i += 1
    return out


def _job(**kw) -> MilesJob:
    return MilesJob(run_id="dsv4-fp8-4node-2roll-tp1-pp4-ep4-20260601_120000", hf_checkpoint="/models/V4-Flash-FP8",
                    ref_load="/models/V4-Flash_torch_dist", save_dir="/ckpt/run", wandb_team="xxx", **kw)


SEED_SITE = Site(head_ip="$HEAD_IP", worker_ips=("$WORKER_IP", "$WORKER_IP", "$WORKER_IP"), master_addr="xxx",
                 ray_address="xxx", socket_ifname="xxx", ib_hca="xxx")
OURS = _flags(launcher_argv(SEED_RUN, get_profile("mi355x"), _job()))
SEED = _flags(_seed_launcher_argv())


@pytest.mark.parametrize("flag", [f for f in SEED if f not in ("--run-id", "--extra-args", "--extra-env-vars")])
def test_launcher_flag_matches_the_seed(flag):
    assert flag in OURS, f"{flag} missing from our launcher command"
    assert OURS[flag] == SEED[flag], f"{flag}: ours {OURS[flag]!r}, seed {SEED[flag]!r}"


def test_launcher_program_run_id_and_log_match_the_seed():
    ours = launcher_argv(SEED_RUN, get_profile("mi355x"), _job())
    assert ours[:3] == _seed_launcher_argv()[:3] == ["/opt/venv/bin/python3", "scripts/amd/run_deepseek_v4.py", "train"]
    assert re.fullmatch(r"dsv4-fp8-4node-2roll-tp1-pp4-ep4-\d{8}_\d{6}", OURS["--run-id"])
    assert _job().log_path == f"/workspace/miles/{OURS['--run-id']}.log"  # LOG=/workspace/miles/${RUN_ID}.log


def test_extra_args_keep_the_seeds_and_add_our_checkpoints_and_eval():
    seed, ours = shlex.split(SEED["--extra-args"]), shlex.split(OURS["--extra-args"])
    assert _flags(["x"] + seed).items() <= _flags(["x"] + ours).items()  # --wandb-team xxx --use-tis
    extra = _flags(["x"] + ours)
    assert extra["--ref-load"] == "/models/V4-Flash_torch_dist" and extra["--load"] == extra["--save"] == "/ckpt/run"
    assert extra["--eval-interval"] == "10" and extra["--n-samples-per-eval-prompt"] == "8"
    assert OURS["--hf-checkpoint"] == "/models/V4-Flash-FP8"


@pytest.mark.parametrize("pair", SEED["--extra-env-vars"].split())
def test_extra_env_var_matches_the_seed(pair):
    assert OURS["--extra-env-vars"].split() == SEED["--extra-env-vars"].split()  # same entries, same order
    key, value = pair.split("=", 1)
    assert get_profile("mi355x").launcher_env[key] == value


DRIVER_ONLY = ("MILES_SCRIPT_EXTERNAL_RAY", "RAY_ADDRESS")  # the submitting client's; ranks do not need them


@pytest.mark.parametrize("key", list(_seed_exports()))
def test_cluster_export_matches_the_seed(key):
    plan = launch_plan(SEED_RUN.name, site=SEED_SITE, job=_job())
    assert plan["env"][key] == _seed_exports()[key]
    ranks = [p for n in plan["nodes"] for p in n["processes"] if p["kind"] in ("megatron-rank", "sglang-engine")]
    if key in DRIVER_ONLY:  # the submit argv carries the address; the runtime env does not need it
        assert all(key not in p["env"] for p in ranks)
    else:  # every rank gets the seed's value through the Ray runtime env (conformance A10)
        assert all(p["env"][key] == _seed_exports()[key] for p in ranks)
        assert plan["miles"]["env"][key] == _seed_exports()[key]


def test_ray_start_lines_and_image_match_the_seed():
    plan = launch_plan(SEED_RUN.name, site=SEED_SITE, job=_job())
    head, worker = [line for line in SEED_LAUNCH.splitlines() if line.startswith("ray start")]
    assert plan["nodes"][0]["processes"][0]["command"] == head
    assert all(n["processes"][0]["command"] == worker for n in plan["nodes"][1:])
    assert plan["docker_image"] == SEED_IMAGE and plan["fp8_dtype"] == "e4m3fn"
    driver = next(p for p in plan["nodes"][0]["processes"] if p["kind"] == "miles-driver")
    assert driver["argv"][:5] == ["ray", "job", "submit", "--address", "xxx"] == plan["miles_submit"][:5]
    assert driver["argv"][driver["argv"].index("--") + 1:][:2] == ["python3", "/workspace/miles/train.py"]


def test_launch_plan_places_trainer_ranks_and_sglang_engines():
    plan = launch_plan(SEED_RUN.name, site=SEED_SITE, job=_job())
    json.dumps(plan)  # JSON-able
    assert [n["role"] for n in plan["nodes"]] == ["actor", "actor", "rollout", "rollout"]
    ranks = [p for n in plan["nodes"] for p in n["processes"] if p["kind"] == "megatron-rank"]
    engines = [p for n in plan["nodes"] for p in n["processes"] if p["kind"] == "sglang-engine"]
    assert len(ranks) == 16 and len(engines) == 4  # 2 x 8 actor GPUs; 16 rollout GPUs / TP4 engines
    flags = [parse_flags(e["args"]) for e in engines]  # the engine flags of the one submitted argv
    assert all(e["args"] == engines[0]["args"] for e in engines) and [e["gpus"][0] for e in engines] == [0, 4, 0, 4]
    assert {k: v for k, v in flags[0].items() if k in ("--sglang-tp-size", "--sglang-ep-size",
                                                       "--sglang-max-running-requests", "--sglang-max-total-tokens",
                                                       "--sglang-context-length")} == {
        "--sglang-tp-size": ["4"], "--sglang-ep-size": ["4"], "--sglang-max-running-requests": ["48"],
        "--sglang-max-total-tokens": ["524288"], "--sglang-context-length": ["16384"]}
    assert {r["coords"]["pp"] for r in ranks} == {0, 1, 2, 3} and {r["coords"]["ep"] for r in ranks} == {0, 1, 2, 3}
    last = [r for r in ranks if r["coords"]["pp"] == 3]
    assert len(last) == 4 and all(r["layers"] == [33, 43] for r in last)
    for r in ranks:
        args = _flags(["x"] + r["args"])
        assert args["--pipeline-model-parallel-size"] == "4" and args["--decoder-last-pipeline-num-layers"] == "10"
        assert r["env"]["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and r["env"]["NCCL_IB_GID_INDEX"] == "1"
    for e in engines:
        assert len(e["gpus"]) == 4 and e["ray"]["bundle"] >= 16
    pg = plan["ray"]["placement_group"]
    assert pg["bundles"] == 32 and pg["actor_bundles"] == [0, 16] and pg["rollout_bundles"] == [16, 32]


def test_train_py_job_carries_the_seeds_settings():
    args = {k: " ".join(v) if v else None
            for k, v in build_command(SEED_RUN, _job(), site=SEED_SITE).flag_values().items()}
    expected = {"--actor-num-nodes": "2", "--actor-num-gpus-per-node": "8", "--rollout-num-gpus": "16",
                "--rollout-num-gpus-per-engine": "4", "--num-rollout": "200", "--rollout-batch-size": "32",
                "--n-samples-per-prompt": "8", "--num-steps-per-rollout": "1", "--rollout-max-response-len": "4096",
                "--max-tokens-per-gpu": "8192", "--sglang-max-running-requests": "48",
                "--sglang-max-total-tokens": "524288", "--sglang-context-length": "16384",
                "--tensor-model-parallel-size": "1", "--pipeline-model-parallel-size": "4",
                "--decoder-last-pipeline-num-layers": "10", "--context-parallel-size": "1",
                "--expert-model-parallel-size": "4", "--expert-tensor-parallel-size": "1",
                "--recompute-granularity": "full", "--eval-interval": "10", "--n-samples-per-eval-prompt": "8",
                "--ref-load": "/models/V4-Flash_torch_dist", "--hf-checkpoint": "/models/V4-Flash-FP8",
                "--load": "/ckpt/run", "--save": "/ckpt/run", "--micro-batch-size": "1", "--qkv-format": "bshd"}
    assert {k: args.get(k) for k in expected} == expected
    assert {"--use-tis", "--optimizer-cpu-offload", "--bf16", "--colocate"} - set(args) == {"--colocate"}
    assert "--use-dynamic-batch-size" not in args  # bshd forbids it (conformance A5)


def test_profiles():
    mi, h200 = get_profile("mi355x"), get_profile("h200")
    assert (mi.hbm_gb, mi.gpus_per_node, mi.collective_backend, mi.fp8_dtype) == (288.0, 8, "rccl", "e4m3fn")
    assert set(mi.backends) == {"mhc", "hybrid_attention", "moe_routing", "online_weight_update"}
    assert "AITER" in mi.backends["mhc"].rollout and "TileLang indexer" in mi.backends["hybrid_attention"].rollout
    assert (h200.hbm_gb, h200.collective_backend) == (141.0, "nccl") and "GPU_MAX_HW_QUEUES" not in h200.launcher_env
    with pytest.raises(ValueError, match="known: cpu, h200, mi355x"):
        get_profile("mi250")
    assert get_run_preset("dsv4-flash-mi355x") is SEED_RUN


def test_h200_profile_plan_is_checked_against_141gb():
    plan = launch_plan(SEED_RUN.name, {"profile": "h200"})
    assert plan["profile"] == "h200" and plan["docker_image"] is None
    env = plan["miles"]["env"]  # Miles' CUDA launcher's switches, none of the ROCm ones
    assert env["NCCL_NVLS_ENABLE"] == "1" and env["SGLANG_OPT_FP8_WO_A_GEMM"] == "0"
    assert "GPU_MAX_HW_QUEUES" not in env and "SGLANG_HACK_FLASHMLA_BACKEND" not in env
