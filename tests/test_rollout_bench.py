"""`bench/rollout.py` runs end to end and writes the JSON the README quotes (slow: about a minute).
Speeds are not asserted here (they live in the bench output, peers measured in the same run).

    .venv/bin/python -m pytest tests/test_rollout_bench.py -q -m slow
"""

from __future__ import annotations

import json

import pytest

import torch

from bench.decode_profile import profile_step
from bench.rollout import main


def test_profile_step_counts_dispatched_ops_and_matmul_time():
    a = torch.randn(64, 64)
    stats = profile_step(lambda: torch.mm(a, a).relu() + 1, steps=3)
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
    assert d["transformers"]["ops"] > 1000 and 0 < d["transformers"]["matmul_ms"]
    assert d["ours"]["ops"] < d["transformers"]["ops"] and {"linear", "moe", "attend"} <= set(d["ours"]["kernels_ms"])
    assert d["ours_generation_model_ms"] > d["ours"]["step_ms"]  # prefill + 31 steps > one step
    assert set(result["goals"]) == {"throughput_vs_transformers", "update_vs_restart"}


def _small_case():
    from bench.rollout_sweep import CASES, SweepCase, _model
    from engines.model.config import CSA, HCA, SLIDING

    model = _model(hidden=128, layer_types=[SLIDING, CSA, HCA, CSA], hash_layers=2, heads=2, head_dim=64, experts=4,
                   top_k=2, index_topk=2, index_heads=4, index_dim=32, rates=(4, 8), window=8, o_groups=1, vocab=64)
    assert len(CASES) >= 4
    return SweepCase("small", model, batch=3, prompt_len=20, new_tokens=4)


def test_the_sweep_covers_the_shapes_the_issue_names():
    """hidden 128-512, index top-k 4-64, several compress rates and expert counts, every layer type in every case."""
    from bench.rollout_sweep import CASES
    from engines.model.config import LAYER_TYPES

    models = [c.model for c in CASES]
    assert {m.hidden_size for m in models} >= {128, 512} and all(128 <= m.hidden_size <= 512 for m in models)
    assert {m.index_topk for m in models} >= {4, 64} and all(4 <= m.index_topk <= 64 for m in models)
    assert len({tuple(sorted(m.compress_rates.values())) for m in models}) >= 2
    assert len({m.n_routed_experts for m in models}) >= 3
    assert all(set(m.layer_types) == set(LAYER_TYPES) for m in models)
    for case in CASES:  # every compressed branch has entries while decoding; CSA selects among more than top-k
        rates = case.model.compress_rates.values()
        assert case.prompt_len >= max(rates)
        assert case.prompt_len // min(rates) > case.model.index_topk


def test_config_sweep_writes_json_and_plot(tmp_path):
    from bench.rollout_sweep import main

    out = tmp_path / "sweep.json"
    result = main(out, repeats=1, cases=(_small_case(),))
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert (tmp_path / "sweep.png").stat().st_size > 0 and result["plot"] == str(tmp_path / "sweep.png")
    [case] = result["cases"]
    assert set(case["by_threads"]) == {"1_thread", "default"}
    for run in case["by_threads"].values():
        assert run["ours_tok_s"] > 0 and run["transformers_tok_s"] > 0 and len(run["runs_s"]) == 1
        assert list(run["fused_decode"].values()) == [True]  # ours ran on the fused kernels
    assert case["decode_step"]["ours"]["ops"] < case["decode_step"]["transformers"]["ops"]
    assert result["min_speedup"] == min(r["speedup"] for r in case["by_threads"].values())
    assert result["met_everywhere"] == (result["min_speedup"] >= 1.5)
