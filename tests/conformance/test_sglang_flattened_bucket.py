"""SGLang 0.5.23's `load_format: "flattened_bucket"` distributed update into `v4rl`'s rollout server (#27).

A separate process (sglang_flattened_sender.py) flattens each bucket with SGLang's own `FlattenedTensorBucket`
and broadcasts it as one uint8 tensor over gloo; afterwards the engine equals a fresh load of the export
(checksums of the stored FP8/FP4 state) and passes the fidelity gate, as after the tensor-by-tensor broadcast
(tests/test_rollout_external_engine.py). A bucket whose order leaves a tensor unaligned is refused with SGLang's
message, its bytes still received so the sender is not left blocked.

    .venv/bin/python -m pytest tests/conformance/test_sglang_flattened_bucket.py -q
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from engines.rollout.engine import RolloutEngine
from engines.rollout.fidelity import check_fidelity
from engines.rollout.server import RolloutServer
from engines.rollout.sglang import SGLangClient
from engines.upstream.sources import engine_python
from tests.conftest import write_noisy_copy

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@pytest.fixture(scope="module")
def noisy_export(tiny_checkpoint, tmp_path_factory) -> Path:
    return write_noisy_copy(tiny_checkpoint, tmp_path_factory.mktemp("flat") / "step-1", seed=8)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _send(sglang_paths, url: str, export: Path, out: Path, *extra: str) -> dict:
    code = (f"import runpy, sys; sys.argv = ['h', *sys.argv[1:]]; "
            f"runpy.run_path({str(HERE / 'sglang_flattened_sender.py')!r}, run_name='__main__')")
    engine_python(code, [REPO, *sglang_paths], args=[url, str(export), str(_free_port()), str(out), *extra],
                  env={"PYTHONPATH": str(REPO)}, timeout=600)
    return json.loads(out.read_text())


def test_flattened_buckets_equal_a_fresh_load(sglang_paths, tiny_checkpoint, noisy_export, tmp_path):
    with RolloutServer(RolloutEngine(tiny_checkpoint)) as server:
        result = _send(sglang_paths, server.url, noisy_export, tmp_path / "flat.json")
        assert result["buckets"] > 1 and len(result["answers"]) == result["buckets"], result
        assert all(a["success"] for a in result["answers"]), result["answers"]
        assert "torch.float8_e4m3fn" in result["dtypes"]  # float8 went as its bytes under its own dtype name
        with SGLangClient(server.url, timeout=120) as c:
            assert c.model_info()["weight_version"] == "flat-1"
            report = check_fidelity(c, noisy_export)
        assert report.ok and report.logprob_positions > 0
        fresh = RolloutEngine(noisy_export)
        try:
            assert server.engine.checksums() == fresh.checksums()
        finally:
            fresh.shutdown()


def test_an_unaligned_flattened_bucket_is_refused(sglang_paths, tiny_checkpoint, noisy_export, tmp_path):
    with RolloutServer(RolloutEngine(tiny_checkpoint)) as server:
        before = server.engine.checksums()
        result = _send(sglang_paths, server.url, noisy_export, tmp_path / "flat.json", "misalign")
        first = result["answers"][0]
        assert first["success"] is False and "Unaligned received tensor" in first["message"], first
        assert server.engine.status()["num_running_reqs"] == 0
        assert server.engine.checksums() == before  # nothing of the refused bucket was applied
