"""PipelineParams: fields left out of a partial `params` object take the named preset's values.

`prefect deployment run -p params='{...}'` replaces the deployment's whole params object, so a user's
`{"preset": "dsv4-flash-mi355x", "ray_address": ...}` must be the seed's run, not tiny-cpu's defaults.
"""

from __future__ import annotations

import pytest

from flows.params import PRESET_PARAMS, PipelineParams


@pytest.mark.parametrize("spelling", ["dsv4-flash-mi355x", "dsv4_flash_mi355x", "DSV4-FLASH-MI355X"])
def test_partial_cluster_params_take_the_presets_values(spelling):
    p = PipelineParams.model_validate({"preset": spelling, "ray_address": "http://127.0.0.1:8265", "steps": 100})
    assert p.preset == "dsv4-flash-mi355x" and p.run_key == "dsv4-flash-mi355x"
    assert p.steps == 100  # given
    for name, value in PRESET_PARAMS["dsv4-flash-mi355x"].items():
        if name != "steps":
            assert getattr(p, name) == value, name
    assert p.lr == 1e-6 and p.prompts_per_step == 32


def test_tiny_cpu_and_preset_defaults_are_unchanged():
    tiny = PipelineParams.model_validate({"steps": 3, "eval_interval": 1})
    assert (tiny.preset, tiny.run_key, tiny.lr, tiny.prompts_per_step) == ("tiny-cpu", "tiny-cpu", 1e-4, 128)
    miles_32 = PipelineParams.preset_defaults("dsv4-flash-mi355x-32gpu", run_key="mine")
    assert (miles_32.run_key, miles_32.steps, miles_32.lr) == ("mine", 3000, 1e-6)  # Miles' launcher: 3000 rollouts
    assert PipelineParams.preset_defaults("dsv4-flash-mi355x").steps == 200  # the seed's run
    assert PipelineParams.preset_defaults("dsv4-flash-mi355x") == PipelineParams(preset="dsv4-flash-mi355x")


def test_an_unknown_preset_is_still_named():
    with pytest.raises(ValueError, match="preset"):
        PipelineParams.model_validate({"preset": "dsv5-huge"})
