"""The preflight's model check: the user's Miles model, built on the meta device, against the checkpoint the
pipeline hands over (engines/upstream/miles_model_check.py `check_model_keys`, called by `v4rl plan --miles-dir` and
the rl-pipeline preflight on a cluster preset). Each build parses the job's model flags with Miles' own parser
and builds the whole model on the meta device: 2-4 minutes on 2 cores, so every test here is `slow`.

    .venv/bin/python -m pytest tests/conformance/test_miles_model_preflight.py -q -m slow
"""

from __future__ import annotations

import json

import pytest

from engines.presets.flash import flash_config
from engines.upstream.miles_model_check import check_model_keys

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("generation,keys", [(1, 1242), (2, 1414)])
def test_flash_on_the_meta_device_asks_for_what_v4rl_writes(generation, keys, request, sglang_paths):
    trees = (("miles_tree", "megatron_tree") if generation == 1 else ("miles_gen2_tree", "megatron_gen2_tree"))
    miles, megatron = (request.getfixturevalue(t) for t in trees)
    check = check_model_keys(flash_config(), miles_dir=miles, megatron_dir=megatron)
    assert check.ok, check.summary()
    assert (check.generation, check.model_keys) == (generation, keys)
    if generation == 1:
        assert check.parameters == 284_334_557_271  # conformance C1


def test_a_checkpoint_of_the_other_generation_stops_the_run_naming_keys_and_fix(tmp_path, miles_gen2_tree,
                                                                               megatron_gen2_tree, sglang_paths):
    """A plugin-named (generation 1) checkpoint handed to a generation-2 Miles: missing keys named, the fix given."""
    from checkpoints.convert import convert_hf_to_torch_dist
    from miles_model_harness import make_hf_checkpoint, tiny_miles_config

    hf = make_hf_checkpoint(tmp_path / "hf", tiny_miles_config())
    ckpt = tmp_path / "torch_dist-plugin"
    convert_hf_to_torch_dist(hf, ckpt, workers=1, megatron_names="plugin")
    check = check_model_keys(json.loads((hf / "config.json").read_text()), ckpt=ckpt, miles_dir=miles_gen2_tree,
                             megatron_dir=megatron_gen2_tree)
    assert not check.ok
    summary = check.summary()
    assert "decoder.layers.0.self_attention_hyper_connection.alpha_pre" in summary
    assert "will skip" in summary and f"v4rl convert SRC DST --miles-dir {miles_gen2_tree}" in summary
