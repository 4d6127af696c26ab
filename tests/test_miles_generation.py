"""Both Miles DeepSeek-V4 generations: detected from a checkout's code, and the job v4rl builds for each.

Detection reads the pinned trees of ../shared/vendor (skipped where absent): 31f1ca961 is generation 1 (plugin
names), e9e19b223 generation 2 (Megatron's names, `--dsv4-impl miles|megatron`). The generation-2 job carries
`--dsv4-impl`, a `--pipeline-model-parallel-layout` instead of the first/last stage sizes whenever PP > 1 with
hash-routed layers (the seed's PP4: `Et*11|t*11|t*11|t*10L`), `--dsa-kernel-backend none` for the megatron impl
off CUDA, and no `--experimental-attention-variant`; the generation-1 job is what it was. Whether Miles' own
parser and Megatron's config build accept these is tests/conformance/test_miles_parse_args.py.

    .venv/bin/python -m pytest tests/test_miles_generation.py -q        (CPU, a few seconds)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from engines.miles import pins
from engines.upstream import sources as engine_sources
from engines.presets.runs import MILES_1NODE_RUN, MILES_32GPU_RUN, SEED_RUN, resolve
from engines.miles import MilesJob, build_command
from engines.miles.generation import MilesGenerationError, detect_generation, megatron_names_for
from engines.miles.train_args import pipeline_layout

NUM_GPUS = 0
JOB = MilesJob(run_id="r1", hf_checkpoint="${HF}", ref_load="/ckpt/td", save_dir="/ckpt/save")


def _vendor(pin) -> Path:
    """The pin's vendored tree (extracted once into the engine cache); skipped without ../shared/vendor."""
    import os

    if os.environ.get(pin.env):
        pytest.skip(f"${pin.env} is set: this checks the vendored trees")
    vendor = engine_sources.vendor_dir()
    if vendor is None or not (vendor / pin.tarball).is_file():
        pytest.skip(f"no {pin.tarball} in ../shared/vendor ($V4RL_VENDOR_DIR)")
    return engine_sources.miles_tree(None, pin)


def test_generation_is_read_from_the_vendored_trees():
    first = detect_generation(_vendor(pins.MILES))
    assert (first.generation, first.megatron_names, first.dsv4_impls) == (1, "plugin", ())
    second = detect_generation(_vendor(pins.MILES_GEN2))
    assert (second.generation, second.megatron_names, second.dsv4_impls) == (2, "megatron", ("miles", "megatron"))
    assert "assert_checkpoint_is_current" in second.evidence and "linear_q_down_proj" in second.evidence
    assert megatron_names_for(_vendor(pins.MILES_GEN2))[0] == "megatron"


def test_detection_errors_name_the_directory_and_the_fix(tmp_path):
    with pytest.raises(MilesGenerationError, match=r"does not exist; point it at your Miles checkout"):
        detect_generation(tmp_path / "nowhere")
    with pytest.raises(MilesGenerationError, match=r"no miles_plugins/models/deepseek_v4/deepseek_v4\.py.*--miles-generation 1\|2"):
        detect_generation(tmp_path)
    plugin = tmp_path / "miles_plugins" / "models" / "deepseek_v4"
    plugin.mkdir(parents=True)
    (plugin / "deepseek_v4.py").write_text("self.linear_q_down_proj = x\nself.wq_a = y\n")  # neither generation
    with pytest.raises(MilesGenerationError, match="matches neither generation"):
        detect_generation(tmp_path)
    assert megatron_names_for(None) == ("plugin", "default (no --miles-dir): Miles' plugin names, DeepSeek-V4 "
                                                  "generation 1")
    assert megatron_names_for(tmp_path, "megatron")[0] == "megatron"  # forcing never reads the tree


def _gen(preset, generation: int, impl: str = "miles", **parallel):
    miles = dataclasses.replace(preset.miles, generation=generation, dsv4_impl=impl)
    return dataclasses.replace(preset, miles=miles, parallel=dataclasses.replace(preset.parallel, **parallel))


def test_pipeline_layout_strings():
    assert pipeline_layout(43, 4, None, 10) == "Et*11|t*11|t*11|t*10L"  # the seed's PP4 (conformance C7)
    assert pipeline_layout(43, 4, 11, 10) == "Et*11|t*11|t*11|t*10L"  # Miles' 32-GPU preset
    assert pipeline_layout(4, 2, None, None) == "Et*2|t*2L" and pipeline_layout(4, 1, None, None) == "Et*4L"
    with pytest.raises(ValueError, match=r"pp-layer-split"):
        pipeline_layout(43, 4, None, None)


@pytest.mark.parametrize("preset", [SEED_RUN, MILES_32GPU_RUN], ids=lambda p: p.name)
def test_second_generation_job_has_layout_impl_and_no_ignored_flag(preset):
    first = build_command(preset, JOB).flag_values()
    assert first["--decoder-last-pipeline-num-layers"] == ["10"] and "--pipeline-model-parallel-layout" not in first
    assert first["--experimental-attention-variant"] == ["dsv4"] and "--dsv4-impl" not in first
    command = build_command(_gen(preset, 2), JOB)
    flags = command.flag_values()
    assert flags["--pipeline-model-parallel-layout"] == ["Et*11|t*11|t*11|t*10L"]
    assert not {"--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"} & flags.keys()
    assert flags["--dsv4-impl"] == ["miles"] and "--dsa-kernel-backend" not in flags
    assert "--experimental-attention-variant" not in flags
    assert command.to_json()["pin"] == {"miles": "e9e19b223", "megatron_lm": "6184c094a",
                                        "megatron_lm_branch": "dsv4-dual-backend"}
    same = {k: v for k, v in first.items() if k not in ("--decoder-first-pipeline-num-layers",
                                                         "--decoder-last-pipeline-num-layers",
                                                         "--experimental-attention-variant")}
    assert {k: flags[k] for k in same} == same  # nothing else moves


def test_megatron_impl_needs_tp1_and_a_kernel_backend_off_cuda():
    flags = build_command(_gen(SEED_RUN, 2, "megatron"), JOB).flag_values()
    assert flags["--dsv4-impl"] == ["megatron"] and flags["--dsa-kernel-backend"] == ["none"]  # MI355X: no cuDNN
    h200 = dataclasses.replace(_gen(SEED_RUN, 2, "megatron"), profile="h200")
    assert "--dsa-kernel-backend" not in build_command(h200, JOB).flag_values()  # CUDA: Megatron's cudnn default
    with pytest.raises(ValueError, match=r"dsv4_impl='megatron' needs tensor parallel size 1 .*TP=8"):
        build_command(_gen(MILES_1NODE_RUN, 2, "megatron"), JOB)
    with pytest.raises(ValueError, match=r"needs Miles' second DeepSeek-V4 generation"):
        build_command(_gen(SEED_RUN, 1, "megatron"), JOB)
    assert "--pipeline-model-parallel-layout" not in build_command(_gen(MILES_1NODE_RUN, 2), JOB).flag_values()


def test_generation_is_a_preset_override():
    preset, _ = resolve(SEED_RUN.name, {"miles_generation": 2, "dsv4_impl": "megatron"})
    assert (preset.miles.generation, preset.miles.dsv4_impl) == (2, "megatron")


def test_flow_settings_choose_names_and_generation_together(tmp_path, monkeypatch):
    """The rl-pipeline's convert task and Miles job read one answer: the cluster's Miles generation."""
    from flows.params import PipelineParams

    monkeypatch.delenv("V4RL_MILES_DIR", raising=False)
    base = dict(runs_root=str(tmp_path), ray_address="http://10.0.0.1:8265", master_addr="10.0.0.1")
    p = PipelineParams.preset_defaults("dsv4-flash-mi355x", **base)
    assert (p.resolved_miles_generation(), p.backend().megatron_names) == (1, "plugin")
    assert "miles_generation" not in p.miles_overrides()
    p = PipelineParams.preset_defaults("dsv4-flash-mi355x", miles_generation=2, dsv4_impl="megatron", **base)
    assert p.backend().megatron_names == "megatron"
    preset, _ = resolve(p.preset, p.miles_overrides())
    flags = build_command(preset, p.miles_job(), site=p.site()).flag_values()
    assert flags["--dsv4-impl"] == ["megatron"] and flags["--pipeline-model-parallel-layout"] == ["Et*11|t*11|t*11|t*10L"]
    gen2 = tmp_path / "miles" / "miles_plugins" / "models" / "deepseek_v4"
    gen2.mkdir(parents=True)
    (gen2 / "deepseek_v4.py").write_text("self.linear_q_down_proj = TELinear()\n")
    (gen2 / "arguments.py").write_text('add_argument("--dsv4-impl", choices=["miles", "megatron"])\n'
                                       "def assert_checkpoint_is_current(d): ...\n")
    p = PipelineParams.preset_defaults("dsv4-flash-mi355x", miles_check_dir=str(tmp_path / "miles"), **base)
    assert (p.resolved_miles_generation(), p.backend().megatron_names) == (2, "megatron")
    assert PipelineParams.preset_defaults("tiny-cpu", runs_root=str(tmp_path)).backend().megatron_names == "plugin"


def test_plan_builds_the_job_for_the_generation_asked(monkeypatch):
    import json

    from typer.testing import CliRunner

    from v4rl.cli import app

    monkeypatch.delenv("V4RL_MILES_DIR", raising=False)
    result = CliRunner().invoke(app, ["plan", "--preset", "dsv4-flash-mi355x", "--miles-generation", "2", "--json"])
    assert result.exit_code == 0, result.output
    job = json.loads(result.output)["miles"]
    argv = job["argv"]
    assert job["generation"] == 2 and job["pin"]["miles"] == "e9e19b223"
    assert argv[argv.index("--pipeline-model-parallel-layout") + 1] == "Et*11|t*11|t*11|t*10L"
    result = CliRunner().invoke(app, ["plan", "--preset", "dsv4-flash-mi355x-1node", "--miles-generation", "2",
                                      "--dsv4-impl", "megatron", "--json"])
    assert result.exit_code == 1 and "needs tensor parallel size 1" in result.output


# ------------------------------------------------------------------- the model checks' --dsv4-impl (issue 25)
GEN1 = __import__("engines.miles.generation", fromlist=["MilesGeneration"]).MilesGeneration(
    1, "plugin", (), "deepseek_v4.py: wq_a")
GEN2 = dataclasses.replace(GEN1, generation=2, megatron_names="megatron", dsv4_impls=("miles", "megatron"))


def test_a_generation_1_checkout_gets_no_dsv4_impl_flag_even_with_the_presets_default():
    from engines.miles.generation import dsv4_impl_args

    assert SEED_RUN.miles.dsv4_impl == "miles"  # what the model-key check used to pass through to Miles
    assert dsv4_impl_args(GEN1, SEED_RUN.miles.dsv4_impl) == [] and dsv4_impl_args(GEN1) == []
    with pytest.raises(MilesGenerationError, match="needs Miles' second DeepSeek-V4 generation"):
        dsv4_impl_args(GEN1, "megatron")


def test_a_generation_2_checkout_gets_its_impl_and_megatrons_cpu_kernels():
    from engines.miles.generation import dsv4_impl_args

    assert dsv4_impl_args(GEN2) == ["--dsv4-impl", "miles"] == dsv4_impl_args(GEN2, "miles")
    assert dsv4_impl_args(GEN2, "megatron") == ["--dsv4-impl", "megatron", "--dsa-kernel-backend", "none"]
    with pytest.raises(MilesGenerationError, match="declares miles|megatron"):
        dsv4_impl_args(GEN2, "tilelang")


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_megatron_fit_names_the_first_module_level_import_the_megatron_lacks(tmp_path):
    from engines.upstream.megatron_fit import megatron_misfit

    miles = _tree(tmp_path / "miles", {
        "train.py": "from megatron.core import mpu\n",
        "miles/backends/args.py": "import os\nfrom megatron.core.tokenizers.utils.build_tokenizer import build\n",
        "miles/optional.py": "try:\n    from megatron.core.absent import x\nexcept ImportError:\n    x = None\n"
                             "def f():\n    import megatron.also_absent\n",
        "miles/relative.py": "from .megatron import y\n"})
    megatron = _tree(tmp_path / "meg", {"megatron/__init__.py": "", "megatron/core/__init__.py": ""})
    assert megatron_misfit(miles, megatron) == (
        f"miles/backends/args.py:2 imports megatron.core.tokenizers.utils.build_tokenizer, which the Megatron-LM at "
        f"{megatron} lacks")
    _tree(megatron, {"megatron/core/tokenizers/utils/build_tokenizer.py": ""})
    assert megatron_misfit(miles, megatron) is None  # try/except and function-level imports are Miles' optional ones
