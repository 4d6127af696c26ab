"""(c) Every kind of response v4rl's server gives, decoded with SGLang 0.5.23's generated schema.

`sglang/api/v1/api_types.py` is the JSON contract SGLang's Rust and Python servers share. Each response is
decoded with its schema type (GenerateResponse per /generate item, GetModelInfoResponse, GetServerInfoResponse,
the ErrorBody of a refused request), must decode without a contract error, and must encode back to the same
values in every field the schema knows (so nothing decoded to a default by accident); finish reasons must decode
to their typed variant (FinishStop / FinishLength / FinishAbort), not the schema's untyped fallback.

    .venv/bin/python -m pytest tests/conformance/test_sglang_schema.py -q
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from engines.rollout.engine import RolloutEngine
from engines.rollout.server import RolloutServer
from engines.rollout.sglang import SGLangClient

PROMPT = [0] + [5 + (3 * k) % 90 for k in range(30)]
FINISH_TYPES = {"stop": "FinishStop", "length": "FinishLength", "abort": "FinishAbort"}


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    with RolloutServer(RolloutEngine(tiny_checkpoint)) as server, SGLangClient(server.url, timeout=60) as client:
        yield server, client


def _items(body: Any) -> list[dict]:
    return body if isinstance(body, list) else [body]


def _generate_responses(server, client) -> list[dict]:
    """One or more items of every /generate answer shape v4rl's server produces."""
    sp = {"max_new_tokens": 4, "ignore_eos": True, "sampling_seed": 1}
    bodies = [
        {"input_ids": PROMPT, "sampling_params": sp},
        {"text": "Compute 1+2.", "sampling_params": sp, "return_logprob": True},
        {"input_ids": [PROMPT, PROMPT[:-2]], "rid": "batch", "sampling_params": {**sp, "n": 2},
         "return_logprob": True},
        {"input_ids": PROMPT, "sampling_params": sp, "return_logprob": True, "logprob_start_len": 0,
         "top_logprobs_num": 3, "return_text_in_logprobs": True},
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
         "logprob_start_len": len(PROMPT) - 1},
    ]
    out = [item for body in bodies for item in _items(client.generate(body))]
    first = out[0]["output_ids"][0]  # a stop token the greedy path hits, and a stop string
    out += _items(client.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                                            "stop_token_ids": [first]}}))
    text = client.generate({"text": "Compute 1+2.", "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                        "ignore_eos": True}})["text"]
    out += _items(client.generate({"text": "Compute 1+2.", "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                               "stop": [text[1]]}}))
    out.append(_aborted_and_versioned(client))
    return out


def _aborted_and_versioned(client) -> dict:
    """A request that saw a weight-version change mid-decode (two spans), then was aborted."""
    pool = ThreadPoolExecutor(1)
    before = client.server_info()["internal_states"][0]["generated_tokens"]
    fut = pool.submit(client.generate, {"input_ids": PROMPT, "rid": "long", "return_logprob": True,
                                        "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}})
    while client.server_info()["internal_states"][0]["generated_tokens"] < before + 3:
        time.sleep(0.02)
    client.pause_generation("in_place")
    client.update_weight_version("v2", abort_all_requests=False)
    client.continue_generation()
    resumed = client.server_info()["internal_states"][0]["generated_tokens"]
    while client.server_info()["internal_states"][0]["generated_tokens"] < resumed + 3:
        time.sleep(0.02)
    client.abort_request("long")
    item = fut.result(60)
    pool.shutdown()
    client.update_weight_version("default")
    assert item["meta_info"]["finish_reason"]["type"] == "abort" and len(item["meta_info"]["weight_versions"]) == 2
    return item


def _same_where_known(ours: Any, encoded: Any, where: str = "") -> list[str]:
    """Paths where the schema's re-encoding differs from our value (keys the schema does not know are skipped)."""
    if isinstance(encoded, dict) and isinstance(ours, dict):
        return [p for k in encoded if k in ours for p in _same_where_known(ours[k], encoded[k], f"{where}.{k}")]
    if isinstance(encoded, list) and isinstance(ours, list):
        if len(encoded) != len(ours):
            return [f"{where}: {len(ours)} entries, decoded {len(encoded)}"]
        return [p for i, (a, b) in enumerate(zip(ours, encoded)) for p in _same_where_known(a, b, f"{where}[{i}]")]
    return [] if ours == encoded else [f"{where}: ours {ours!r}, decoded {encoded!r}"]


def _decode_all(worker, kind: str, values: list) -> list[dict]:
    decoded = worker.call("decode", kind=kind, values=values, timeout=120)
    for value, got in zip(values, decoded):
        assert "error" not in got, f"{kind} refuses v4rl's {value!r:.300}: {got['error']}"
        assert not _same_where_known(value, got["encoded"]), _same_where_known(value, got["encoded"])
    return decoded


def test_generate_responses_decode(served, sglang_worker):
    server, client = served
    items = _generate_responses(server, client)
    kinds = {i["meta_info"]["finish_reason"]["type"] for i in items}
    assert kinds == {"stop", "length", "abort"}
    decoded = _decode_all(sglang_worker, "GenerateResponse", items)
    for item, got in zip(items, decoded):
        assert got["finish"] == FINISH_TYPES[item["meta_info"]["finish_reason"]["type"]]
    assert any(len(i["meta_info"]["weight_versions"]) == 2 for i in items)
    assert any("output_top_logprobs" in i["meta_info"] for i in items)


def test_info_and_error_bodies_decode(served, sglang_worker):
    server, client = served
    _decode_all(sglang_worker, "GetModelInfoResponse", [client.model_info()])
    _decode_all(sglang_worker, "GetServerInfoResponse", [client.server_info()])
    refused = httpx.post(f"{server.url}/generate", json={"input_ids": [0, 999]}, timeout=30)
    assert refused.status_code == 400
    _decode_all(sglang_worker, "ErrorBody", [refused.json()["error"]])
