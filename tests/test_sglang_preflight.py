"""The rl-pipeline preflight's and `v4rl plan`'s handling of the SGLang model check
(engines/rollout/sglang_preflight.py), with the check's result given: a run whose own mode does not round-trip is refused naming the parameter and the
setting; a bad --sglang-dir is one line naming the fix. The check itself (SGLang's model on CPU) is tested in
tests/conformance/test_plan_sglang.py.

    .venv/bin/python -m pytest tests/test_sglang_preflight.py -q
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from engines.rollout import sglang_preflight
from engines.rollout.sglang_preflight import SGLangModelCheck, SGLangUpdateRejected

RUN = "SGLANG_OPT_FP8_WO_A_GEMM=0, FP4 experts (the cluster job's setting)"
BROKEN = {RUN: {"setting": "SGLANG_OPT_FP8_WO_A_GEMM=0", "loads": True, "round_trips": False,
                "reason": "update differs from a fresh load: model.layers.0.self_attn.wq_b.weight_scale_inv: values "
                          "differ (8 bytes)"}}


def _result(modes: dict) -> SGLangModelCheck:
    return SGLangModelCheck(sglang="/src/sglang", run_mode=RUN, update_kind="disk", modes=modes)


def test_pipeline_preflight_refuses_naming_parameter_and_setting(monkeypatch):
    from tasks.preflight import _check_sglang_model

    seen = {}

    def fake_check(preset, overrides, sglang_dir, **kw):
        seen.update(preset=preset, dir=sglang_dir)
        return _result(BROKEN)

    monkeypatch.setattr(sglang_preflight, "check", fake_check)
    with pytest.raises(SGLangUpdateRejected) as err:
        _check_sglang_model("dsv4-flash-mi355x", {"sglang_dir": "/src/sglang"})
    assert "wq_b.weight_scale_inv" in str(err.value) and "SGLANG_OPT_FP8_WO_A_GEMM=0" in str(err.value)
    assert seen == {"preset": "dsv4-flash-mi355x", "dir": "/src/sglang"}


def test_plan_exits_2_naming_the_parameter(monkeypatch):
    from v4rl import plan_sglang
    from v4rl.cli import app

    monkeypatch.setattr(plan_sglang, "check", lambda *a, **k: _result(BROKEN))
    done = CliRunner().invoke(app, ["plan", "--preset", "tiny-cpu", "--sglang-dir", "/src/sglang"])
    assert done.exit_code == 2, done.output
    assert "wq_b.weight_scale_inv" in done.output and "refused" in done.output


def test_plan_names_a_directory_without_sglang(tmp_path):
    from v4rl.cli import app

    done = CliRunner().invoke(app, ["plan", "--preset", "tiny-cpu", "--sglang-dir", str(tmp_path)])
    assert done.exit_code == 1
    assert "holds no sglang/srt/models/deepseek_v4.py" in done.output
