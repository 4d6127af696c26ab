"""The cluster path on a real cluster (`gpu`): what the CPU suite cannot run. Each test needs the existing Ray
cluster with Miles 31f1ca961 + Megatron-LM 2e64d788b installed on its nodes, the converted torch_dist and the
HF FP8 checkpoint on shared storage, and says which variables it reads; without them it skips.

    V4RL_GPU_RUNS_ROOT=/shared/v4rl-runs V4RL_HF_CHECKPOINT=/shared/DeepSeek-V4-Flash-FP8 \
    V4RL_TORCH_DIST=/shared/DeepSeek-V4-Flash_torch_dist RAY_ADDRESS=http://head:8265 MASTER_ADDR=10.0.0.1 \
    V4RL_SOCKET_IFNAME=eth0 V4RL_IB_HCA=rdma0,rdma1 V4RL_ALIGN_SGLANG_URL=http://10.0.0.3:30000 \
    .venv/bin/python -m pytest tests/test_miles_cluster_gpu.py -m gpu -q

What they check: a job killed early (idle timeout 1 s, its Ray job stopped) is resubmitted as the run's one
job, which resumes where the save directory says, evaluates itself (steps 0, 2, 4) and saves every 2 rollouts,
each step in metrics.jsonl once; Miles' eval-only job evaluates step 0 into eval/step_000000.json; the alignment gate's SGLang batch is rescored by Megatron through Miles'
train-only debug run and passes the seed's threshold (0.09 mean |Δlogprob|).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
NEEDED = ("V4RL_GPU_RUNS_ROOT", "V4RL_HF_CHECKPOINT", "V4RL_TORCH_DIST", "RAY_ADDRESS", "MASTER_ADDR",
          "V4RL_SOCKET_IFNAME", "V4RL_IB_HCA")


@pytest.fixture
def cluster():
    missing = [k for k in NEEDED if not os.environ.get(k)]
    if missing:
        pytest.skip(f"set {', '.join(missing)} to run on the cluster (module docstring)")
    from flows.params import PipelineParams

    paths = {k: os.environ[f"V4RL_{k.upper()}"] for k in ("miles_dir", "megatron_dir", "data_dir")
             if os.environ.get(f"V4RL_{k.upper()}")}
    params = PipelineParams.preset_defaults(
        os.environ.get("V4RL_GPU_PRESET", "dsv4-flash-mi355x"), run_key=f"gpu-test-{int(time.time())}",
        runs_root=os.environ["V4RL_GPU_RUNS_ROOT"], hf_checkpoint=os.environ["V4RL_HF_CHECKPOINT"], steps=4,
        eval_interval=2, save_interval=2, ray_address=os.environ["RAY_ADDRESS"], master_addr=os.environ["MASTER_ADDR"],
        socket_ifname=os.environ["V4RL_SOCKET_IFNAME"], ib_hca=os.environ["V4RL_IB_HCA"],
        align_sglang_url=os.environ.get("V4RL_ALIGN_SGLANG_URL"), **paths)
    run = params.backend().run
    # the converted checkpoint comes from V4RL_TORCH_DIST instead of the run's own convert task
    return dataclasses.replace(run, job=dataclasses.replace(run.job, ref_load=os.environ["V4RL_TORCH_DIST"]))


def _steps(run_dir: str) -> list[int]:
    return [json.loads(x)["step"] for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_one_job_resumes_after_a_killed_job_on_the_cluster(cluster):
    from engines.miles import MilesTimeout, find_resume
    from engines.miles.pipeline import evaluate_step, train_run

    impatient = dataclasses.replace(cluster, idle_timeout_s=1.0)
    with pytest.raises(MilesTimeout):  # killed (and its Ray job stopped) long before rollout 4 is saved
        train_run(impatient, 4)
    summary = train_run(cluster, 4)  # the task's retry: one job for the rest of the run
    assert summary["resumed_from"] in (0, 2) and find_resume(cluster.job.save_dir).start_rollout_id == 4
    assert _steps(cluster.run_dir) == [1, 2, 3, 4]
    evals = sorted(int(p.stem.split("_")[1]) for p in (Path(cluster.run_dir) / "eval").glob("step_*.json"))
    assert evals == [0, 2, 4]
    assert json.loads((Path(cluster.run_dir) / "eval" / "step_000004.json").read_text())["dataset"]
    (Path(cluster.run_dir) / "eval" / "step_000000.json").unlink()
    assert "pass@1" in evaluate_step(cluster, 0)  # Miles' eval-only job on --ref-load


def test_alignment_gate_with_sglang_and_megatron(cluster):
    from engines.align import AlignConfig
    from engines.backends.miles import align_gate

    report = align_gate(cluster, AlignConfig(n_prompts=16, max_new_tokens=256))
    assert report["n_tokens"] > 0 and report["first_divergence"] is None
    assert report["passed"], report["failures"]
