"""`v4rl score`: our engine vs transformers' DeepseekV4ForCausalLM loaded by `from_pretrained` from the same
FP8 + FP4 checkpoint we wrote.

Tolerances (measured on the random tiny-cpu checkpoint, 8 sequences x 8 response tokens):
  float32   both dequantize the same bytes and compute in fp32: measured 0.0; bound 1e-5.
  bfloat16  same weights (FP8/FP4 values are exact in bf16), bf16 rounding in a different op order:
            measured max 0.023, mean 0.003; bound max 0.1, mean 0.01. For scale, the seed's FP8 SGLang
            vs BF16 Megatron gap is a mean of ~0.09.

    .venv/bin/python -m pytest tests/test_score.py -q
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch

from engines.align.score import score


def _sequences(n: int = 8, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_ids": [0] + [rng.randrange(4, 100) for _ in range(30)],
             "response_ids": [rng.randrange(4, 100) for _ in range(8)]} for _ in range(n)]


def _diffs(a: list[dict], b: list[dict]) -> torch.Tensor:
    return torch.tensor([abs(x - y) for p, q in zip(a, b) for x, y in zip(p["logprobs"], q["logprobs"])])


def test_fp32_ours_equals_transformers_from_pretrained(tiny_checkpoint):
    seqs = _sequences()
    ours = score(tiny_checkpoint, seqs, engine="ours", dtype="float32")
    reference = score(tiny_checkpoint, seqs, engine="reference", dtype="float32")
    assert [len(r["logprobs"]) for r in ours] == [8] * 8
    assert _diffs(ours, reference).max() < 1e-5


def test_bf16_ours_close_to_transformers_from_pretrained(tiny_checkpoint):
    seqs = _sequences(seed=1)
    d = _diffs(score(tiny_checkpoint, seqs, engine="ours", dtype="bfloat16"),
               score(tiny_checkpoint, seqs, engine="reference", dtype="bfloat16"))
    assert d.max() < 0.1 and d.mean() < 0.01, (d.max(), d.mean())


def test_cli_writes_one_logprob_per_response_token(tiny_checkpoint, tmp_path):
    seqs = _sequences(n=3, seed=2)
    seqs[1]["response_ids"] = seqs[1]["response_ids"][:2]
    inp, out = tmp_path / "seqs.json", tmp_path / "out.json"
    inp.write_text(json.dumps(seqs))
    proc = subprocess.run([sys.executable, "-m", "v4rl.cli", "score", "--model", str(tiny_checkpoint),
                           "--input", str(inp), "--engine", "ours", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(out.read_text())
    assert [len(r["logprobs"]) for r in got] == [8, 2, 8]
    want = score(tiny_checkpoint, seqs, engine="ours")
    assert _diffs(got, want).max() == 0
    assert all(lp <= 0 for r in got for lp in r["logprobs"])


@pytest.mark.parametrize("body, message", [
    ("{}", "expected a JSON list"),
    ('[{"prompt_ids": [], "response_ids": [5]}]', "entry 0 has an empty prompt_ids"),
    ('[{"prompt_ids": [1], "response": [5]}]', "entry 0 needs integer lists"),
    ('[{"prompt_ids": [1], "response_ids": [500]}]', "token ids [500] outside the vocabulary"),
])
def test_cli_bad_input_names_the_problem(tiny_checkpoint, tmp_path, body, message):
    inp = tmp_path / "bad.json"
    inp.write_text(body)
    proc = subprocess.run([sys.executable, "-m", "v4rl.cli", "score", "--model", str(tiny_checkpoint),
                           "--input", str(inp), "--json", str(tmp_path / "out.json")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert message in proc.stderr.replace("\n", " ")
    assert not (tmp_path / "out.json").exists()
