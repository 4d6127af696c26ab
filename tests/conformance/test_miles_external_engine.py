"""Miles' own external-engine code against `v4rl`'s rollout server, both vendored generations (issue 27).

Miles' `SGLangEngine.init` with `--rollout-external` (its `_init_external` sanity check of /get_server_info
against the ServerArgs Miles computed), then Miles' `connect_rollout_engines_from_distributed` and
`update_weights_from_distributed` broadcasting an export's tensors from a separate process over gloo into the
engine: afterwards the engine equals a fresh load of that export. How Miles is run: miles_external_harness.py.

    .venv/bin/python -m pytest tests/conformance/test_miles_external_engine.py -q
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from engines.upstream.sources import engine_python
from engines.rollout.engine import RolloutEngine
from engines.rollout.server import RolloutServer
from tests.conftest import write_noisy_copy

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@pytest.fixture(scope="module")
def noisy_export(tiny_checkpoint, tmp_path_factory) -> Path:
    return write_noisy_copy(tiny_checkpoint, tmp_path_factory.mktemp("miles-bcast") / "step-1", seed=4)


@pytest.mark.parametrize("generation", ["miles_tree", "miles_gen2_tree"])
def test_miles_external_engine_check_and_broadcast(generation, request, sglang_paths, tiny_checkpoint,
                                                   noisy_export, tmp_path):
    miles = request.getfixturevalue(generation)
    out = tmp_path / "miles.json"
    code = (f"import runpy, sys; sys.argv = ['h', *sys.argv[1:]]; "
            f"runpy.run_path({str(HERE / 'miles_external_harness.py')!r}, run_name='__main__')")
    with RolloutServer(RolloutEngine(tiny_checkpoint)) as server:
        engine_python(code, [REPO, miles, *sglang_paths], args=[server.url, str(noisy_export), str(out)],
                      env={"PYTHONPATH": os.pathsep.join([str(REPO), str(miles)])}, timeout=900)
        result = json.loads(out.read_text())
        assert result["sanity_check"] == "passed" and result["buckets"] > 1
        assert all(a["success"] for a in result["answers"]), result["answers"]
        assert result["weight_version"] == "1"
        fresh = RolloutEngine(noisy_export)
        try:
            assert server.engine.checksums() == fresh.checksums()
        finally:
            fresh.shutdown()
