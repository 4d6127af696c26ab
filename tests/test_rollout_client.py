"""The SGLang client's transport rules: a timeout on every call, retries only when no connection was made
(a request is never sent twice), 4xx/5xx bodies surfaced, the API key sent.

Transport behaviour is driven through httpx.MockTransport (connection refusals and read timeouts cannot
be produced on demand by a real server); one test uses a real closed port. Answers from a real server
are covered in test_rollout_server.py.

    .venv/bin/python -m pytest tests/test_rollout_client.py -q
"""

from __future__ import annotations

import socket

import httpx
import pytest

from engines.rollout.sglang import (GenerateOutput, SGLangClient, SGLangConnectionError, SGLangHTTPError,
                                    SGLangTimeout)


def _client(handler, **kwargs) -> tuple[SGLangClient, list[httpx.Request]]:
    seen: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return handler(request)

    kwargs.setdefault("backoff_s", 0.001)
    return SGLangClient("http://rollout.test", transport=httpx.MockTransport(record), **kwargs), seen


def test_connection_errors_are_retried_then_reported():
    def refuse(request):
        raise httpx.ConnectError("connection refused", request=request)

    client, seen = _client(refuse, connect_retries=2)
    with pytest.raises(SGLangConnectionError, match="3 attempts"):
        client.pause_generation("abort")
    assert len(seen) == 3


def test_a_connection_that_recovers_succeeds():
    attempts = iter([httpx.ConnectError, httpx.ConnectTimeout, None])

    def flaky(request):
        exc = next(attempts)
        if exc is not None:
            raise exc("not yet", request=request)
        return httpx.Response(200, json={"message": "Generation continued successfully.", "status": "ok"})

    client, seen = _client(flaky, connect_retries=3)
    assert client.continue_generation()["status"] == "ok" and len(seen) == 3


@pytest.mark.parametrize("exc", [httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout])
def test_timeouts_are_not_retried(exc):
    def slow(request):
        raise exc("too slow", request=request)

    client, seen = _client(slow, connect_retries=5, generate_timeout=1.5)
    with pytest.raises(SGLangTimeout, match=r"/generate: no answer within 1.5s"):
        client.generate({"input_ids": [0, 1]})
    assert len(seen) == 1


def test_every_call_carries_a_timeout():
    client, seen = _client(lambda r: httpx.Response(200, json={"success": True, "message": "ok"}),
                           timeout=7.0, update_timeout=99.0)
    client.flush_cache()
    client.update_weights_from_disk("/ckpt")
    client.end_weight_update(timeout=3.0)
    assert [r.extensions["timeout"]["read"] for r in seen] == [7.0, 99.0, 3.0]


def test_error_bodies_are_surfaced():
    bodies = iter([httpx.Response(400, json={"success": False, "message": "tid2eid is frozen"}),
                   httpx.Response(400, json={"error": {"message": "unknown sampling_params keys ['x']"}}),
                   httpx.Response(500, text="Internal Server Error: boom")])
    client, _ = _client(lambda r: next(bodies), connect_retries=0)
    with pytest.raises(SGLangHTTPError) as a:
        client.update_weights_from_disk("/ckpt")
    assert a.value.status == 400 and a.value.body == {"success": False, "message": "tid2eid is frozen"}
    assert "tid2eid is frozen" in str(a.value) and "/update_weights_from_disk" in str(a.value)
    with pytest.raises(SGLangHTTPError, match=r"unknown sampling_params keys"):
        client.generate({"input_ids": [0]})
    with pytest.raises(SGLangHTTPError, match="HTTP 500: Internal Server Error: boom"):
        client.server_info()


def test_api_key_goes_in_the_bearer_header():
    client, seen = _client(lambda r: httpx.Response(200, json={"weight_version": "3"}), api_key="k3y")
    assert client.weight_version() == "3"
    assert seen[-1].headers["Authorization"] == "Bearer k3y"


def test_generate_output_parses_sglang_items():
    item = {"text": "ab", "output_ids": [7, 8], "meta_info": {
        "id": "r1", "finish_reason": {"type": "stop", "matched": 8}, "weight_version": "2",
        "input_token_logprobs": [[None, 3, None], [-0.5, 4, None]],
        "output_token_logprobs": [[-1.0, 7, None], [-2.0, 8, None]]}}
    out = GenerateOutput.from_item(item)
    assert (out.rid, out.output_ids, out.output_logprobs, out.input_logprobs) == ("r1", [7, 8], [-1.0, -2.0],
                                                                                  [None, -0.5])
    assert out.finish_type == "stop" and out.weight_version == "2"


def test_real_closed_port_is_a_connection_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with SGLangClient(f"http://127.0.0.1:{port}", connect_retries=1, backoff_s=0.01) as client:
        assert client.health() is False
        with pytest.raises(SGLangConnectionError):
            client.model_info()
        with pytest.raises(SGLangTimeout):
            client.wait_until_healthy(timeout=0.3, poll_s=0.05)
