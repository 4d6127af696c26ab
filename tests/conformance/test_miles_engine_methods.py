"""Every HTTP method of Miles' `SGLangEngine` against `v4rl`'s rollout server as an external engine, both vendored
generations (#27). The broadcast test (test_miles_external_engine.py) calls init/_init_external,
pause_generation, flush_cache, begin/end_weight_update, init/destroy_weights_update_group,
update_weights_from_distributed, continue_generation and get_weight_version; this one calls every other method
(miles_engine_methods_harness.py lists them). Served methods do what SGLang's do; a method whose capability
the CPU engine lacks is refused with a 4xx at once (never a hang, never a 2xx that did nothing).
`shutdown` talks only to Miles' router (it deregisters the worker), so it has no engine side to check.

    .venv/bin/python -m pytest tests/conformance/test_miles_engine_methods.py -q
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from engines.rollout.engine import RolloutEngine
from engines.rollout.server import RolloutServer
from engines.upstream.sources import engine_python
from tests.conftest import write_noisy_copy

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@pytest.fixture(scope="module")
def noisy_export(tiny_checkpoint, tmp_path_factory) -> Path:
    return write_noisy_copy(tiny_checkpoint, tmp_path_factory.mktemp("miles-methods") / "step-1", seed=6)


@pytest.mark.parametrize("generation", ["miles_tree", "miles_gen2_tree"])
def test_every_sglang_engine_method(generation, request, sglang_paths, tiny_checkpoint, noisy_export, tmp_path):
    miles = request.getfixturevalue(generation)
    out = tmp_path / "methods.json"
    code = (f"import runpy, sys; sys.argv = ['h', *sys.argv[1:]]; "
            f"runpy.run_path({str(HERE / 'miles_engine_methods_harness.py')!r}, run_name='__main__')")
    with RolloutServer(RolloutEngine(tiny_checkpoint)) as server:
        engine_python(code, [REPO, miles, *sglang_paths], args=[server.url, str(noisy_export), str(out)],
                      env={"PYTHONPATH": os.pathsep.join([str(REPO), str(miles)])}, timeout=900)
        result = json.loads(out.read_text())
        fresh = RolloutEngine(noisy_export)
        try:  # the disk update Miles asked for loaded the export
            assert server.engine.checksums() == fresh.checksums()
        finally:
            fresh.shutdown()
    served, refused = result["served"], result["refused"]
    assert served["health_generate"] is True and served["health_after"] is True
    assert served["server_info"]["enable_memory_saver"] is False and served["server_info"]["tp_size"] == 1
    assert all(a["success"] for a in served["check_weights"]), served["check_weights"]
    assert served["reset_tensors"]["success"]
    assert served["update_weights_from_disk"]["success"] and served["version_after_disk"] == "3"
    assert served["update_weight_version"]["success"] and served["version_after_set"] == "5"
    # SGLang 0.5.23 answers both with 200 and a null body; with enable_memory_saver off weights stay (its no-op)
    assert served["release"] is None and served["released"] == ["cuda_graph", "kv_cache", "weights"], served
    assert served["resume"] is None and served["released_after_resume"] == [], served
    for mode in ("abort", "retract", "in_place"):
        assert served["pause_modes"][mode] == 200 and served["pause_modes"][mode + "/paused"] is True
    assert served["simulate_crash"] == "None"
    for name, outcome in refused.items():
        assert outcome["status"] is not None and 400 <= outcome["status"] < 500, (name, outcome)
        assert outcome["seconds"] < 5, (name, outcome)
