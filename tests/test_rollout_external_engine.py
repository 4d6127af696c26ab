"""The embedded server as an external SGLang engine: server info fields, memory release/resume, broadcast updates.

Pins (issue 27; all refused or absent before): (a) /get_server_info carries the single-node ServerArgs values
Miles' external-engine check compares (`enable_memory_saver`, `nnodes`, `node_rank`, `gpu_id_step`,
`base_gpu_id`); (b) /release_memory_occupation and /resume_memory_occupation answer as SGLang 0.5.23 (200, null
body), free the runtime weight copies with enable_memory_saver and restore bit-identical weights, refuse when
busy or with an unknown tag, and (issue 40) keep /health, /ready, every control route and /generate answering
within 2 s through each release/resume order Miles sends: a request while the weights are freed gets 503 at once,
one with them in place runs (kv_cache released or not, as in SGLang); (c) a separate trainer process broadcasts an
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

from engines.rollout.engine import EngineConfig, RolloutEngine
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


def test_release_frees_weights_and_resume_restores_them(served):
    engine = served.engine
    before, out_before = engine.checksums(), _generate(served.url)
    r = httpx.post(f"{served.url}/release_memory_occupation", json={"tags": None})
    assert (r.status_code, r.json()) == (200, None)
    assert sum(p.numel() for p in engine.model.parameters()) == 0  # the runtime copies are gone
    assert engine.status()["memory_released"] == ["cuda_graph", "kv_cache", "weights"]
    assert httpx.post(f"{served.url}/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
    assert httpx.post(f"{served.url}/resume_memory_occupation", json={}).status_code == 400  # weights: not released
    assert httpx.post(f"{served.url}/resume_memory_occupation", json={"tags": ["kv_cache", "cuda_graph"]}
                      ).status_code == 200
    assert _generate(served.url) == out_before
    assert engine.checksums() == before


# What Miles releases, then resumes step by step (engines/rollout/memory.py): null at start and engine recovery,
# --offload-rollout-level's tags each step (kv_cache, weight or both; cuda_graph always), weights resumed first.
MILES_ORDERS = {
    "null": (None, [["weights"], ["kv_cache", "cuda_graph"]]),
    "weights": (["cuda_graph", "weights"], [["weights"], ["cuda_graph"]]),
    "kv_cache": (["cuda_graph", "kv_cache"], [["kv_cache", "cuda_graph"]]),
    "both": (["cuda_graph", "kv_cache", "weights"], [["weights"], ["kv_cache", "cuda_graph"]]),
}
CONTROL = [("GET", "/server_info", None), ("GET", "/model_info", None), ("POST", "/flush_cache", None),
           ("POST", "/pause_generation", {"mode": "retract"}), ("POST", "/continue_generation", {}),
           ("POST", "/update_weight_version", {"new_version": "v"}), ("POST", "/abort_request", {"abort_all": True})]


def _answers_at_once(url: str, weights_freed: bool) -> None:
    """/health, /ready, every control route and /generate each answer within 2 s (a hang raises ReadTimeout)."""
    with httpx.Client(base_url=url, timeout=2.0) as c:
        for method, path, body in CONTROL:
            assert c.request(method, path, json=body).status_code == 200, path
        for path in ("/health", "/ready"):
            assert c.get(path).status_code == (503 if weights_freed else 200), path
        r = c.post("/generate", json={"input_ids": PROMPT, "sampling_params": {**SAMPLING, "max_new_tokens": 2}})
        if weights_freed:
            assert r.status_code == 503 and "resume_memory_occupation" in r.json()["error"]["message"]
        else:
            assert r.status_code == 200 and len(r.json()["output_ids"]) == 2


@pytest.mark.parametrize("memory_saver", [True, False], ids=["memory-saver", "no-memory-saver"])
def test_every_miles_release_resume_order_keeps_the_server_answering(served, tiny_checkpoint, memory_saver):
    """Issue 40: after release + resume of `weights` alone, /generate and /health hung (requests queued until
    kv_cache came back). Each order twice in a row, with R3 on as in the report; generation is bit-identical after."""
    server = served if memory_saver else RolloutServer(
        RolloutEngine(tiny_checkpoint, EngineConfig(enable_return_routed_experts=True))).start()
    try:
        expected = _generate(server.url)
        for name, (released, resumes) in [*MILES_ORDERS.items()] * 2:
            assert httpx.post(f"{server.url}/release_memory_occupation", json={"tags": released},
                              timeout=10).status_code == 200, name
            still = set(released or ["weights"])
            for tags in resumes:
                _answers_at_once(server.url, weights_freed=memory_saver and "weights" in still)
                assert httpx.post(f"{server.url}/resume_memory_occupation", json={"tags": tags},
                                  timeout=30).status_code == 200, (name, tags)
                still -= set(tags)
            assert server.engine.status()["memory_released"] == [], name
            assert _generate(server.url) == expected, name
    finally:
        if server is not served:
            server.stop()


def test_requests_queued_before_a_release_run_after_the_weights_resume(served):
    out_before = _generate(served.url)
    with ThreadPoolExecutor(1) as pool, SGLangClient(served.url, timeout=120) as c:
        c.pause_generation("retract")
        pending = pool.submit(_generate, served.url)
        while served.engine.status()["num_waiting_reqs"] == 0:
            time.sleep(0.05)
        assert httpx.post(f"{served.url}/release_memory_occupation", json={}).status_code == 200
        c.continue_generation()
        time.sleep(1.0)
        assert not pending.done()  # nothing computes on freed weights
        assert httpx.post(f"{served.url}/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
        assert pending.result(timeout=120) == out_before  # kv_cache still released: requests run as in SGLang
        assert httpx.post(f"{served.url}/resume_memory_occupation", json={}).status_code == 400
        assert httpx.post(f"{served.url}/resume_memory_occupation", json={"tags": ["kv_cache", "cuda_graph"]}
                          ).status_code == 200


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
