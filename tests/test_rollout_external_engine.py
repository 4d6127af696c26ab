"""The embedded server as an external SGLang engine: server info fields, memory release/resume, broadcast updates.

Pins (issue 27; all refused or absent before): (a) /get_server_info carries the single-node ServerArgs values
Miles' external-engine check compares (`enable_memory_saver`, `nnodes`, `node_rank`, `gpu_id_step`,
`base_gpu_id`); (b) /release_memory_occupation and /resume_memory_occupation answer as SGLang 0.5.23 (200, null
body), free the runtime weight copies with enable_memory_saver, hold generation while released and restore
bit-identical weights, refuse when busy or with an unknown tag; (c) a separate trainer process broadcasts an
export's FP8/FP4 tensors over gloo (SGLang's init / begin / buckets / end / destroy) and the engine then equals a
fresh engine on that export, fidelity gate included; a bucket that splits a fused pair is refused.

    .venv/bin/python -m pytest tests/test_rollout_external_engine.py -q
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from engines.rollout.engine import RolloutEngine
from engines.rollout.fidelity import check_fidelity
from engines.rollout.server import RolloutServer
from engines.rollout.sglang import SGLangClient
from tests.conftest import write_noisy_copy

PROMPT = [0] + [5 + 7 * k % 90 for k in range(20)]
SAMPLING = {"max_new_tokens": 6, "ignore_eos": True, "temperature": 0}
SENDER = Path(__file__).with_name("broadcast_sender.py")


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    with RolloutServer(RolloutEngine(tiny_checkpoint), enable_memory_saver=True) as server:
        yield server


@pytest.fixture(scope="module")
def noisy_export(tiny_checkpoint, tmp_path_factory) -> Path:
    """The served weights plus 2% noise (tid2eid kept), as an FP8/FP4 export."""
    return write_noisy_copy(tiny_checkpoint, tmp_path_factory.mktemp("bcast") / "step-1", seed=3)


def _generate(url: str) -> list[int]:
    with SGLangClient(url, timeout=120) as c:
        return c.generate({"input_ids": PROMPT, "sampling_params": SAMPLING})["output_ids"]


def test_server_info_has_the_fields_miles_checks_for_an_external_engine(served):
    info = httpx.get(f"{served.url}/get_server_info").json()
    assert {k: info[k] for k in ("enable_memory_saver", "nnodes", "node_rank", "gpu_id_step", "base_gpu_id",
                                 "tp_size", "dp_size", "pp_size", "ep_size", "host", "port")} == {
        "enable_memory_saver": True, "nnodes": 1, "node_rank": 0, "gpu_id_step": 1, "base_gpu_id": 0,
        "tp_size": 1, "dp_size": 1, "pp_size": 1, "ep_size": 1, "host": "127.0.0.1", "port": served.port}


def test_release_frees_weights_holds_generation_and_resume_restores_them(served):
    engine = served.engine
    before, out_before = engine.checksums(), _generate(served.url)
    r = httpx.post(f"{served.url}/release_memory_occupation", json={"tags": None})
    assert (r.status_code, r.json()) == (200, None)
    assert sum(p.numel() for p in engine.model.parameters()) == 0  # the runtime copies are gone
    assert engine.status()["memory_released"] == ["cuda_graph", "kv_cache", "weights"]
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_generate, served.url)
        time.sleep(1.5)
        assert not pending.done()  # queued while released, as nothing may compute with freed memory
        r = httpx.post(f"{served.url}/resume_memory_occupation", json={"tags": ["weights"]})
        assert (r.status_code, r.json()) == (200, None)
        time.sleep(0.5)
        assert not pending.done()  # kv_cache still released
        assert httpx.post(f"{served.url}/resume_memory_occupation", json={}).status_code == 400  # weights: not released
        assert httpx.post(f"{served.url}/resume_memory_occupation", json={"tags": ["kv_cache", "cuda_graph"]}
                          ).status_code == 200
        assert pending.result(timeout=120) == out_before
    assert engine.checksums() == before


def test_release_is_refused_while_busy_or_with_an_unknown_tag(served):
    r = httpx.post(f"{served.url}/release_memory_occupation", json={"tags": ["weights", "optimizer"]})
    assert r.status_code == 400 and "['optimizer']" in r.json()["error"]["message"]
    with ThreadPoolExecutor(1) as pool, SGLangClient(served.url, timeout=120) as c:
        long = pool.submit(c.generate, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 400,
                                                                                "ignore_eos": True}})
        while served.engine.status()["num_running_reqs"] == 0:
            time.sleep(0.05)
        c.pause_generation("in_place")
        r = httpx.post(f"{served.url}/release_memory_occupation", json={"tags": ["kv_cache"]})
        assert r.status_code == 400 and "idle" in r.json()["error"]["message"]
        c.continue_generation()
        long.result(timeout=300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _send(url: str, export: Path, bucket_bytes: int, version: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    return subprocess.run([sys.executable, str(SENDER), url, str(export), str(_free_port()), str(bucket_bytes),
                           version], capture_output=True, text=True, env=env, timeout=600)


def test_a_gloo_broadcast_from_a_trainer_process_equals_a_fresh_load(tiny_checkpoint, noisy_export):
    with RolloutServer(RolloutEngine(tiny_checkpoint)) as server:
        done = _send(server.url, noisy_export, 200_000, "step-1")  # many buckets: scales and weights split apart
        assert done.returncode == 0, done.stderr[-3000:]
        with SGLangClient(server.url, timeout=120) as c:
            assert c.model_info()["weight_version"] == "step-1"
            report = check_fidelity(c, noisy_export)  # raises FidelityError naming what differs
        assert report.ok and report.logprob_positions > 0
        fresh = RolloutEngine(noisy_export)
        try:
            assert server.engine.checksums() == fresh.checksums()
        finally:
            fresh.shutdown()
