"""v4rl's model flags from config.json equal Miles' own model scripts, token for token.

Miles' `miles.utils.external_utils.model_args_utils.load_model_args` (what its launchers splice into the
`train.py` argv) runs in a subprocess on the pinned Miles tree of each DeepSeek-V4 generation (31f1ca961,
e9e19b223); v4rl's `model_args` reads the Flash config.json (release format). Also the 4-layer prune Miles
smoke-tests with. About 5 s per generation.

    .venv/bin/python -m pytest tests/conformance/test_miles_model_args.py -q
"""

from __future__ import annotations

import json

import pytest

from engines.presets.flash import flash_config
from engines.upstream.sources import engine_python
from engines.miles import model_args


def _miles_model_args(miles_tree, model_type: str) -> list[str]:
    code = f"""
import json
from miles.utils.external_utils.model_args_utils import load_model_args
print(json.dumps(load_model_args({model_type!r}).split()))
"""
    done = engine_python(code, [miles_tree], stub_roots=(), env={"MODEL_ARGS_NUM_LAYERS": "", "ROTARY_SCALING_FACTOR": ""})
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model_type, config", [
    ("deepseek-v4-flash", flash_config()),
    ("deepseek-v4-flash-4layer", flash_config() | {"num_hidden_layers": 4, "compress_ratios": [0, 0, 4, 128]}),
])
def test_model_flags_equal_miles_model_script(miles_tree, model_type, config):
    theirs = _miles_model_args(miles_tree, model_type)
    ours = model_args(config)
    assert len(theirs) > 100 and ours == theirs, _first_difference(ours, theirs)


@pytest.mark.parametrize("model_type, config", [
    ("deepseek-v4-flash", flash_config()),
    ("deepseek-v4-flash-4layer", flash_config() | {"num_hidden_layers": 4, "compress_ratios": [0, 0, 4, 128]}),
])
def test_model_flags_equal_second_generation_model_script(miles_gen2_tree, model_type, config):
    """Miles e9e19b223's model script drops --experimental-attention-variant (normalize_dsv4_args sets it from
    --dsv4-impl); v4rl's generation-2 flags follow it token for token."""
    theirs = _miles_model_args(miles_gen2_tree, model_type)
    ours = model_args(config, generation=2)
    assert len(theirs) > 100 and ours == theirs, _first_difference(ours, theirs)
    assert "--experimental-attention-variant" not in theirs
    assert "--experimental-attention-variant" in model_args(config, generation=1)


def _first_difference(ours: list[str], theirs: list[str]) -> str:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return f"token {i}: ours {a!r}, Miles {b!r} (after {' '.join(ours[max(0, i - 3):i])})"
    return f"ours has {len(ours)} tokens, Miles {len(theirs)}"
