"""Miles' own launcher, recorded (nothing executed), against v4rl's job: flag by flag, variable by variable.

`scripts/amd/run_deepseek_v4.py train` at the pinned Miles is driven through its typer app with typer 0.25.1 /
click 8.2.1 (its Dockerfile.rocm pins) in a subprocess, its command helpers replaced by recorders
(engines/upstream/probes/record_launcher.py, Miles' own recording approach). First the recorder is pinned
to Miles' committed snapshot; then, for each layout the launcher has a preset for (1 actor node; 32 actor GPUs
TP4 PP4 EP8), v4rl's job must equal the recording except the commented allow-list of
engines/upstream/miles_launcher_compare.py. The seed's layout and command are refused by main (conformance A1,
A2) and accepted by the PR-head tarball a8684732f, which keeps the seed's command reproducible. The second
DeepSeek-V4 generation (e9e19b223, the same launcher) is compared against v4rl's generation-2 job with
ALLOWED_GEN2 (the 32-GPU layout in the default run, 1 node `slow`). About 1 min.

    .venv/bin/python -m pytest tests/conformance/test_miles_launcher.py -q
"""

from __future__ import annotations

import re
import shlex

import pytest

from engines.profiles import get_profile
from engines.presets.runs import MILES_1NODE_RUN, MILES_32GPU_RUN, SEED_RUN
from engines.miles import MilesJob, launcher_argv, parse_flags
from engines.upstream.miles_launcher_compare import ALLOWED, compare_with_launcher, record_launcher

SNAPSHOT = "tests/snapshots/launch_scripts/py/scripts/amd/run_deepseek_v4.py/train.txt"
# Miles' py_harness freezes these (tests/fast/launch_scripts/py_harness.py _FROZEN_ENV, FROZEN_RUN_ID)
HARNESS_ENV = {"MASTER_ADDR": "127.0.0.1", "MILES_SCRIPT_ENABLE_RAY_SUBMIT": "1", "PYTHONPATH": "/frozen/pythonpath",
               "WANDB_API_KEY": "frozen-wandb-api-key"}
HARNESS_RUN_ID = "260101-000000-000"
STALE_IN_SNAPSHOT = {"--train-env-vars": ['{"NVTE_FP8_BLOCK_SCALING_FP32_SCALES":"1"}']}
"""The committed snapshot predates one launcher edit (the launcher now writes "0"); vendor/README.md says so."""


def _snapshot_submit(miles_tree) -> list[str]:
    text = (miles_tree / SNAPSHOT).read_text()
    block = next(b for b in re.split(r"^### \d+\n", text, flags=re.M) if "ray job submit" in b)
    return shlex.split(" ".join(line.strip() for line in block.splitlines()).replace("<REPO_ROOT>", str(miles_tree)))


def test_recorder_reproduces_miles_committed_snapshot(miles_tree):
    recorded = record_launcher(miles_tree, ["train"], HARNESS_ENV, run_id=HARNESS_RUN_ID)
    assert recorded["exit_code"] == 0, recorded["error"]
    submit = next(c for c in recorded["commands"] if "ray job submit" in c)
    ours, theirs = shlex.split(submit), _snapshot_submit(miles_tree)
    head = theirs.index("--")
    assert ours[:head + 3] == theirs[:head + 3]  # address, runtime env (every variable), python3 <tree>/train.py
    got, want = parse_flags(ours[head + 3:]), parse_flags(theirs[head + 3:])
    assert got == {**want, **{k: got[k] for k in STALE_IN_SNAPSHOT}} and want.keys() >= STALE_IN_SNAPSHOT.keys()
    assert [want[k] for k in STALE_IN_SNAPSHOT] == list(STALE_IN_SNAPSHOT.values())


@pytest.fixture(scope="module")
def comparisons(miles_tree):
    return {p.name: compare_with_launcher(p, miles_dir=miles_tree) for p in (MILES_1NODE_RUN, MILES_32GPU_RUN)}


@pytest.mark.parametrize("preset", [MILES_1NODE_RUN.name, MILES_32GPU_RUN.name])
def test_job_equals_miles_launcher_except_the_allow_list(comparisons, preset):
    comparison = comparisons[preset]
    assert not comparison.launcher_error
    assert not comparison.diffs, "\n".join(f"{r.kind} {r.key}: launcher {r.launcher!r}, v4rl {r.v4rl!r}"
                                           for r in comparison.diffs)
    same = {(r.kind, r.key) for r in comparison.rows if r.status == "same"}
    # the heart of the job agrees exactly: model, layout, batch, eval, checkpoints, engines, Miles' env
    for key in ("--num-layers", "--dsv4-compress-ratios", "--spec", "--tensor-model-parallel-size",
                "--pipeline-model-parallel-size", "--expert-model-parallel-size", "--rollout-batch-size",
                "--n-samples-per-prompt", "--eval-prompt-data", "--save-interval", "--ref-load", "--load",
                "--sglang-ep-size", "--qkv-format", "--actor-num-nodes", "--colocate"):
        assert ("argv", key) in same, key
    assert {("env", k) for k in ("CUDA_DEVICE_MAX_CONNECTIONS", "NCCL_ALGO", "SGLANG_DSV4_FP4_EXPERTS", "MASTER_ADDR",
                                 "NCCL_SOCKET_IFNAME", "PYTHONPATH", "no_proxy")} <= same
    assert ("submit", "script") in same
    assert any("pkill -9 sglang" in c for c in comparison.launcher_commands)  # what v4rl never runs (A16)


def test_32gpu_layout_offload_matches_the_launcher(comparisons):
    rows = {(r.kind, r.key): r for r in comparisons[MILES_32GPU_RUN.name].rows}
    assert rows[("argv", "--optimizer-offload-fraction")].status == "same" == rows[("argv", "--no-offload-train")].status
    assert rows[("argv", "--decoder-first-pipeline-num-layers")].v4rl == "11"


def test_every_allow_list_entry_is_needed(comparisons):
    used = {(r.kind, r.key) for c in comparisons.values() for r in c.rows if r.status == "allowed"}
    assert set(ALLOWED) == used, f"stale allow-list entries: {sorted(set(ALLOWED) - used)}"


@pytest.mark.parametrize("preset", [pytest.param(MILES_1NODE_RUN, marks=pytest.mark.slow), MILES_32GPU_RUN],
                         ids=lambda p: p.name)
def test_second_generation_job_equals_its_launcher_except_the_allow_list(miles_gen2_tree, preset):
    """Miles e9e19b223 ships the same AMD launcher; v4rl's generation-2 job differs only where ALLOWED_GEN2 says
    (the implementation named, the pipeline layout string with PP > 1)."""
    comparison = compare_with_launcher(preset, miles_dir=miles_gen2_tree)
    assert comparison.generation == 2 and not comparison.launcher_error
    assert not comparison.diffs, "\n".join(f"{r.kind} {r.key}: launcher {r.launcher!r}, v4rl {r.v4rl!r}"
                                           for r in comparison.diffs)
    rows = {(r.kind, r.key): r for r in comparison.rows}
    for key in ("--num-layers", "--dsv4-compress-ratios", "--spec", "--tensor-model-parallel-size",
                "--pipeline-model-parallel-size", "--expert-model-parallel-size", "--rollout-batch-size"):
        assert rows[("argv", key)].status == "same", key
    assert ("argv", "--experimental-attention-variant") not in rows  # neither side passes it in generation 2
    assert rows[("argv", "--dsv4-impl")].status == "allowed" and rows[("argv", "--dsv4-impl")].v4rl == "miles"
    if preset.parallel.pp > 1:
        layout = rows[("argv", "--pipeline-model-parallel-layout")]
        assert (layout.status, layout.launcher, layout.v4rl) == ("allowed", None, "Et*11|t*11|t*11|t*10L")
        assert rows[("argv", "--decoder-last-pipeline-num-layers")].launcher == "10"


def _seed_job() -> MilesJob:
    return MilesJob(run_id="seed-run", hf_checkpoint="/models/V4-Flash-FP8", ref_load="/models/V4-Flash_torch_dist",
                    save_dir="/ckpt/run", wandb_team="xxx")


def test_main_refuses_the_seed_layout_and_command(miles_tree):
    assert compare_with_launcher(SEED_RUN, miles_dir=miles_tree).launcher_error.startswith(
        "NotImplementedError: No pre-set parallel config for 16 GPUs")  # conformance A2
    argv = launcher_argv(SEED_RUN, get_profile("mi355x"), _seed_job())
    recorded = record_launcher(miles_tree, argv[2:], {"MILES_SCRIPT_EXTERNAL_RAY": "1"}, launcher=argv[1])
    assert recorded["exit_code"] == 2 and len(recorded["rejected"]) == 16  # conformance A1
    assert recorded["rejected"][0] == "--actor-num-nodes" and "--num-rollout" in recorded["rejected"]


def test_pr_head_launcher_takes_the_seed_command(miles_seed_pr_tree):
    argv = launcher_argv(SEED_RUN, get_profile("mi355x"), _seed_job())
    env = {"MILES_SCRIPT_EXTERNAL_RAY": "1", "RAY_ADDRESS": "http://10.0.0.1:8265", "MASTER_ADDR": "10.0.0.1"}
    recorded = record_launcher(miles_seed_pr_tree, argv[2:], env, launcher=argv[1])
    assert recorded["exit_code"] == 0 and recorded["rejected"] == [], recorded["error"]
    submit = recorded["submit"]
    flags = parse_flags(submit["argv"])
    assert submit["script"].endswith("/train_async.py")  # the PR's fully-async entry (conformance A6)
    assert {k: flags[k] for k in ("--num-rollout", "--rollout-batch-size", "--n-samples-per-prompt",
                                  "--pipeline-model-parallel-size", "--decoder-last-pipeline-num-layers",
                                  "--expert-model-parallel-size", "--max-tokens-per-gpu", "--eval-interval",
                                  "--ref-load", "--load", "--save", "--wandb-team")} == {
        "--num-rollout": ["200"], "--rollout-batch-size": ["32"], "--n-samples-per-prompt": ["8"],
        "--pipeline-model-parallel-size": ["4"], "--decoder-last-pipeline-num-layers": ["10"],
        "--expert-model-parallel-size": ["4"], "--max-tokens-per-gpu": ["8192"], "--eval-interval": ["10"],
        "--ref-load": ["/models/V4-Flash_torch_dist"], "--load": ["/ckpt/run"], "--save": ["/ckpt/run"],
        "--wandb-team": ["xxx"]}
    assert "--use-tis" in flags and "--save-interval" not in flags  # the PR never saves by itself (A8)
    seed_env = get_profile("mi355x").launcher_env
    assert {k: submit["env"][k] for k in seed_env} == seed_env  # --extra-env-vars arrive whole
