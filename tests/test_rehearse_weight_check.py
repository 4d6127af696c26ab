"""The weight check of `v4rl rehearse --stage full` (engines/upstream/rehearsal/weight_check.py), without Miles: a recorded
broadcast whose export equals what the engine holds passes; one tensor changed in the export fails naming it.

    .venv/bin/python -m pytest tests/test_rehearse_weight_check.py -q
"""

from __future__ import annotations

import json

import pytest
import torch

from engines.upstream.rehearsal.weight_check import check_broadcasts, export_checksums, first_differing, \
    first_differing_tensor


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from engines.upstream.rehearsal.tiny_model import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "hf")


def _record(folder, version, sent, engine_checksums):
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(sent, str(folder / f"broadcast-v{version}.safetensors"))
    (folder / f"broadcast-v{version}.json").write_text(json.dumps(
        {"version": version, "tensors": f"broadcast-v{version}.safetensors", "engine_checksums": engine_checksums}))


def _stored(hf):
    from safetensors import safe_open

    out = {}
    for shard in hf.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def test_an_export_the_engine_holds_passes_and_a_changed_tensor_is_named(tiny, tmp_path):
    live = export_checksums(tiny)  # what an engine that loaded the checkpoint holds
    stored = _stored(tiny)
    name = next(n for n in sorted(stored) if n.endswith("ffn.gate.weight"))
    sglang_name = f"model.layers.{name.split('.')[1]}.mlp.gate.weight"  # the name Miles sends it under
    changed = {sglang_name: stored[name] * 2}
    _record(tmp_path / "b", 1, {n: stored[n] for n in list(stored)[:5]}, live)
    _record(tmp_path / "b", 2, changed, live)  # the actor exported a gate the engine does not hold
    first, second = check_broadcasts(tmp_path / "b", tiny)
    assert first == {"version": 1, "tensors_sent": 5, "ok": True, "first_differing": None}
    layer = name.split(".")[1]
    assert not second["ok"] and second["first_differing"].startswith(f"layers.{layer}.") and \
        "gate" in second["first_differing"], second


def test_first_differing_names_a_tensor_only_one_side_has():
    assert first_differing({"a": "1", "b": "2"}, {"a": "1", "b": "2"}) is None
    assert first_differing({"a": "1", "b": "2"}, {"a": "1", "b": "3"}) == "b"
    assert first_differing({"a": "1"}, {"a": "1", "c": "3"}) == "c (only in the engine)"


def test_two_recorded_exports_compare_by_value_float8_included(tmp_path):
    from safetensors.torch import save_file

    base = {"w": torch.randn(4, 4).to(torch.float8_e4m3fn), "s": torch.ones(2)}
    save_file(base, str(tmp_path / "a.safetensors"))
    save_file({**base, "s": torch.full((2,), 2.0)}, str(tmp_path / "b.safetensors"))
    assert first_differing_tensor(tmp_path / "a.safetensors", tmp_path / "a.safetensors") is None
    assert first_differing_tensor(tmp_path / "a.safetensors", tmp_path / "b.safetensors") == "s"
