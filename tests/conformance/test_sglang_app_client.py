"""(a) v4rl's SGLang client against SGLang 0.5.23's real FastAPI app (only the TokenizerManager faked).

Every request kind v4rl sends (engines/rollout/sglang.py, as the trainer's rollout, the fidelity gate and the
distributed weight push use it) goes through SGLang's own routes, request structs, contract gate, API-key
middleware and request normalisation; the fake manager records what arrived, so each test asserts the
request landed on the field v4rl meant. SGLang refusing anything fails the test with its own message.

    .venv/bin/python -m pytest tests/conformance/test_sglang_app_client.py -q
"""

from __future__ import annotations

import pytest

from engines.rollout.protocol import unknown_field_message
from engines.rollout.sglang import SGLangClient, SGLangHTTPError

PROMPTS = [[0, 5, 6, 7], [0, 9, 10]]


@pytest.fixture(scope="module")
def client(sglang_app, sglang_worker):
    with SGLangClient(sglang_app["url"], api_key=sglang_app["api_key"], timeout=60) as c:
        sglang_worker.call("records")  # start from an empty log
        yield c


def _arrived(worker, route: str) -> list[dict]:
    got = [r for r in worker.call("records") if r["route"] == route and not r.get("health")]
    assert got, f"SGLang's app never passed a {route} request to the manager"
    return got


def test_rollout_generation_as_the_trainer_sends_it(client, sglang_worker):
    """HTTPRollout.generate: a batch with n samples, a seed and logprobs (engines/train/actors.py)."""
    params = {"temperature": 1.0, "max_new_tokens": 8, "n": 4, "sampling_seed": 17}
    outs = client.generate_ids(PROMPTS, params, return_logprob=True)
    assert len(outs) == len(PROMPTS) * 4 and all(o.finish_type == "length" for o in outs)
    [got] = _arrived(sglang_worker, "generate")
    norm = got["normalized"]
    assert (norm["batch_size"], norm["parallel_sample_num"], norm["is_single"]) == (2, 4, False)
    assert got["obj"]["input_ids"] == PROMPTS and got["obj"]["sampling_params"] == params
    assert norm["return_logprob"] == [True] * 8 and norm["logprob_start_len"] == [-1] * 8


def test_named_requests_and_prompt_scoring(client, sglang_worker):
    client.generate_ids(PROMPTS, {"max_new_tokens": 2}, rids=["a", "b"])
    [named] = _arrived(sglang_worker, "generate")
    assert named["normalized"]["rid"] == ["a", "b"]
    scored = client.score([[0, 5, 6, 7, 8]], start=3)  # Miles' form: max_new_tokens 0 from prompt_len - 1
    assert scored[0][0] is None and len(scored[0]) == 2
    [score] = _arrived(sglang_worker, "generate")
    assert score["normalized"]["logprob_start_len"] == [3] and score["obj"]["sampling_params"] == {"max_new_tokens": 0}


def test_single_requests_with_every_sampling_field_v4rl_uses(client, sglang_worker):
    params = {"max_new_tokens": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_new_tokens": 1,
              "stop_token_ids": [1, 2], "ignore_eos": False, "sampling_seed": 5, "skip_special_tokens": True,
              "no_stop_trim": True, "spaces_between_special_tokens": False}
    body = client.generate({"input_ids": PROMPTS[0], "sampling_params": params, "return_logprob": True,
                            "logprob_start_len": 2, "top_logprobs_num": 2, "return_text_in_logprobs": True,
                            "rid": "one"})
    assert body["meta_info"]["id"] == "one"
    [got] = _arrived(sglang_worker, "generate")
    assert got["normalized"]["is_single"] and got["obj"]["sampling_params"] == params
    assert (got["obj"]["top_logprobs_num"], got["obj"]["return_text_in_logprobs"]) == (2, True)


def test_sglang_and_v4rl_refuse_an_unknown_sampling_key_with_the_same_body(client, sglang_worker):
    with pytest.raises(SGLangHTTPError) as err:
        client.generate({"input_ids": PROMPTS[0], "sampling_params": {"max_tokens": 4}})
    assert err.value.status == 400 and err.value.body == {"error": unknown_field_message("max_tokens")}
    assert sglang_worker.call("contract_error", body={"input_ids": [0], "sampling_params": {"max_tokens": 4}}) == \
        unknown_field_message("max_tokens")


def test_health_info_and_api_key(client, sglang_worker):
    assert client.health() and client.health_generate()
    client.wait_until_healthy(timeout=60)
    info = client.model_info()
    assert info["model_path"] and "served_model_name" in info and client.weight_version() == "default"
    assert "internal_states" in client.server_info()
    assert client.requires_api_key()  # SGLang's middleware refuses the header-less probe with 401
    with SGLangClient(client.base_url, api_key="wrong") as wrong, pytest.raises(SGLangHTTPError) as err:
        wrong.model_info()
    assert err.value.status == 401


def test_pause_continue_abort_flush(client, sglang_worker):
    for mode in ("abort", "retract", "in_place"):
        client.pause_generation(mode)
        client.continue_generation()
    pauses = _arrived_all(sglang_worker)
    assert [r["obj"]["mode"] for r in pauses["pause_generation"]] == ["abort", "retract", "in_place"]
    assert len(pauses["continue_generation"]) == 3
    client.abort_request("r1")
    client.abort_request(abort_all=True)
    client.flush_cache()
    client.flush_cache(wait_s=5)
    done = _arrived_all(sglang_worker)
    assert [(r["rid"], r["abort_all"]) for r in done["abort_request"]] == [("r1", False), ("", True)]
    assert [r["timeout_s"] for r in done["flush_cache"]] == [0.0, 5.0]


def test_weight_updates_from_disk_and_versions(client, sglang_worker):
    client.update_weights_from_disk("/export/step_3", weight_version="3", abort_all_requests=True, keep_pause=True,
                                    flush_cache=True)
    client.begin_weight_update()
    client.update_weights_from_disk("/export/bucket_0")
    client.end_weight_update()
    client.update_weight_version("4", abort_all_requests=False)
    assert client.weight_version() == "4"
    got = _arrived_all(sglang_worker)
    first, second = got["update_weights_from_disk"]
    assert (first["obj"]["model_path"], first["obj"]["weight_version"], first["obj"]["abort_all_requests"],
            first["obj"]["keep_pause"], first["obj"]["flush_cache"]) == ("/export/step_3", "3", True, True, True)
    assert second["obj"]["model_path"] == "/export/bucket_0" and second["obj"]["weight_version"] is None
    assert got["begin_weight_update"][0]["obj"]["selector"] == "all" and len(got["end_weight_update"]) == 1
    assert (got["update_weight_version"][0]["obj"]["new_version"],
            got["update_weight_version"][0]["obj"]["abort_all_requests"]) == ("4", False)


def test_distributed_sync_and_weights_checker(client, sglang_worker):
    client.init_weights_update_group(master_address="10.0.0.1", master_port=29555, rank_offset=1, world_size=9)
    client.update_weights_from_distributed(names=["model.embed_tokens.weight"], dtypes=["bfloat16"],
                                           shapes=[[128, 64]], flush_cache=False, weight_version="5",
                                           load_format="flattened_bucket")
    client.destroy_weights_update_group()
    assert set(client.weights_checksums()) == {"model.embed_tokens.weight"}
    got = _arrived_all(sglang_worker)
    init = got["init_weights_update_group"][0]["obj"]
    assert (init["master_address"], init["master_port"], init["rank_offset"], init["world_size"], init["backend"],
            init["group_name"]) == ("10.0.0.1", 29555, 1, 9, "nccl", "weight_update_group")
    bucket = got["update_weights_from_distributed"][0]["obj"]
    assert (bucket["names"], bucket["dtypes"], bucket["shapes"], bucket["flush_cache"], bucket["weight_version"],
            bucket["load_format"]) == (["model.embed_tokens.weight"], ["bfloat16"], [[128, 64]], False, "5",
                                       "flattened_bucket")
    assert got["destroy_weights_update_group"][0]["obj"]["group_name"] == "weight_update_group"
    assert got["weights_checker"][0]["obj"]["action"] == "checksum"


def _arrived_all(worker) -> dict[str, list[dict]]:
    by_route: dict[str, list[dict]] = {}
    for r in worker.call("records"):
        if not r.get("health"):
            by_route.setdefault(r["route"], []).append(r)
    return by_route
