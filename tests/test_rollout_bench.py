"""`bench/rollout.py` runs end to end and writes the JSON the README quotes (slow: about a minute).
Speeds are not asserted here (they live in the bench output, peers measured in the same run).

    .venv/bin/python -m pytest tests/test_rollout_bench.py -q -m slow
"""

from __future__ import annotations

import json

import pytest

import torch

from bench.rollout import _profile_step, main


def test_profile_step_counts_dispatched_ops_and_matmul_time():
    a = torch.randn(64, 64)
    stats = _profile_step(lambda: torch.mm(a, a).relu() + 1, steps=3)
    assert stats["ops"] == 3  # mm, relu, add
    assert 0 < stats["matmul_ms"] and 0 < stats["step_ms"]


@pytest.mark.slow
def test_bench_rollout_writes_its_json(tiny_checkpoint, tmp_path):
    out = tmp_path / "rollout.json"
    result = main(out, model_dir=tiny_checkpoint, repeats=1)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    t, u = result["throughput"], result["update"]
    assert t["ours_http_tok_s"] > 0 and t["transformers_generate_tok_s"] > 0
    assert set(t["by_threads"]) == {"1_thread", "default"} == set(result["ttft"])
    assert all(len(run["runs_s"]) == 1 for run in t["by_threads"].values())
    assert u["update_total_s"] == pytest.approx(u["export_quantize_s"] + u["load_post_process_s"])
    d = result["decode_step"]
    for side in (d["ours"], d["transformers"]):
        assert side["ops"] > 100 and 0 < side["matmul_ms"]
    assert d["speedup_bound_matmul_only"] == pytest.approx(d["transformers"]["step_ms"] / d["ours"]["matmul_ms"])
    assert d["ours_generation_matmul_ms"] > d["ours"]["matmul_ms"]  # prefill + 31 steps > one step
    assert set(result["goals"]) == {"throughput_vs_transformers", "update_vs_restart"}
