"""The embedded rollout server over real HTTP on 127.0.0.1 (in-thread uvicorn on a free port; one test
starts `v4rl serve-rollout` as a subprocess).

Pins: SGLang's response shapes; same seed, same output; returned logprobs equal our full-sequence
scoring of the same tokens (fp32: 1e-5; bf16: equal to its own scoring, and within the stated bound of
fp32 scoring); stop / length finish reasons and min_new_tokens; continuous batching leaves each
request's result unchanged; pause in each mode (abort, retract, in_place) and continue; abort by rid;
a client that disconnects has its request aborted; the API key; 4xx bodies reach the caller.

    .venv/bin/python -m pytest tests/test_rollout_server.py -q
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from engines.rollout.engine import EngineConfig, RolloutEngine
from engines.rollout.server import RolloutServer
from engines.rollout.sglang import GenerateOutput, SGLangClient, SGLangHTTPError, SGLangTimeout
from engines.align.score import load_ours, token_logprobs

FP32_TOL = 1e-5
BF16_MEAN_BOUND, BF16_MAX_BOUND = 0.02, 0.5
"""bf16 runtime vs fp32 full-sequence scoring on the random tiny model (measured: mean ~4e-3, max ~0.1)."""
LONG = 100
"""Tokens of a request that is still running when the test pauses or aborts it."""


def prompts(n: int, base: int = 30) -> list[list[int]]:
    return [[0] + [5 + (7 * i + 3 * k) % 90 for k in range(base + i % 3)] for i in range(n)]


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    with RolloutServer(RolloutEngine(tiny_checkpoint)) as server, SGLangClient(server.url, timeout=60) as client:
        yield server, client


@pytest.fixture(scope="module")
def ours(tiny_checkpoint):
    return load_ours(tiny_checkpoint)


def _state(client: SGLangClient) -> dict:
    return client.server_info()["internal_states"][0]


def _wait(cond, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _start_long(client: SGLangClient, seed: int, rid: str | None = None):
    """Submit a LONG-token request in the background; returns (future, payload) once it is decoding."""
    payload = {"input_ids": prompts(1)[0], "return_logprob": True,
               "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True, "sampling_seed": seed}}
    if rid:
        payload["rid"] = rid
    pool = ThreadPoolExecutor(1)
    before = _state(client)["generated_tokens"]
    fut = pool.submit(client.generate, payload)
    _wait(lambda: _state(client)["generated_tokens"] >= before + 5, what="the long request to decode")
    pool.shutdown(wait=False)
    return fut, payload


def _scored(model, outs: list[GenerateOutput], input_ids: list[list[int]]) -> list[list[float]]:
    seqs = [{"prompt_ids": p, "response_ids": o.output_ids} for p, o in zip(input_ids, outs)]
    return token_logprobs(model, seqs, vocab_size=model.cfg.vocab_size)


# ------------------------------------------------------------------------------------------- generation
def test_same_seed_same_output_and_sglang_shape(served):
    _, client = served
    payload = {"input_ids": prompts(1)[0], "return_logprob": True,
               "sampling_params": {"max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 7}}
    a, b = client.generate(payload), client.generate(payload)
    other = client.generate({**payload, "sampling_params": {**payload["sampling_params"], "sampling_seed": 8}})
    assert isinstance(a, dict) and set(a) == {"text", "output_ids", "meta_info"}
    assert a["output_ids"] == b["output_ids"] and a["output_ids"] != other["output_ids"]
    meta = a["meta_info"]
    assert meta["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
    assert [x[1] for x in meta["output_token_logprobs"]] == a["output_ids"]
    assert all(len(x) == 3 and x[2] is None for x in meta["output_token_logprobs"])
    assert meta["input_token_logprobs"] == []  # logprob_start_len -1: output tokens only (SGLang)
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["prompt_tokens"] == len(payload["input_ids"]) and meta["completion_tokens"] == 12
    assert meta["weight_version"] == "default" and isinstance(meta["e2e_latency"], float)
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": 12}]
    assert meta["reasoning_tokens"] == 0 and meta["output_token_logprobs_length"] == 12


def test_output_logprobs_equal_full_sequence_scoring(served, ours):
    _, client = served
    batch = prompts(6)
    outs = client.generate_ids(batch, {"max_new_tokens": 20, "ignore_eos": True, "temperature": 1.0,
                                       "sampling_seed": 3})
    want = _scored(ours, outs, batch)
    diffs = [abs(a - b) for o, w in zip(outs, want) for a, b in zip(o.output_logprobs, w)]
    assert len(diffs) == 6 * 20 and max(diffs) < FP32_TOL


def test_prompt_scoring_as_miles_sends_it(served, ours):
    """max_new_tokens=0, logprob_start_len=prompt_len-1: first entry None, then one per response token."""
    _, client = served
    prompt, response = prompts(1)[0], [40, 41, 42, 50, 60, 70, 1]
    body = client.generate({"input_ids": prompt + response, "return_logprob": True,
                            "logprob_start_len": len(prompt) - 1, "sampling_params": {"max_new_tokens": 0}})
    entries = body["meta_info"]["input_token_logprobs"]
    assert entries[0][0] is None and [e[1] for e in entries] == [prompt[-1]] + response
    assert body["output_ids"] == [] and body["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    want = token_logprobs(ours, [{"prompt_ids": prompt, "response_ids": response}], vocab_size=ours.cfg.vocab_size)[0]
    assert max(abs(e[0] - w) for e, w in zip(entries[1:], want)) < FP32_TOL


def test_top_logprobs_and_token_text(served):
    _, client = served
    p = prompts(1)[0]
    body = client.generate({"input_ids": p, "return_logprob": True, "logprob_start_len": len(p) - 3,
                            "top_logprobs_num": 3, "return_text_in_logprobs": True,
                            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
    meta = body["meta_info"]
    assert len(meta["output_top_logprobs"]) == 4 and meta["input_top_logprobs"][0] is None
    assert len(meta["input_top_logprobs"]) == len(meta["input_token_logprobs"]) == 3
    for (lp, tok, text), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert len(top) == 3 and [t[0] for t in top] == sorted((t[0] for t in top), reverse=True)
        assert lp <= top[0][0] and isinstance(text, str)  # ids >= 100 are unused and decode to ""
        assert lp == dict((t, v) for v, t, _ in top).get(tok, lp)  # a sampled top-3 token: the same logprob


def test_stop_and_length_finish_reasons(served):
    _, client = served
    p = prompts(1)[0]
    [greedy] = client.generate_ids([p], {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
    first = greedy.output_ids[0]
    [stopped] = client.generate_ids([p], {"max_new_tokens": 10, "temperature": 0, "stop_token_ids": [first]})
    assert stopped.finish_reason == {"type": "stop", "matched": first} and stopped.output_ids == [first]
    [long] = client.generate_ids([p], {"max_new_tokens": 3, "ignore_eos": True})
    assert long.finish_reason == {"type": "length", "length": 3} and len(long.output_ids) == 3
    evens = list(range(0, 128, 2))  # min_new_tokens masks stop tokens until reached
    outs = client.generate_ids([p] * 4, {"max_new_tokens": 30, "min_new_tokens": 4, "stop_token_ids": evens,
                                         "ignore_eos": True, "sampling_seed": 5})
    for o in outs:
        assert all(t % 2 for t in o.output_ids[:4])
        if o.finish_type == "stop":
            assert o.output_ids[-1] % 2 == 0 and all(t % 2 for t in o.output_ids[:-1])


def test_text_input_and_stop_string(served):
    _, client = served
    body = client.generate({"text": "Compute 12+34. Answer in \\boxed{}.",
                            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
    text = body["text"]
    assert len(body["output_ids"]) == 6 and len(text) >= 2
    stop = text[1]
    again = client.generate({"text": "Compute 12+34. Answer in \\boxed{}.",
                             "sampling_params": {"max_new_tokens": 6, "temperature": 0, "stop": [stop]}})
    assert again["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in again["text"] and text.startswith(again["text"])


def test_batch_with_n_samples_shares_the_prompt_prefill(served):
    _, client = served
    batch = prompts(2, base=33)
    body = client.generate({"input_ids": batch, "rid": ["a", "b"],
                            "sampling_params": {"max_new_tokens": 5, "n": 3, "ignore_eos": True, "sampling_seed": 1}})
    assert isinstance(body, list) and len(body) == 6
    assert [x["meta_info"]["id"] for x in body] == ["a_0", "a_1", "a_2", "b_0", "b_1", "b_2"]
    assert [x["meta_info"]["prompt_tokens"] for x in body] == [len(batch[0])] * 3 + [len(batch[1])] * 3
    cached = [x["meta_info"]["cached_tokens"] for x in body]
    assert cached[1] == cached[2] == len(batch[0]) and cached[4] == cached[5] == len(batch[1])
    assert len({tuple(x["output_ids"]) for x in body}) == 6


def test_continuous_batching_leaves_results_unchanged(served):
    """A request admitted while another is mid-decode gets the same tokens as when it runs alone."""
    _, client = served
    long_fut, long_payload = _start_long(client, seed=11)
    short = {"input_ids": prompts(3)[2], "return_logprob": True,
             "sampling_params": {"max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 12}}
    together = client.generate(short)
    assert not long_fut.done(), "the short request should finish while the long one is still decoding"
    long_together = long_fut.result(60)
    alone, long_alone = client.generate(short), client.generate(long_payload)
    for x, y in ((together, alone), (long_together, long_alone)):
        assert x["output_ids"] == y["output_ids"]
        lx = [e[0] for e in x["meta_info"]["output_token_logprobs"]]
        ly = [e[0] for e in y["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(lx, ly)) < FP32_TOL


# ------------------------------------------------------------------------------------------- control
@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_modes_and_continue(served, mode):
    _, client = served
    fut, payload = _start_long(client, seed=21)
    client.pause_generation(mode)
    if mode == "abort":
        out = GenerateOutput.from_item(fut.result(30))
        assert out.finish_type == "abort" and 0 < len(out.output_ids) < LONG
        client.continue_generation()
        return
    try:
        _check_paused(client, fut, payload, mode)
    finally:
        client.continue_generation()


def _check_paused(client: SGLangClient, fut, payload: dict, mode: str) -> None:
    state = _state(client)
    assert state["paused"] and not fut.done()
    if mode == "retract":
        assert state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 1
        client.flush_cache()  # nothing runs: the KV of the retracted request is gone already
    else:
        assert state["num_running_reqs"] == 1
        with pytest.raises(SGLangHTTPError) as err:  # in_place keeps KV, so flushing is refused
            client.flush_cache()
        assert err.value.status == 400
    waiting = ThreadPoolExecutor(1).submit(client.generate_ids, [prompts(1)[0]], {"max_new_tokens": 2})
    time.sleep(0.3)
    assert not fut.done() and not waiting.done(), "nothing may be scheduled while paused"
    client.continue_generation()
    resumed = fut.result(60)
    assert waiting.result(30)[0].finish_type in ("stop", "length")
    meta = resumed["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": LONG}
    assert meta["num_retractions"] == (1 if mode == "retract" else 0)
    alone = client.generate(payload)  # the same request never paused
    assert resumed["output_ids"] == alone["output_ids"]
    lr = [e[0] for e in meta["output_token_logprobs"]]
    la = [e[0] for e in alone["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(lr, la)) < FP32_TOL


def test_abort_request_by_rid(served):
    _, client = served
    fut, _ = _start_long(client, seed=31, rid="long-31")
    client.abort_request("long-31")
    out = GenerateOutput.from_item(fut.result(30))
    assert out.rid == "long-31" and out.finish_type == "abort" and 0 < len(out.output_ids) < LONG
    assert _state(client)["num_running_reqs"] == 0


def test_client_timeout_disconnect_aborts_the_request(served):
    server, client = served
    with SGLangClient(server.url, generate_timeout=0.3) as impatient:
        with pytest.raises(SGLangTimeout, match="/generate"):
            impatient.generate({"input_ids": prompts(1)[0],
                                "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}})
    _wait(lambda: _state(client)["num_running_reqs"] == 0, timeout=10, what="the abandoned request to be aborted")


def test_errors_are_400_with_the_reason(served):
    _, client = served
    p = prompts(1)[0]
    cases = [({"input_ids": p, "sampling_params": {"frequency_penalty": 0.5}}, "frequency_penalty"),
             ({"input_ids": p, "sampling_params": {"max_tokens": 5}}, "unknown field `max_tokens`"),
             ({"input_ids": [0, 999]}, "outside the vocabulary"),
             ({"input_ids": p, "return_logprob": True, "logprob_start_len": 500}, "higher than the number of input"),
             ({"input_ids": []}, "input_ids"),
             ({"text": "a", "input_ids": p}, "exactly one")]
    for body, reason in cases:
        with pytest.raises(SGLangHTTPError) as err:
            client.generate(body)
        assert err.value.status == 400 and reason in str(err.value), (body, str(err.value))
    with pytest.raises(SGLangHTTPError, match=r"must run between begin_weight_update\(\) and end_weight_update"):
        client.update_weights_from_distributed(names=["x"], dtypes=["bfloat16"], shapes=[[1]])


def test_health_and_info(served):
    server, client = served
    assert client.health() and client.health_generate()
    info = client.model_info()
    assert info["is_generation"] is True and info["weight_version"] == "default"
    server_info = client.server_info()
    assert server_info["host"] == "127.0.0.1" and server_info["port"] == server.port
    assert server_info["dtype"] == "float32" and "num_running_reqs" in server_info["internal_states"][0]
    assert server_info["internal_states"][0]["stored_tensors"] == {"fp8": 34, "fp4": 96, "bfloat16": 40,
                                                                   "float32": 38, "int64": 2}
    kernels = server_info["internal_states"][0]["native_kernels"]
    assert kernels["enabled"] and (kernels["error"] is None) == (kernels["library"] is not None)
    client.update_weight_version("v7")
    assert client.weight_version() == "v7"
    client.update_weight_version("default")


def test_api_key_is_enforced(tiny_checkpoint):
    with RolloutServer(RolloutEngine(tiny_checkpoint), api_key="s3cret") as server:
        body = {"input_ids": [0, 5, 6], "sampling_params": {"max_new_tokens": 1}}
        anonymous = httpx.post(f"{server.url}/generate", json=body, timeout=30)
        wrong = httpx.post(f"{server.url}/generate", json=body, headers={"Authorization": "Bearer nope"}, timeout=30)
        assert anonymous.status_code == wrong.status_code == 401
        assert anonymous.json() == {"error": "Unauthorized"}
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200  # SGLang leaves /health* open
        assert httpx.get(f"{server.url}/model_info", timeout=30).status_code == 401
        with SGLangClient(server.url, api_key="s3cret") as client:
            assert client.generate(body)["meta_info"]["completion_tokens"] == 1
            assert client.model_info()["is_generation"]
            assert client.requires_api_key()  # probed without the header the client otherwise always sends
            assert client.model_info()["is_generation"]  # and the client's own header is still there


def test_a_server_without_a_key_is_reported_as_open(served):
    _, client = served
    assert not client.requires_api_key()
    with SGLangClient(client.base_url, api_key="any") as keyed:  # a key the open server never asked for
        assert not keyed.requires_api_key()


def test_bf16_runtime_logprobs(tiny_checkpoint, ours):
    """bf16: equal to the engine's own full-sequence scoring; within the stated bound of fp32 scoring."""
    batch = prompts(8)
    with RolloutServer(RolloutEngine(tiny_checkpoint, EngineConfig(dtype="bfloat16"))) as server, \
            SGLangClient(server.url, timeout=60) as client:
        outs = client.generate_ids(batch, {"max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 4})
        rescored = client.score([p + o.output_ids for p, o in zip(batch, outs)], start=len(batch[0]) - 1)
    for p, o, r in zip(batch, outs, rescored):
        own = r[len(p) - len(batch[0]) + 1:]
        assert max(abs(a - b) for a, b in zip(o.output_logprobs, own)) <= 1e-6
    diffs = torch.tensor([abs(a - b) for o, w in zip(outs, _scored(ours, outs, batch))
                          for a, b in zip(o.output_logprobs, w)])
    assert diffs.mean() < BF16_MEAN_BOUND and diffs.max() < BF16_MAX_BOUND


def test_cli_serves_over_http(tiny_checkpoint):
    proc = subprocess.Popen([sys.executable, "-m", "v4rl.cli", "serve-rollout", "--model", str(tiny_checkpoint),
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = {}
        reader = threading.Thread(target=lambda: line.setdefault("text", proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(120)
        url = line.get("text", "").split(" on ")[-1].split(" ")[0]
        assert url.startswith("http://127.0.0.1:"), f"no URL printed: {line!r}"
        with SGLangClient(url, timeout=60) as client:
            client.wait_until_healthy(60)
            [out] = client.generate_ids([[0, 5, 6, 7]], {"max_new_tokens": 3, "ignore_eos": True})
            assert len(out.output_ids) == 3 and len(out.output_logprobs) == 3
    finally:
        proc.terminate()
        proc.wait(30)
    assert proc.returncode is not None


def test_a_refused_request_is_reported_to_the_servers_owner_with_the_engines_reason(tiny_checkpoint):
    """Miles retries any non-2xx answer for a minute: whoever runs the server sees the reason at once."""
    from fastapi.testclient import TestClient

    from engines.rollout.engine import RolloutEngine
    from engines.rollout.server import create_app

    refused: list[str] = []
    engine = RolloutEngine(tiny_checkpoint)
    try:
        client = TestClient(create_app(engine, on_refusal=refused.append))
        ok = client.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}})
        bad = client.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 10**9}})
        missing = client.get("/no_such_route")
    finally:
        engine.shutdown()
    assert ok.status_code == 200 and bad.status_code == 400 and missing.status_code == 404
    assert len(refused) == 2, refused
    assert refused[0].startswith("POST /generate: HTTP 400 ") and "context length" in refused[0], refused
    assert bad.json() == __import__("json").loads(refused[0].split("HTTP 400 ", 1)[1])  # the body is untouched
    assert refused[1].startswith("GET /no_such_route: HTTP 404"), refused
