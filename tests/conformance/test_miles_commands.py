"""The user-facing commands that run Miles' OWN DeepSeek-V4 model, run as a user runs them (typer's runner on the
real CLI, no internals called): `v4rl convert --miles-dir` then `v4rl verify-ckpt --miles-dir --against` on a
Miles-legal tiny checkpoint, and `v4rl plan --preset dsv4-flash-mi355x --miles-dir` (Flash on the meta device).
Each also refuses a planted mismatch: a checkpoint converted for the other Miles generation, a job planned for
the other generation. Every command builds Miles' model (1-4 min on 2 cores), so all are `slow`.

    .venv/bin/python -m pytest tests/conformance/test_miles_commands.py -q -m slow
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.conformance.miles_model_harness import make_hf_checkpoint, tiny_miles_config
from v4rl.cli import app

pytestmark = pytest.mark.slow


def _run(*argv: str):
    done = CliRunner().invoke(app, [str(a) for a in argv])
    assert done.exception is None or isinstance(done.exception, SystemExit), done.output
    return done


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("miles-cli") / "hf", tiny_miles_config())


def test_convert_then_verify_ckpt_runs_keys_load_and_forward(tiny_hf, tmp_path, miles_tree, megatron_tree):
    dst = tmp_path / "torch_dist"
    done = _run("convert", tiny_hf, dst, "--miles-dir", miles_tree, "--no-progress")
    assert done.exit_code == 0, done.output
    report = tmp_path / "verify.json"
    done = _run("verify-ckpt", dst, "--miles-dir", miles_tree, "--megatron-dir", megatron_tree, "--against", tiny_hf,
                "--json", report, "--no-progress")
    assert done.exit_code == 0, done.output
    assert "(a) keys: ok" in done.output and "(c) forward: ok" in done.output, done.output
    result = json.loads(report.read_text())["miles"]
    assert result["ok"] and result["generation"] == 1 and result["keys"]["model_keys"] == 118
    assert result["loads"] and all(load["ok"] for load in result["loads"])
    logprobs = result["forward"]["logprobs"]
    assert logprobs["within_bound"] and logprobs["mean"] < logprobs["bound"], logprobs


def test_verify_ckpt_refuses_a_checkpoint_converted_for_the_other_generation(tiny_hf, tmp_path, miles_gen2_tree,
                                                                           megatron_gen2_tree, miles_tree):
    dst = tmp_path / "torch_dist"
    assert _run("convert", tiny_hf, dst, "--miles-dir", miles_tree, "--no-progress").exit_code == 0
    done = _run("verify-ckpt", dst, "--miles-dir", miles_gen2_tree, "--megatron-dir", megatron_gen2_tree,
                "--no-progress")
    assert done.exit_code != 0, done.output
    assert "(a) keys: DIFFER" in done.output and "v4rl convert SRC DST --miles-dir" in done.output, done.output
    assert "Miles refused it" in done.output and "before the attention weights were renamed" in done.output


def test_plan_builds_flash_and_stops_a_job_for_the_other_generation(miles_gen2_tree, megatron_gen2_tree):
    done = _run("plan", "--preset", "dsv4-flash-mi355x", "--miles-dir", miles_gen2_tree, "--megatron-dir",
                megatron_gen2_tree, "--json")
    assert done.exit_code == 0, done.output
    keys = json.loads(done.output[done.output.index("{"):])["miles_model_keys"]
    assert keys["ok"] and keys["model_keys"] == 1414, keys
    done = _run("plan", "--preset", "dsv4-flash-mi355x", "--miles-dir", miles_gen2_tree, "--megatron-dir",
                megatron_gen2_tree, "--miles-generation", "1")
    assert done.exit_code == 2, done.output  # Miles' own parser refuses it; the key check follows the checkout
    assert "rejects v4rl's job (nothing was submitted)" in done.output and "set miles_generation 2" in done.output
