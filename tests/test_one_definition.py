"""One definition of a run: every surface's numbers are its preset's (engines/presets/runs.py), none its own.

The tiny-cpu preset (TINY_RUN) is what `v4rl train`, the rl-pipeline form (PipelineParams), the tiny-cpu deployment,
the embedded trainer's TrainRunConfig / LoopConfig and `v4rl plan --preset tiny-cpu` run; the demo's and the
nightly's smaller runs are the named overrides in SHORT_RUNS; the cluster presets' form defaults are the seed's run
(SEED_RUN). Each test fails when one surface's default drifts from the preset (issue 26).

    .venv/bin/python -m pytest tests/test_one_definition.py -q
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import yaml

from engines.presets.runs import SHORT_RUNS, preset_name, resolve, run_numbers
from flows.params import FORM_NUMBERS, PRESET_PARAMS, PipelineParams

REPO = Path(__file__).resolve().parent.parent
TINY = run_numbers("tiny-cpu")
CLUSTER_PRESETS = ("dsv4-flash-mi355x", "dsv4-flash-mi355x-1node", "dsv4-flash-mi355x-32gpu")


def _form(params) -> dict:
    return {name: getattr(params, name) for name in FORM_NUMBERS}


def _expected_form(preset: str) -> dict:
    """Every preset's form holds that preset's own numbers (no surface keeps a default of its own)."""
    numbers = run_numbers(preset)
    return {name: numbers[name] for name in FORM_NUMBERS}


def test_the_measured_run_is_the_tiny_cpu_preset():
    """docs/results.md's 100 steps: 128 prompts x 8 samples, lr 1e-4, eval 200 x 8 every 10, 8 new tokens."""
    assert {k: TINY[k] for k in ("prompts_per_step", "n_samples", "lr", "eval_interval", "n_eval", "eval_samples",
                                 "max_new_tokens", "temperature", "seed")} == dict(
        prompts_per_step=128, n_samples=8, lr=1e-4, eval_interval=10, n_eval=200, eval_samples=8, max_new_tokens=8,
        temperature=1.0, seed=0)


def test_v4rl_train_options_default_to_the_preset():
    import typer.main

    from v4rl.cli import app

    train = next(c for name, c in typer.main.get_command(app).commands.items() if name == "train")
    defaults = {p.name: p.default for p in train.params}
    drift = {name: (defaults[name], TINY[name]) for name in TINY if name in defaults and defaults[name] != TINY[name]}
    assert not drift, f"`v4rl train` option defaults differ from the tiny-cpu preset: {drift}"
    assert {"steps", "prompts_per_step", "n_samples", "lr", "eval_interval", "n_eval", "eval_samples",
            "seed"} <= set(defaults)


@pytest.mark.parametrize("preset", ["tiny-cpu", *CLUSTER_PRESETS])
def test_pipeline_params_default_to_the_preset(preset):
    params = PipelineParams.preset_defaults(preset)
    assert _form(params) == _expected_form(preset)
    assert _form(PipelineParams.model_validate({"preset": preset})) == _expected_form(preset)
    if preset != "tiny-cpu":
        assert {k: v for k, v in PRESET_PARAMS[preset].items() if k in FORM_NUMBERS} == _expected_form(preset)


def test_deployment_parameters_are_the_presets():
    spec = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    pipelines = [d for d in spec["deployments"] if d["entrypoint"].startswith("flows/rl_pipeline.py")]
    assert {d["name"] for d in pipelines} >= {"tiny-cpu", "dsv4-flash-mi355x"}
    for deployment in pipelines:
        params = deployment["parameters"]["params"]
        preset = preset_name(params["preset"])
        expected, tiny = _expected_form(preset), _expected_form("tiny-cpu")
        drift = {k: (v, expected[k]) for k, v in params.items() if k in expected and v != expected[k]}
        assert not drift, f"deployments/prefect.yaml {deployment['name']}: numbers differ from the preset: {drift}"
        # the UI's form fills a field the deployment leaves out with the field default (tiny-cpu's), so a cluster
        # deployment must write every number where its preset differs
        missing = sorted(k for k in expected if expected[k] != tiny[k] and k not in params)
        assert not missing, f"deployments/prefect.yaml {deployment['name']} leaves out {missing}"
    from flows.nightly import NightlyParams

    nightly = next(d for d in spec["deployments"] if d["entrypoint"].startswith("flows/nightly.py"))
    defaults = NightlyParams().model_dump()
    assert all(defaults[k] == v for k, v in nightly["parameters"]["params"].items()), nightly["parameters"]


def test_nightly_and_demo_are_named_overrides_of_the_preset(tmp_path):
    from engines import TINY_BASE
    from flows.nightly import NightlyParams
    from v4rl.demo import _demo_params, run_demo

    nightly = NightlyParams()
    assert nightly.numbers() == SHORT_RUNS["nightly"]
    assert NightlyParams(preset="cluster-rehearsal").numbers() == {}  # already a validation run's size
    assert NightlyParams(preset="cluster-rehearsal", steps=2).numbers() == {"steps": 2}
    steps = inspect.signature(run_demo).parameters["steps"].default
    demo = _demo_params(tmp_path, TINY_BASE, TINY["seed"], steps)
    expected = {**_expected_form("tiny-cpu"), **SHORT_RUNS["demo"], "eval_interval": max(1, steps // 2)}
    assert _form(demo) == expected


def test_embedded_configs_built_for_tiny_cpu_are_the_preset(tmp_path, monkeypatch):
    """TrainRunConfig / LoopConfig as the flow, `v4rl train` and the bare defaults build them carry the preset."""
    import engines.train.run as run
    from rl.loop import LoopConfig
    from typer.testing import CliRunner
    from v4rl.cli import app

    def numbers(config: dict) -> dict:
        loop = config["loop"]
        return {"steps": config["steps"], "lr": config["lr"], "n_eval": config["n_eval"],
                "max_tokens_per_gpu": config["max_tokens_per_gpu"],
                **{k: loop[k] for k in run.LOOP_NUMBERS}}

    expected = {k: TINY[k] for k in ("steps", "lr", "n_eval", "max_tokens_per_gpu", *run.LOOP_NUMBERS)}
    assert numbers(dataclasses.asdict(run.TrainRunConfig())) == expected
    assert numbers(dataclasses.asdict(PipelineParams().backend().config)) == expected
    bare = dataclasses.asdict(LoopConfig())  # rl/ cannot import the presets: its literals are held equal here
    assert {k: bare[k] for k in run.LOOP_NUMBERS} == {k: TINY[k] for k in run.LOOP_NUMBERS}

    seen = {}

    def capture(out, config, **_):  # the CLI also hands its log line printer
        seen["config"] = dataclasses.asdict(config)
        return {"evals": []}

    monkeypatch.setattr(run, "run_training", capture)
    result = CliRunner().invoke(app, ["train", "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert numbers(seen["config"]) == expected

    # `v4rl plan --preset tiny-cpu` plans the numbers `v4rl train` runs
    _, planned = resolve("tiny-cpu")
    assert (planned.train.rollout_batch_size, planned.train.n_samples_per_prompt, planned.train.max_tokens_per_gpu,
            planned.train.max_response_len) == (seen["config"]["loop"]["prompts_per_step"],
                                                seen["config"]["loop"]["n_samples"],
                                                seen["config"]["max_tokens_per_gpu"],
                                                seen["config"]["loop"]["max_new_tokens"])


@pytest.mark.parametrize("preset", ["tiny-cpu", *CLUSTER_PRESETS])
def test_the_rehearse_setting_is_the_presets_on_every_surface(preset):
    """MilesSettings.rehearse (engines/presets/spec.py) is the one definition: the form's default per preset, its
    description, and what the deployments write (issue 28's preflight rehearsal)."""
    from engines.presets.runs import get_run_preset
    from rl.field_docs import field_docs

    expected = get_run_preset(preset).miles.rehearse
    assert PipelineParams.preset_defaults(preset).rehearse == expected
    assert PipelineParams.model_validate({"preset": preset}).rehearse == expected
    assert PipelineParams.model_fields["rehearse"].description == field_docs("engines.presets.spec",
                                                                             "MilesSettings")["rehearse"]
    if preset != "tiny-cpu":
        assert PRESET_PARAMS[preset]["rehearse"] == expected
    spec = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    for deployment in spec["deployments"]:
        params = deployment["parameters"]["params"]
        if deployment["entrypoint"].startswith("flows/rl_pipeline.py") and preset_name(params["preset"]) == preset:
            # the UI's form shows the field; a cluster deployment writes it out as its preset has it
            assert params.get("rehearse", expected) == expected, deployment["name"]
            assert preset == "tiny-cpu" or "rehearse" in params, deployment["name"]


def test_rehearse_is_refused_on_the_embedded_preset_in_one_line():
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as err:
        PipelineParams.preset_defaults("tiny-cpu", rehearse="rollout")
    assert "rehearse='rollout': tiny-cpu runs the embedded engines here, with no Miles job to rehearse; leave " \
           "rehearse empty" in str(err.value)
    assert PipelineParams.preset_defaults("dsv4-flash-mi355x", rehearse="train").rehearse == "train"


def test_the_cluster_rehearsal_preset_has_the_rehearsals_sizes():
    """The cluster-rehearsal preset is the seed's job at the rehearsal's sizes (engines/upstream/rehearsal/job.py), so
    the adapted job Miles parses resolves to the preset's values (preflight compares them in the flow)."""
    from engines.presets.runs import REHEARSAL_RUN, SEED_RUN
    from engines.upstream.rehearsal.job import FULL_CHANGES, ROLLOUT_SIZES

    full = {flag: value for flag, value, _ in FULL_CHANGES}
    p = REHEARSAL_RUN
    assert (p.train.rollout_batch_size, p.train.n_samples_per_prompt, p.train.max_response_len) == (
        ROLLOUT_SIZES["rollout_batch_size"], ROLLOUT_SIZES["n_samples_per_prompt"],
        ROLLOUT_SIZES["rollout_max_response_len"])
    assert (p.eval.interval, p.eval.n_samples_per_prompt, p.eval.max_response_len) == (
        ROLLOUT_SIZES["eval_interval"], ROLLOUT_SIZES["n_samples_per_eval_prompt"],
        ROLLOUT_SIZES["eval_max_response_len"])
    assert (p.num_rollout, p.miles.save_interval, p.algorithm.lr) == (
        full["--num-rollout"], full["--save-interval"], full["--lr"])
    # everything else is the seed's job: the algorithm, the data keys and reward, Miles' settings
    assert (p.algorithm.use_tis, p.data.rm_type, p.data.input_key, p.miles.generation, p.mode) == (
        SEED_RUN.algorithm.use_tis, SEED_RUN.data.rm_type, SEED_RUN.data.input_key, SEED_RUN.miles.generation,
        SEED_RUN.mode)
