"""The embedded server answers as SGLang 0.5.23 does where v4rl used to differ (reference/conformance.md B3-B19).

Each test names its finding. These run without SGLang's source; tests/conformance/ then holds the same
requests against SGLang's own app, clients and schema. A server with a short context (80 tokens) keeps
"no max_new_tokens" runs short.

    .venv/bin/python -m pytest tests/test_rollout_sglang_semantics.py -q
"""

from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from engines.rollout.engine import EngineConfig, RolloutEngine
from engines.rollout.protocol import SAMPLING_FIELDS
from engines.rollout.server import OUTSIDE_SESSION, RolloutServer
from engines.rollout.sglang import SGLangClient, SGLangHTTPError

CONTEXT = 80
PROMPT = [0] + [5 + (3 * k) % 90 for k in range(30)]


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    engine = RolloutEngine(tiny_checkpoint, EngineConfig(context_length=CONTEXT))
    with RolloutServer(engine) as server, SGLangClient(server.url, timeout=60) as client:
        yield server, client


def _post(server, path: str, body=None, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, **kw)


def _gen(client, **fields):
    return client.generate({"input_ids": PROMPT, **fields})


def _long_request(client, seed: int):
    """A request still decoding when the caller acts on it (returns its future)."""
    pool = ThreadPoolExecutor(1)
    before = client.server_info()["internal_states"][0]["generated_tokens"]
    fut = pool.submit(_gen, client, sampling_params={"max_new_tokens": 45, "ignore_eos": True, "sampling_seed": seed})
    deadline = time.monotonic() + 30
    while client.server_info()["internal_states"][0]["generated_tokens"] < before + 3:
        assert time.monotonic() < deadline, "the long request never started decoding"
        time.sleep(0.02)
    pool.shutdown(wait=False)
    return fut


def test_b3_empty_values_mean_unset(served):
    """SGLang's own RuntimeEndpoint sends stop_regex: [] with every sgl.gen; "" / [] / {} are "unset"."""
    _, client = served
    base = {"max_new_tokens": 4, "ignore_eos": True, "sampling_seed": 3}
    want = _gen(client, sampling_params=base)["output_ids"]
    unset = {"stop_regex": [], "logit_bias": {}, "regex": "", "json_schema": "", "ebnf": "", "structural_tag": "",
             "custom_params": {}, "choice": [], "beam_width": None, "watermark": None, "min_p": 0.0}
    assert _gen(client, sampling_params={**base, **unset})["output_ids"] == want
    for key, value in (("stop_regex", ["\\d"]), ("stop_regex", ""), ("regex", "[0-9]+"), ("logit_bias", {"5": 1.0})):
        with pytest.raises(SGLangHTTPError, match=f"sampling_params.{key}="):
            _gen(client, sampling_params={**base, key: value})


def test_b4_null_sampling_values_are_defaults(served):
    _, client = served
    nulls = {k: None for k in ("temperature", "top_p", "top_k", "min_new_tokens", "ignore_eos", "n", "stop",
                               "stop_token_ids", "skip_special_tokens", "no_stop_trim")}
    base = {"max_new_tokens": 5, "sampling_seed": 11}
    assert _gen(client, sampling_params={**base, **nulls})["output_ids"] == _gen(client, sampling_params=base)[
        "output_ids"]
    unlimited = _gen(client, sampling_params={"max_new_tokens": None, "ignore_eos": True, "temperature": 0})
    # SGLang's scheduler caps the output at max_req_len - prompt - 1 = context - prompt - 2 (limits.py)
    assert unlimited["meta_info"]["finish_reason"] == {"type": "length", "length": CONTEXT - len(PROMPT) - 2}
    assert _gen(client, sampling_params={"top_k": 1 << 30, **base})["output_ids"] == _gen(
        client, sampling_params=base)["output_ids"]  # SGLang's "whole vocabulary"


def test_b5_a_string_rid_names_the_samples_of_a_batch(served):
    _, client = served
    body = client.generate({"input_ids": [PROMPT, PROMPT[:-1]], "rid": "job", "sampling_params": {"max_new_tokens": 1}})
    assert [x["meta_info"]["id"] for x in body] == ["job_0", "job_1"]
    grouped = client.generate({"input_ids": [PROMPT], "rid": "g", "sampling_params": {"max_new_tokens": 1, "n": 2}})
    assert [x["meta_info"]["id"] for x in grouped] == ["g_0", "g_1"]
    with pytest.raises(SGLangHTTPError, match="rids length mismatch"):
        client.generate({"input_ids": [PROMPT, PROMPT], "rid": ["a"], "sampling_params": {"max_new_tokens": 1}})


def test_b6_list_logprob_options_are_refused_with_n(served):
    _, client = served
    for name, value in (("return_logprob", [True]), ("logprob_start_len", [0]), ("top_logprobs_num", [1])):
        with pytest.raises(SGLangHTTPError, match=f"Cannot use list {name} with parallel_sample_num > 1"):
            client.generate({"input_ids": [PROMPT], name: value, "sampling_params": {"max_new_tokens": 1, "n": 2}})
    with pytest.raises(SGLangHTTPError, match="parallel_sample_num should be the same"):
        client.generate({"input_ids": [PROMPT, PROMPT], "sampling_params": [{"n": 2}, {"n": 1}]})


def test_b7_reasoning_tokens_and_weight_version_spans(served):
    """Without a reasoning parser SGLang counts 0 reasoning tokens; an update mid-request splits the spans."""
    _, client = served
    meta = _gen(client, sampling_params={"max_new_tokens": 3})["meta_info"]
    assert meta["reasoning_tokens"] == 0 and meta["weight_versions"][0]["start"] == 0
    before = client.model_info()["weight_version"]
    fut = _long_request(client, seed=5)
    client.pause_generation("in_place")
    try:
        client.update_weight_version("v-next", abort_all_requests=False)
    finally:
        client.continue_generation()
    meta = fut.result(60)["meta_info"]
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == [before, "v-next"] and meta["weight_version"] == "v-next"
    assert spans[0]["start"] == 0 and 0 < spans[0]["end"] == spans[1]["start"] < 45
    assert spans[1]["end"] == meta["completion_tokens"] == 45
    client.update_weight_version(before)


def test_b8_logprob_start_len(served):
    _, client = served
    n = len(PROMPT)
    for start in (-1, n):
        meta = _gen(client, return_logprob=True, logprob_start_len=start,  # EOS could end it after one token
                    sampling_params={"max_new_tokens": 2, "ignore_eos": True})["meta_info"]
        assert meta["input_token_logprobs"] == [] and len(meta["output_token_logprobs"]) == 2
    meta = _gen(client, return_logprob=True, logprob_start_len=n - 1,
                sampling_params={"max_new_tokens": 0})["meta_info"]
    assert meta["input_token_logprobs"] == [[None, PROMPT[-1], None]]
    with pytest.raises(SGLangHTTPError, match="higher than the number of input tokens"):
        _gen(client, return_logprob=True, logprob_start_len=n + 1)
    assert "input_token_logprobs" not in _gen(client, logprob_start_len=n + 5,
                                              sampling_params={"max_new_tokens": 1})["meta_info"]  # ignored


def test_b9_unknown_sampling_key_has_sglangs_contract_body(served):
    server, _ = served
    r = _post(server, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_tokens": 5}})
    listed = ", ".join(f"`{f}`" for f in SAMPLING_FIELDS)
    assert r.status_code == 400 and r.json() == {"error": f"unknown field `max_tokens`, expected one of {listed}"}


def test_b10_b11_info_fields_and_model_path_moving(served, tmp_path, tiny_checkpoint):
    server, client = served
    info = client.model_info()
    assert {"served_model_name", "load_format", "reasoning_parser", "tool_call_parser", "disaggregation_mode",
            "has_image_understanding", "has_audio_understanding"} <= set(info)
    assert info["model_path"] == info["served_model_name"] == str(tiny_checkpoint)
    moved = shutil.copytree(tiny_checkpoint, tmp_path / "step-1")
    assert client.update_weights_from_disk(str(moved), weight_version="1")["success"]
    info = client.model_info()
    assert info["model_path"] == info["served_model_name"] == str(moved) and info["weight_version"] == "1"
    server_info = client.server_info()
    assert server_info["model_path"] == str(tiny_checkpoint)  # /server_info keeps the startup configuration
    assert server_info["version"] == "0.5.23" and server_info["startup_time"]["load_weight"] > 0
    assert server_info["context_length"] == CONTEXT and server_info["v4rl"]["backend"] == "v4rl-embedded"
    client.update_weight_version("default")


def test_b12_b13_b14_health_probes_generation_and_ready(served, monkeypatch):
    server, client = served
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{server.url}/ready", timeout=30).status_code == 200
    assert httpx.get(f"{server.url}/get_weight_version", timeout=30).status_code == 404  # not in SGLang 0.5.23
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "1")
    client.pause_generation("retract")
    try:
        started = time.monotonic()
        assert httpx.get(f"{server.url}/health_generate", timeout=30).status_code == 503
        assert time.monotonic() - started >= 1.0
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 503
        assert httpx.get(f"{server.url}/ready", timeout=30).status_code == 503
        monkeypatch.setenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "0")
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200  # liveness only
    finally:
        client.continue_generation()
    assert client.server_info()["internal_states"][0]["num_waiting_reqs"] == 0  # the probes were aborted
    assert httpx.get(f"{server.url}/health_generate", timeout=30).status_code == 200


def test_b15_weights_checker_actions(served, tiny_checkpoint):
    server, client = served
    got = httpx.get(f"{server.url}/weights_checker", timeout=60).json()  # GET, no body: checksum
    rank = got["ranks"][0]
    assert got["success"] and set(rank) == {"checksums", "per_gpu_checksum", "parallelism_info"}
    assert rank["parallelism_info"][0]["tp_size"] == 1 and len(got["per_engine_checksum"]) == 64
    def check(action: str, **extra) -> httpx.Response:
        return _post(server, "/weights_checker", {"action": action, **extra})

    assert check("snapshot").json()["success"]
    assert check("reset_tensors", skip_tensor_list=["tid2eid"]).json()["success"]
    compared = check("compare")  # reset broke every tensor a rebuild writes, tid2eid left out
    assert compared.status_code == 400 and "differ from the snapshot" in compared.json()["message"]
    assert "tid2eid" not in compared.json()["message"]
    assert client.update_weights_from_disk(str(tiny_checkpoint))["success"]
    assert check("snapshot").json()["success"]
    assert check("reset_tensors").json()["success"]
    assert client.update_weights_from_disk(str(tiny_checkpoint))["success"]  # an update rewrites them all
    compared = check("compare")
    assert compared.status_code == 200 and compared.json()["message"].startswith("All ")
    assert client.weights_checksums() == rank["checksums"]
    assert _post(server, "/weights_checker", {"action": "compare"}).json()["message"].startswith("no snapshot")
    assert "Unsupported action" in _post(server, "/weights_checker", {"action": "dump"}).json()["message"]


def test_b16_flush_timeout_and_required_bodies(served):
    server, client = served
    # Under load the 45-token request can finish between "it decodes" and the flush arriving; a flush that then
    # succeeds is right only if the request had finished, so the refusal is retried on a fresh request.
    refused = False
    for seed in range(9, 14):
        fut = _long_request(client, seed=seed)
        status = _post(server, "/flush_cache").status_code
        assert status in (200, 400), status
        if status == 200:  # no request held KV: it had finished all its 45 tokens
            assert fut.result(30)["meta_info"]["finish_reason"]["type"] == "length"
            continue
        refused = True  # a request holds KV
        client.flush_cache(wait_s=60)  # waits for it to finish, then flushes
        assert fut.result(30)["meta_info"]["finish_reason"]["type"] == "length"
        break
    assert refused, "the flush never met a running request in 5 tries"
    assert client.server_info()["internal_states"][0]["prefix_cache_entries"] == 0
    for path in ("/pause_generation", "/continue_generation", "/abort_request", "/begin_weight_update",
                 "/end_weight_update", "/update_weights_from_disk", "/update_weight_version"):
        r = httpx.post(f"{server.url}{path}", timeout=30)
        assert r.status_code == 400 and r.json()["object"] == "error" and r.json()["code"] == 400, path
    r = _post(server, "/pause_generation", {"mode": "freeze"})
    assert r.status_code == 400 and "mode" in r.json()["message"]


def test_b17_distributed_updates_only_inside_a_session(served):
    _, client = served
    with pytest.raises(SGLangHTTPError, match="must run between"):
        client.update_weights_from_distributed(names=["x"], dtypes=["bfloat16"], shapes=[[1]])
    assert OUTSIDE_SESSION.startswith("update_weights_from_distributed must run between")
    client.begin_weight_update()
    try:
        with pytest.raises(SGLangHTTPError, match="call `init_weights_update_group` first"):
            client.update_weights_from_distributed(names=["x"], dtypes=["bfloat16"], shapes=[[1]])
    finally:
        client.end_weight_update()


def test_b19_bearer_scheme_is_case_insensitive(tiny_checkpoint):
    with RolloutServer(RolloutEngine(tiny_checkpoint), api_key="k") as server:
        def status(header: str) -> int:
            return httpx.get(f"{server.url}/model_info", headers={"Authorization": header}, timeout=30).status_code

        assert [status(h) for h in ("Bearer k", "bearer k", "BEARER k", "Basic k", "Bearer K")] == [200] * 3 + [401] * 2
        assert httpx.get(f"{server.url}/ready", timeout=30).status_code == 200  # exempt, as /health*


def test_b7_weight_version_spans_as_sglang_counts_them():
    from engines.rollout.api import weight_version_spans

    assert weight_version_spans([], "a", 0) == [{"version": "a", "start": 0, "end": 0}]
    assert weight_version_spans([("a", 3)], "b", 5) == [{"version": "a", "start": 0, "end": 3},
                                                        {"version": "b", "start": 3, "end": 5}]
    assert weight_version_spans([("a", 3)], "b", 3) == [{"version": "a", "start": 0, "end": 3}]  # nothing under b
    assert weight_version_spans([("a", 2), ("b", 2), ("c", 4)], "a", 6) == [
        {"version": "a", "start": 0, "end": 2}, {"version": "c", "start": 2, "end": 4},
        {"version": "a", "start": 4, "end": 6}]
