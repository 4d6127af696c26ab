"""`bench/train.py` runs end to end on a tiny batch and writes the JSON the README quotes (slow: ~20 s).
Speeds are not asserted here (they live in the bench output, both sides measured in the same run).

    .venv/bin/python -m pytest tests/test_train_bench.py -q -m slow
"""

from __future__ import annotations

import json

import pytest

from bench.train import main


@pytest.mark.slow
def test_bench_train_writes_its_json(tmp_path):
    out = tmp_path / "train.json"
    result = main(out, n_sequences=16, samples_per_prompt=8, repeats=1)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert {"machine", "data", "ours", "transformers", "speedup", "runs_s", "first_step_check", "goals"} <= set(result)
    assert result["ours"]["tok_s_best"] > 0 and result["transformers"]["tok_s_best"] > 0
    assert 0 < result["ours"]["forwarded_per_real_token"] < 1 and 0 < result["transformers"]["padding_fraction"] < 1
    assert result["ours"]["with_rollout_routes"] and result["ours"]["threads"] >= 1
    assert result["ours"]["trainer_tok_s_median"] > 0
    assert len(result["runs_s"]) == 1
    check = result["first_step_check"]  # same weights, same data, same loss: the two sides agree
    assert check["ours"]["pg_loss"] == pytest.approx(check["transformers"]["pg_loss"], abs=1e-3)
    assert check["ours"]["grad_norm"] == pytest.approx(check["transformers"]["grad_norm"], rel=1e-2)
    assert set(result["goals"]) == {"tokens_per_s_vs_transformers_padded"}
