"""`v4rl plan --sglang-dir`: the user's own SGLang DeepSeek-V4 model on CPU, one update of the run's kind vs a fresh
load (v4rl/plan_sglang.py). On the pinned SGLang it reports the round trip per mode and accepts the run; on a COPY
of that source with a planted defect (FP8 linears' post-processing doubles `weight_scale_inv` once and latches a
flag that restore_weights_before_loading never clears: a scale not restored) it exits 2 naming the parameter and
the setting. For the MI355X preset the run's mode is the Miles job's own SGLANG_* environment with FP8 experts
(SGLANG_DSV4_FP4_EXPERTS=0, the seed's repackage), checked from a shell that has those variables exported (a
cluster node): every mode still loads, because each sets its own variables. Each run imports SGLang and builds several tiny models (3-5 min on 2 cores), so both are `slow`.

    .venv/bin/python -m pytest tests/conformance/test_plan_sglang.py -q -m slow
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from v4rl.cli import app

ANCHOR = "        layer.weight.data = weight.data\n        layer.weight_scale_inv.data = weight_scale.data\n"
PLANT = (ANCHOR + "        if not getattr(layer.weight_scale_inv, 'v4rl_planted', False):  # planted by v4rl's test\n"
         "            layer.weight_scale_inv.data = layer.weight_scale_inv.data * 2\n"
         "            layer.weight_scale_inv.v4rl_planted = True\n")


def _plan(sglang_dir: Path, preset: str = "tiny-cpu") -> tuple[int, dict]:
    done = CliRunner().invoke(app, ["plan", "--preset", preset, "--sglang-dir", str(sglang_dir), "--json"])
    assert done.exception is None or isinstance(done.exception, SystemExit), done.output
    return done.exit_code, json.loads(done.output[done.output.index("{"):])


@pytest.fixture(scope="module")
def pinned_src(sglang_paths) -> Path:
    src = Path(sglang_paths[0])
    if not (src / "sglang" / "srt" / "layers" / "quantization" / "fp8.py").is_file():
        pytest.skip(f"{src} is not an SGLang source tree")
    return src


@pytest.mark.slow
def test_plan_on_the_pinned_sglang_reports_every_mode(pinned_src):
    code, out = _plan(pinned_src)
    check = out["sglang_model_check"]
    assert code == 0 and check["ok"], check
    modes = check["modes"]
    assert modes[check["run_mode"]]["round_trips"] and "SGLANG_OPT_FP8_WO_A_GEMM=0" in check["run_mode"]
    fp8 = next(m for label, m in modes.items()
               if label.startswith("SGLANG_OPT_FP8_WO_A_GEMM=1,") and "DeepGEMM" not in label)
    assert not fp8["round_trips"] and "wo_a.weight_scale_inv" in fp8["reason"]


@pytest.mark.slow
def test_plan_refuses_an_sglang_whose_update_leaves_a_scale_unrestored(pinned_src, tmp_path):
    copy = tmp_path / "sglang-copy"
    shutil.copytree(pinned_src / "sglang", copy / "sglang", copy_function=os.link)  # hard links: fast, no bytes
    target = copy / "sglang" / "srt" / "layers" / "quantization" / "fp8.py"
    text = target.read_text()
    assert text.count(ANCHOR) == 1, "the planted defect's anchor moved in this SGLang; update ANCHOR"
    target.unlink()  # a new file: the pinned source (hard-linked) stays untouched
    target.write_text(text.replace(ANCHOR, PLANT))
    code, out = _plan(copy)
    check = out["sglang_model_check"]
    assert code == 2 and not check["ok"]
    reason = check["modes"][check["run_mode"]]["reason"]
    assert "weight_scale_inv: values differ" in reason, reason
    assert "SGLANG_OPT_FP8_WO_A_GEMM=0" in check["run_mode"]
    assert (pinned_src / "sglang" / "srt" / "layers" / "quantization" / "fp8.py").read_text() == text


@pytest.mark.slow
def test_plan_checks_the_jobs_own_mode_whatever_the_callers_shell_exports(pinned_src, monkeypatch):
    from engines.miles.launch import resolve
    from engines.upstream.sglang_preflight import job_sglang_env

    job_env, _ = job_sglang_env(resolve("dsv4-flash-mi355x", {})[0])
    for name, value in job_env.items():  # a cluster node's shell: the job's variables exported
        monkeypatch.setenv(name, value)
    code, out = _plan(pinned_src, "dsv4-flash-mi355x")
    check = out["sglang_model_check"]
    assert code == 0 and check["ok"], check
    assert check["run_env"] == job_env and job_env["SGLANG_DSV4_FP4_EXPERTS"] == "0"
    assert "FP8 experts" in check["run_mode"] and "Miles job" in check["run_mode"], check["run_mode"]
    for label, mode in check["modes"].items():  # the FP4 modes set SGLANG_DSV4_FP4_EXPERTS=1 themselves
        assert mode["loads"], (label, mode["reason"])
        assert mode["env"]["SGLANG_DSV4_FP4_EXPERTS"] == ("0" if label == check["run_mode"] else "1"), label
