"""A misspelt field of a typed setting is refused before anything runs, naming it and the closest valid name
(issue 40: `prefect deployment run 'rl-pipeline/tiny-cpu' -p params='{"stepz": 3}'` started the default 100-step
run): the flows' parameters (PipelineParams, NightlyParams), through a real flow call and through `prefect
deployment run` against the session's Prefect server, and every setting built from a dict (rollout correction,
preset overrides, TrainRunConfig).

    .venv/bin/python -m pytest tests/test_unknown_fields.py -q
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from pydantic import ValidationError

from tests.prefect_server import flow_run_children

STEPZ = "unknown field 'stepz'; did you mean 'steps'?"


@pytest.mark.parametrize("data", [{"stepz": 3}, {"preset": "dsv4-flash-mi355x", "stepz": 3}],
                         ids=["tiny-cpu", "cluster-preset"])
def test_pipeline_params_refuse_an_unknown_field(data):
    from flows.params import PipelineParams

    with pytest.raises(ValidationError, match=STEPZ):
        PipelineParams.model_validate(data)
    with pytest.raises(ValidationError, match=r"unknown fields 'lrr' \(did you mean 'lr'\?\), 'stepz'"):
        PipelineParams.model_validate({**data, "lrr": 1e-5})
    data = {**{k: v for k, v in data.items() if k != "stepz"}, "steps": 3, "eval_interval": 1}
    assert PipelineParams.model_validate(data).steps == 3


def test_nightly_params_refuse_an_unknown_field():
    from flows.nightly import NightlyParams

    with pytest.raises(ValidationError, match=STEPZ):
        NightlyParams.model_validate({"stepz": 3})
    with pytest.raises(ValidationError, match="unknown field 'min_histroy'; did you mean 'min_history'?"):
        NightlyParams.model_validate({"min_histroy": 1})
    assert NightlyParams.model_validate({"steps": 3}).steps == 3


def test_settings_built_from_dicts_refuse_an_unknown_field():
    from engines import TINY_BASE
    from engines.presets.runs import apply_overrides, get_run_preset
    from engines.train.run import TrainRunConfig
    from rl.correction_setting import RolloutCorrection

    with pytest.raises(ValueError, match="rollout_correction: unknown field 'mdoe'; did you mean 'mode'?"):
        RolloutCorrection.coerce({"mdoe": "icepop"})
    with pytest.raises(ValueError, match="preset overrides: unknown field 'num_rolout'; did you mean 'num_rollout'?"):
        apply_overrides(get_run_preset("dsv4-flash-mi355x"), {"num_rolout": 3})
    with pytest.raises(ValueError, match=f"TrainRunConfig: {STEPZ}"):
        TrainRunConfig.from_dict({"base": str(TINY_BASE), "stepz": 3})
    with pytest.raises(ValueError, match="TrainRunConfig.loop: unknown field 'n_sample'; did you mean 'n_samples'?"):
        TrainRunConfig.from_dict({"base": str(TINY_BASE), "loop": {"n_sample": 4}})


def test_a_misspelt_flow_parameter_fails_the_run_before_anything_runs(prefect_server, tmp_path):  # noqa: F811
    """Through the real flow calls: the run fails in parameter validation, naming the field and the closest, and
    no task ran (no preflight, no training, no run directory)."""
    from flows.nightly import nightly_validation
    from flows.rl_pipeline import rl_pipeline

    runs = tmp_path / "runs"
    small = dict(runs_root=str(runs), steps=1, eval_interval=1, prompts_per_step=1, n_eval=1)  # were it to run
    for flow, extra in ((rl_pipeline, dict(eval_samples=1, align_prompts=1, use_ray=False)), (nightly_validation, {})):
        state = flow(params={**small, **extra, "stepz": 3}, return_state=True)
        assert state.is_failed(), state
        message = f"{state.message}\n{state.result(raise_on_failure=False)}"
        assert f"params: Value error, {STEPZ}" in message and "Traceback" not in message, message
        tasks, subflows = flow_run_children(state.state_details.flow_run_id, timeout=5)
        assert (tasks, subflows) == ([], []), (flow.name, [t.name for t in tasks])
    assert not runs.exists()


def test_prefect_deployment_run_refuses_the_unknown_field_before_creating_a_run(prefect_server):  # noqa: F811
    """`prefect deployment run -p params='{"stepz": 3}'`: Prefect's server checks the run's parameters against the
    deployment's schema (additionalProperties: false from the model) and refuses at once, naming the field; no
    flow run exists to be picked up."""
    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    from flows.rl_pipeline import rl_pipeline

    name = f"typo-{uuid.uuid4().hex[:8]}"
    deployment_id = rl_pipeline.to_deployment(name=name).apply()
    out = subprocess.run([sys.executable, "-m", "prefect", "deployment", "run", f"rl-pipeline/{name}",
                          "-p", 'params={"stepz": 3}'], env=prefect_server["env"], capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).resolve().parent.parent)
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "'stepz' was unexpected" in text and "Traceback" not in text, text
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))
    assert runs == []


def test_the_site_comes_from_a_prefect_variable(prefect_server):  # noqa: F811
    """`site_variable` reads the cluster site from a Prefect Variable on the real server (Prefect 3.9 has no JSON
    block: the field was `site_block` and failed with ImportError); a parameter given directly wins; a missing or
    misshapen variable and an unknown key are one line each."""
    from prefect.variables import Variable

    from flows.params import PipelineParams

    Variable.set("v4rl-site-test", {"ray_address": "http://10.0.0.1:8265", "master_addr": "10.0.0.1"}, overwrite=True)
    Variable.set("v4rl-site-typo", {"ray_adress": "http://10.0.0.1:8265"}, overwrite=True)
    cluster = dict(preset="dsv4-flash-mi355x")
    site = PipelineParams(**cluster, site_variable="v4rl-site-test", master_addr="10.0.0.2").site()
    assert (site.ray_address, site.master_addr) == ("http://10.0.0.1:8265", "10.0.0.2")
    with pytest.raises(ValueError, match=r"'v4rl-site-none': the Prefect Variable does not exist; create it with "
                                         r"`prefect variable set v4rl-site-none"):
        PipelineParams(**cluster, site_variable="v4rl-site-none").site()
    with pytest.raises(ValueError, match=r"has unknown keys \['ray_adress'\]"):
        PipelineParams(**cluster, site_variable="v4rl-site-typo").site()
