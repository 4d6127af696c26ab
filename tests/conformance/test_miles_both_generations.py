"""Every command that takes `--miles-dir`, on BOTH vendored Miles DeepSeek-V4 generations, run as a user runs them
(typer's runner on the real CLI): `v4rl plan --preset dsv4-flash-mi355x --miles-dir` (Miles' parse_args on the job
and Miles' Flash model on the meta device vs the checkpoint), and `v4rl convert --miles-dir` then
`v4rl verify-ckpt --miles-dir` on a tiny checkpoint. A generation-1 checkout gets no generation-2 flag anywhere
(its parser has no `--dsv4-impl` and exits 2 on one: the regression of issue 25). And when Miles' own parser
does refuse a flag, the message carries Miles' own argparse line, in one line, with no traceback.
Each command builds Miles' model (1-4 min on 2 cores), so all are `slow`.

    .venv/bin/python -m pytest tests/conformance/test_miles_both_generations.py -q -m slow
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.conformance.miles_model_harness import make_hf_checkpoint, tiny_miles_config
from v4rl.cli import app

pytestmark = pytest.mark.slow


@pytest.fixture(params=[1, 2], ids=["generation-1", "generation-2"])
def pair(request) -> tuple[int, Path, Path]:
    """(generation, Miles tree, Megatron-LM tree) of one vendored generation (skipped where it is absent)."""
    names = ("miles_tree", "megatron_tree") if request.param == 1 else ("miles_gen2_tree", "megatron_gen2_tree")
    return request.param, *(request.getfixturevalue(n) for n in names)


def _run(*argv: str):
    done = CliRunner().invoke(app, [str(a) for a in argv])
    assert done.exception is None or isinstance(done.exception, SystemExit), done.output
    return done


def test_plan_with_miles_dir_accepts_the_job_and_builds_flash(pair):
    generation, miles, megatron = pair
    done = _run("plan", "--preset", "dsv4-flash-mi355x", "--miles-dir", miles, "--megatron-dir", megatron, "--json")
    assert done.exit_code == 0, done.output
    assert "Traceback" not in done.output and "SystemExit" not in done.output, done.output
    out = json.loads(done.output[done.output.index("{"):])
    assert out["miles_check"]["ok"] and out["miles_check"]["generation"] == generation, out["miles_check"]
    keys = out["miles_model_keys"]
    assert keys["ok"] and keys["generation"] == generation, keys
    assert ("--dsv4-impl" in out["miles"]["argv"]) == (generation == 2)


def test_convert_then_verify_ckpt_with_miles_dir(pair, tmp_path):
    generation, miles, megatron = pair
    hf = make_hf_checkpoint(tmp_path / "hf", tiny_miles_config())
    dst = tmp_path / "torch_dist"
    done = _run("convert", hf, dst, "--miles-dir", miles, "--no-progress")
    assert done.exit_code == 0, done.output
    report = tmp_path / "verify.json"
    done = _run("verify-ckpt", dst, "--miles-dir", miles, "--megatron-dir", megatron, "--json", report,
                "--no-progress")
    assert done.exit_code == 0, done.output
    result = json.loads(report.read_text())["miles"]
    assert result["ok"] and result["generation"] == generation and result["keys"]["ok"], result
    assert result["dsv4_impl"] == (None if generation == 1 else "miles")
    assert result["loads"] and all(load["ok"] for load in result["loads"])


def test_a_flag_miles_refuses_is_reported_in_miles_own_words(miles_tree, megatron_tree, tmp_path):
    from engines.upstream.miles_model_check import MilesModelError, probe_argv, run_probe

    hf = make_hf_checkpoint(tmp_path / "hf", tiny_miles_config())
    config = json.loads((hf / "config.json").read_text())
    argv = probe_argv(config, hf_dir=hf, load_dir=tmp_path, meta=True, extra=["--dsv4-impl", "miles"])
    with pytest.raises(MilesModelError) as err:
        run_probe({"argv": argv, "do": ["keys"]}, miles_dir=miles_tree, megatron_dir=megatron_tree)
    message = str(err.value)
    assert "error: unrecognized arguments: --dsv4-impl miles" in message, message
    assert "stage parse" in message and "Traceback" not in message and "\n" not in message, message
