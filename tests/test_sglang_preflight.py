"""The rl-pipeline preflight's and `v4rl plan`'s handling of the SGLang model check
(engines/upstream/sglang_preflight.py), with the check's result given: a run whose own mode does not round-trip is refused naming the parameter and the
setting; a bad --sglang-dir is one line naming the fix. The check itself (SGLang's model on CPU) is tested in
tests/conformance/test_plan_sglang.py.

    .venv/bin/python -m pytest tests/test_sglang_preflight.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from engines.upstream import sglang_preflight
from engines.upstream.sglang_preflight import SGLangModelCheck, SGLangUpdateRejected

RUN = "SGLANG_OPT_FP8_WO_A_GEMM=0, FP4 experts (the cluster job's setting)"
BROKEN = {RUN: {"setting": "SGLANG_OPT_FP8_WO_A_GEMM=0", "loads": True, "round_trips": False,
                "reason": "update differs from a fresh load: model.layers.0.self_attn.wq_b.weight_scale_inv: values "
                          "differ (8 bytes)"}}


def _result(modes: dict) -> SGLangModelCheck:
    return SGLangModelCheck(sglang="/src/sglang", run_mode=RUN, update_kind="disk", modes=modes)


def test_pipeline_preflight_refuses_naming_parameter_and_setting(monkeypatch):
    from engines.backends.miles import check_sglang_update

    seen = {}

    def fake_check(preset, overrides, sglang_dir, **kw):
        seen.update(preset=preset, dir=sglang_dir)
        return _result(BROKEN)

    monkeypatch.setattr(sglang_preflight, "check", fake_check)
    with pytest.raises(SGLangUpdateRejected) as err:
        check_sglang_update("dsv4-flash-mi355x", {}, "/src/sglang", log=print)
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


# --------------------------------------------------- the job's own SGLang mode, never the caller's shell (issue 25)
def test_the_run_mode_is_the_miles_jobs_environment_with_fp8_experts():
    from engines.miles.launch import resolve
    from engines.upstream.sglang_model_check import Mode
    from engines.upstream.sglang_preflight import job_sglang_env

    env, whose = job_sglang_env(resolve("dsv4-flash-mi355x", {})[0])
    assert env["SGLANG_DSV4_FP4_EXPERTS"] == "0" and env["SGLANG_OPT_FP8_WO_A_GEMM"] == "0", env
    assert "Miles job" in whose and all(k.startswith("SGLANG_") for k in env)
    run = Mode.from_env("run", env)
    assert run.checkpoint_experts == "fp8" and not run.wo_a_gemm and run.environment() == env
    assert "SGLANG_DSV4_FP4_EXPERTS=0" in run.setting() and "FP8 experts" in run.setting()


def test_check_hands_sglang_a_start_checkpoint_in_the_jobs_format_and_every_variable(monkeypatch, tmp_path):
    from safetensors import safe_open

    from engines.upstream import sglang_model_check

    seen = {}

    def fake_run_cases(cases, paths, workdir, **kw):  # stands in for SGLang: records what it would be handed
        for case in cases:
            files = sorted(Path(case.base).glob("*.safetensors"))
            with safe_open(str(files[0]), framework="pt") as f:
                expert = next(k for k in f.keys() if ".experts." in k and k.endswith(".weight"))
                seen[case.name] = (case.mode.environment(), str(f.get_tensor(expert).dtype))
        return {c.name: sglang_model_check.CaseResult(c.name, {"first_load": {"ok": True}, "update": {"ok": True},
                                                             "differences": []}) for c in cases}

    monkeypatch.setenv("SGLANG_DSV4_FP4_EXPERTS", "1")  # a caller's shell: must not decide anything
    monkeypatch.setattr(sglang_model_check, "run_cases", fake_run_cases)
    monkeypatch.setattr(sglang_preflight, "sglang_source", lambda d: [Path(d)])
    result = sglang_preflight.check("dsv4-flash-mi355x", {}, str(tmp_path), workdir=tmp_path)
    run_env, run_dtype = seen["run"]
    assert run_env["SGLANG_DSV4_FP4_EXPERTS"] == "0" and run_dtype == "torch.float8_e4m3fn", seen["run"]
    assert result.run_env == run_env and "SGLANG_DSV4_FP4_EXPERTS=0" in result.run_mode and result.ok
    others = {k: v for k, v in seen.items() if k != "run"}
    assert others and all(env["SGLANG_DSV4_FP4_EXPERTS"] == "1" and dtype != "torch.float8_e4m3fn"
                          for env, dtype in others.values()), others
    assert all(mode["env"] for mode in result.modes.values())


def test_sglangs_own_error_is_one_line_when_its_probe_dies(tmp_path):
    from engines.upstream.sglang_model_check import Case, Mode, run_cases

    fake = tmp_path / "src" / "sglang"
    (fake / "srt").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "srt" / "__init__.py").write_text("assert False, 'planted: this SGLang needs a GPU to import'\n")
    with pytest.raises(RuntimeError) as err:
        run_cases([Case("run", str(tmp_path), Mode("run"))], [tmp_path / "src"], tmp_path, timeout=300)
    message = str(err.value)
    assert "AssertionError: planted: this SGLang needs a GPU to import" in message, message
    assert "Traceback" not in message and "\n" not in message, message
