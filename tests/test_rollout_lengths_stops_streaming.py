"""The embedded server's context-length gates, stop trimming and streamed /generate, as SGLang 0.5.23 answers.

Issue 25 items 4-6, each read from SGLang's source (engines/rollout/limits.py, protocol.py `_text`,
streaming.py): an over-long request is a 400 with SGLang's message (was: 200 and a silently cut output); a
stop string under `no_stop_trim` ends the text right after it (was: the whole last token's text); `stream:
true` is served as SGLang's server-sent events (was: refused). A short context (80 tokens) keeps runs short.

    .venv/bin/python -m pytest tests/test_rollout_lengths_stops_streaming.py -q
"""

from __future__ import annotations

import json

import httpx
import pytest

from engines.rollout.api import RequestOutput
from engines.rollout.engine import EngineConfig, RolloutEngine
from engines.rollout.server import RolloutServer

CONTEXT = 80
PROMPT = [0] + [5 + (3 * k) % 90 for k in range(30)]
BOXED = 4
"""The tiny tokenizer's one multi-character token, `\\boxed{`."""


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    engine = RolloutEngine(tiny_checkpoint, EngineConfig(context_length=CONTEXT))
    with RolloutServer(engine) as server:
        yield server, engine.tokenizer


def _post(server, body) -> httpx.Response:
    return httpx.post(f"{server.url}/generate", json=body, timeout=60)


def _stream(server, body) -> tuple[httpx.Response, list]:
    """The response and its events: each `data:` payload parsed, `[DONE]` kept as the string."""
    with httpx.stream("POST", f"{server.url}/generate", json={**body, "stream": True}, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    return r, [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines]


# ------------------------------------------------------------------ item 4: over-long requests
def test_over_long_requests_are_refused_with_sglangs_400(served):
    server, _ = served
    r = _post(server, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 50}})
    assert r.status_code == 400 and r.json() == {"error": {"message": (
        "Requested token count exceeds the model's maximum context length of 80 tokens. You requested a total of "
        "81 tokens: 31 tokens from the input messages and 50 tokens for the completion. Please reduce the number "
        "of tokens in the input messages or the completion to fit within the limit.")}}
    r = _post(server, {"input_ids": [PROMPT, PROMPT],
                       "sampling_params": [{"max_new_tokens": 4}, {"max_new_tokens": 50}]})
    assert r.status_code == 400 and "a total of 81 tokens" in r.json()["error"]["message"]  # the whole batch
    r = _post(server, {"input_ids": PROMPT + [5] * 49})  # the prompt alone fills the context
    assert r.status_code == 400 and r.json() == {"error": {"message": (
        "The input (80 tokens) is longer than the model's context length (80 tokens).")}}
    r = _post(server, {"input_ids": PROMPT + [5] * 43})  # the scheduler's gate: max_req_input_len = 80 - 6
    assert r.status_code == 400 and r.json() == {"error": {"message": (
        "Input length (74 tokens) exceeds the maximum allowed length (74 tokens). Use a shorter input or enable "
        "--allow-auto-truncate.")}}
    assert httpx.get(f"{server.url}/server_info", timeout=30).json()["max_req_input_len"] == 74


def test_accepted_requests_are_capped_as_sglangs_scheduler_caps_them(served):
    """prompt + max_new_tokens == context passes the gate; SGLang then caps the output at context - prompt - 2."""
    server, _ = served
    for params in ({"max_new_tokens": CONTEXT - len(PROMPT)}, {"max_new_tokens": None}):
        meta = _post(server, {"input_ids": PROMPT, "sampling_params": {**params, "ignore_eos": True}}).json()[
            "meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": CONTEXT - len(PROMPT) - 2}
        assert meta["completion_tokens"] == CONTEXT - len(PROMPT) - 2
    meta = _post(server, {"input_ids": PROMPT + [5] * 42, "sampling_params": {"ignore_eos": True}}).json()["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 5}  # omitted max_new_tokens: no total check


# ------------------------------------------------------------------ item 5: stop trimming
def test_no_stop_trim_text_ends_right_after_the_stop_string(served):
    from engines.rollout.protocol import response_item

    _, tokenizer = served
    ids = [15, BOXED, 5]  # "a", "\boxed{", "0": the stop string ends inside the middle token

    def text(no_stop_trim: bool | None, matched) -> str:
        out = RequestOutput(rid="r", input_ids=[0], output_ids=ids, finish_reason={"type": "stop", "matched": matched},
                            output_logprobs=[-1.0] * 3, output_top_logprobs=[], input_logprobs=[],
                            input_top_logprobs=[], cached_tokens=0, num_retractions=0, weight_version="v",
                            e2e_latency=0.1)
        item = response_item(out, {"no_stop_trim": no_stop_trim, "return_logprob": True, "top_logprobs_num": 0},
                             False, tokenizer)
        assert item["output_ids"] == ids and len(item["meta_info"]["output_token_logprobs"]) == 3  # never trimmed
        return item["text"]

    assert text(True, "box") == "a\\box" and text(False, "box") == "a\\" and text(None, "box") == "a\\"
    assert text(False, 5) == "a\\boxed{" and text(True, 5) == "a\\boxed{0"  # a stop token: out of the text


def test_stop_string_mid_token_from_the_engine(served):
    """A sampled `\\boxed{` token with stop "boxed": output_ids end at that token, the text right after "boxed"."""
    server, tokenizer = served
    base = {"max_new_tokens": 40, "ignore_eos": True, "n": 8, "temperature": 1.0}
    for seed in range(6):
        plain = _post(server, {"input_ids": PROMPT, "sampling_params": {**base, "sampling_seed": seed}}).json()
        hits = [(j, x["output_ids"].index(BOXED)) for j, x in enumerate(plain) if BOXED in x["output_ids"]]
        if hits:
            break
    assert hits, "no sample drew the \\boxed{ token; widen the search"
    j, k = hits[0]
    for no_stop_trim, ending in ((True, "\\boxed"), (False, "\\")):  # the text of "\boxed{" cut after/before "boxed"
        got = _post(server, {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {
            **base, "sampling_seed": seed, "stop": "boxed", "no_stop_trim": no_stop_trim}}).json()[j]
        prefix = tokenizer.decode(plain[j]["output_ids"][:k], skip_special_tokens=True)
        assert got["output_ids"] == plain[j]["output_ids"][:k + 1]
        assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": "boxed"}
        assert len(got["meta_info"]["output_token_logprobs"]) == k + 1
        assert got["text"] == prefix + ending


def test_finish_order_and_ignore_eos_as_sglang(served):
    """SGLang 0.5.23 checks stop strings, then stop tokens (not with ignore_eos), then the length cap."""
    server, tokenizer = served
    greedy = _post(server, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0,
                                                                      "ignore_eos": True}}).json()
    first = greedy["output_ids"][0]
    meta = _post(server, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1, "temperature": 0,
                                                                    "stop_token_ids": [first]}}).json()["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": first}  # the last allowed token is a stop token
    meta = _post(server, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0,
                                                                    "stop_token_ids": [first], "ignore_eos": True}}
                 ).json()["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    char = tokenizer.decode([first])
    if char:  # a stop string is not held back by min_new_tokens (only stop tokens are banned)
        meta = _post(server, {"input_ids": PROMPT, "sampling_params": {
            "max_new_tokens": 3, "temperature": 0, "stop": char, "min_new_tokens": 3}}).json()["meta_info"]
        assert meta["finish_reason"] == {"type": "stop", "matched": char} and meta["completion_tokens"] == 1


# ------------------------------------------------------------------ item 6: streaming
def test_stream_sends_cumulative_chunks_then_done(served):
    server, tokenizer = served
    body = {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 40, "ignore_eos": True, "sampling_seed": 3}}
    r, events = _stream(server, body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]" and len(events) >= 3
    *running, last = events[:-1]
    whole = _post(server, body).json()
    assert last["output_ids"] == whole["output_ids"] and last["text"] == whole["text"]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 40} and "e2e_latency" in last["meta_info"]
    assert last["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"]
    seen = 0
    for chunk in running:  # cumulative: each chunk extends the previous, text decoded so far
        ids, meta = chunk["output_ids"], chunk["meta_info"]
        assert len(ids) > seen and ids == whole["output_ids"][:len(ids)] and "index" not in chunk
        assert meta["finish_reason"] is None and "e2e_latency" not in meta and meta["completion_tokens"] == len(ids)
        assert chunk["text"] == tokenizer.decode(ids, skip_special_tokens=True)
        assert len(meta["output_token_logprobs"]) == len(ids)
        seen = len(ids)


def test_stream_batches_carry_index_and_honour_stream_interval(served):
    server, _ = served
    _, events = _stream(server, {"input_ids": [PROMPT, PROMPT[:-1]], "rid": "s",
                                 "sampling_params": {"max_new_tokens": 30, "ignore_eos": True, "n": 2,
                                                     "stream_interval": 10}})
    assert events[-1] == "[DONE]"
    by_index: dict[int, list] = {}
    for chunk in events[:-1]:
        by_index.setdefault(chunk["index"], []).append(chunk)
    assert sorted(by_index) == [0, 1, 2, 3]
    for i, chunks in by_index.items():
        final = chunks[-1]["meta_info"]
        assert final["id"] == f"s_{i}" and final["finish_reason"]["type"] == "length"
        counts = [len(c["output_ids"]) for c in chunks[:-1]]
        assert all(b - a >= 10 for a, b in zip(counts, counts[1:])), counts  # first token at once, then every 10


def test_stream_refusals_are_sglangs_in_stream_error(served):
    server, _ = served
    r, events = _stream(server, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 60}})
    assert r.status_code == 200 and events[-1] == "[DONE]" and len(events) == 2
    assert events[0]["error"]["type"] == "invalid_request_error" and events[0]["error"]["code"] == 400
    assert events[0]["error"]["retryable"] is False and "a total of 91 tokens" in events[0]["error"]["message"]
    with httpx.stream("POST", f"{server.url}/generate", timeout=60,  # the schema gate answers before streaming
                      json={"input_ids": PROMPT, "stream": True, "sampling_params": {"max_tokens": 5}}) as r:
        r.read()
    assert r.status_code == 400 and r.json()["error"].startswith("unknown field `max_tokens`")
