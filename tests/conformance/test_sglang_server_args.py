"""(d) SGLang 0.5.23's `prepare_server_args` (argparse + `ServerArgs.from_cli_args`) on v4rl's launch argv.

For every run preset and every hardware profile, `engines/rollout/launcher.py` builds the
`python -m sglang.launch_server ...` command line; SGLang's own parser must accept every flag, and the
resulting `ServerArgs` must hold what v4rl meant (sizes, memory, limits, key, version, determinism).
Variants cover attention DP (`--attn-dp-size`, what a preset's engine_dp means) and whole-model replicas
(`--dp-size`). Every SGLANG_* variable the launch environment sets must be one SGLang declares
(`sglang.srt.environ`). SGLang's config resolution (device, model config) runs on the GPU nodes; the model
config half of it is part (e).

    .venv/bin/python -m pytest tests/conformance/test_sglang_server_args.py -q
"""

from __future__ import annotations

import dataclasses

import pytest

from engines.miles.launch import RUN_PRESETS
from engines.profiles import PROFILES
from engines.rollout.launcher import SGLangServerSpec, build_launch_command, launch_env

INTENDED = {"model_path": "model_path", "tp_size": "tp_size", "ep_size": "ep_size", "attn_dp_size": "attn_dp_size",
            "dp_size": "dp_size", "mem_fraction_static": "mem_fraction_static",
            "max_running_requests": "max_running_requests", "max_total_tokens": "max_total_tokens",
            "context_length": "context_length", "weight_version": "weight_version", "api_key": "api_key",
            "enable_deterministic_inference": "deterministic"}
"""ServerArgs field -> the SGLangServerSpec field it must carry."""


def _specs(tmp_path) -> list[tuple[str, SGLangServerSpec]]:
    model = str(tmp_path / "hf-fp8")
    out = []
    for preset in RUN_PRESETS.values():
        for profile in PROFILES.values():
            out.append((f"{preset.name}/{profile.name}", SGLangServerSpec.from_preset(
                model, preset, profile, api_key="k3y", weight_version="12", deterministic=True)))
    seed = RUN_PRESETS["dsv4-flash-mi355x"]
    attn_dp = dataclasses.replace(seed, rollout=dataclasses.replace(seed.rollout, engine_dp=2))
    out.append(("attention-dp", SGLangServerSpec.from_preset(model, attn_dp, PROFILES["mi355x"])))
    out.append(("replicas", SGLangServerSpec(model_path=model, tp_size=2, dp_size=2)))
    return out


def test_launch_argv_parses_to_the_intended_server_args(sglang_worker, tmp_path):
    for name, spec in _specs(tmp_path):
        argv = build_launch_command(spec, host="127.0.0.1", port=30001)
        assert argv[1:3] == ["-m", "sglang.launch_server"]
        parsed = sglang_worker.call("server_args", argv=argv[3:], timeout=120)
        want = {field: getattr(spec, ours) for field, ours in INTENDED.items()}
        got = {field: parsed[field] for field in INTENDED}
        assert got == want, (name, {k: (want[k], got[k]) for k in want if want[k] != got[k]})
        assert (parsed["host"], parsed["port"], parsed["trust_remote_code"]) == ("127.0.0.1", 30001, True), name


def test_launch_environment_names_only_variables_sglang_declares(sglang_worker, tmp_path):
    declared = set(sglang_worker.call("environ_names", timeout=120))
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB" in declared
    for name, spec in _specs(tmp_path):
        ours = {k for k in launch_env(spec, base={}) if k.startswith("SGLANG_")}
        assert ours and ours <= declared, (name, sorted(ours - declared))


@pytest.mark.parametrize("flag", ["--attn-dp-size", "--dp-size"])
def test_both_data_parallel_flags_exist(sglang_worker, tmp_path, flag):
    parsed = sglang_worker.call("server_args", argv=["--model-path", str(tmp_path), "--tp-size", "4", flag, "2"])
    assert parsed["attn_dp_size" if flag == "--attn-dp-size" else "dp_size"] == 2
