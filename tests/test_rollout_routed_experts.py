"""Routed experts (SGLang's `return_routed_experts`, issue 27): the engine returns the experts it actually routed
every token to, in prefill, from the prefix cache and in cached decode, hash layers included (their tid2eid
lookup), in SGLang 0.5.23's format, and only with the server's `--enable-return-routed-experts`.

    .venv/bin/python -m pytest tests/test_rollout_routed_experts.py -q
"""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch

from engines.model.config import HASH_MOE
from engines.rollout.engine import EngineConfig, RequestSpec, RolloutEngine
from engines.rollout.sampling import SamplingParams
from engines.rollout.server import RolloutServer


@pytest.fixture(scope="module")
def engine(tiny_base):
    e = RolloutEngine(tiny_base, EngineConfig(enable_return_routed_experts=True))
    yield e
    e.shutdown()


def full_forward_routes(engine: RolloutEngine, tokens: list[int]) -> torch.Tensor:
    """A whole-sequence forward's routing of `tokens` with the torch ops: int32 [len, layers, top_k]."""
    trace: list[dict] = []
    with torch.inference_mode():
        engine.model.full_torch(torch.tensor([tokens]), keep_cache=False, trace=trace)
    return torch.stack([t["router"][0] for t in trace], dim=1).to(torch.int32)


def same_experts(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal sets of experts per (token, layer): the torch ops' top-k leaves its order unspecified."""
    return a.shape == b.shape and torch.equal(a.sort(-1).values, b.sort(-1).values)


def spec(rid: str, prompt: list[int], seed: int, **kw) -> RequestSpec:
    return RequestSpec(rid=rid, input_ids=prompt, sampling=SamplingParams(max_new_tokens=7, temperature=1.0),
                       seed=seed, return_routed_experts=True, **kw)


def test_routes_equal_a_full_forward_in_prefill_cache_and_decode(engine):
    prompt = [1, 17, 40, 3, 99, 5]
    # two samples of one prompt: the second is served from the prefix cache, then both decode in one batch
    outs = engine.generate([spec("a", prompt, 1), spec("b", prompt, 2), spec("c", [1, 8, 12], 3)])
    assert outs[1].cached_tokens == len(prompt)
    cfg = engine.cfg
    for o in outs:
        tokens = o.input_ids + o.output_ids
        assert o.routed_experts.dtype == torch.int32
        assert o.routed_experts.shape == (len(tokens) - 1, cfg.num_hidden_layers, cfg.num_experts_per_tok)
        assert same_experts(o.routed_experts, full_forward_routes(engine, tokens)[:-1])
        for layer, kind in enumerate(cfg.mlp_layer_types):
            if kind == HASH_MOE:  # what a hash layer reports: its frozen tid2eid row of each token
                table = engine.model.layers[layer].ffn.gate.tid2eid
                assert torch.equal(o.routed_experts[:, layer].long(), table[torch.tensor(tokens[:-1])])


def test_start_len_cuts_rows_and_no_request_flag_means_no_routes(engine):
    prompt = [1, 22, 23, 24, 25]
    whole, cut, plain = engine.generate([spec("w", prompt, 4), spec("s", prompt, 4, routed_experts_start_len=3),
                                         RequestSpec(rid="p", input_ids=prompt, seed=4,
                                                     sampling=SamplingParams(max_new_tokens=7, temperature=1.0))])
    assert torch.equal(cut.routed_experts, whole.routed_experts[3:])
    assert plain.routed_experts is None
    with pytest.raises(ValueError, match="routed_experts_start_len 6 must be in"):
        engine.generate([spec("bad", prompt, 4, routed_experts_start_len=6)])


def test_server_returns_sglang_format_only_with_the_server_flag(tiny_base):
    engine = RolloutEngine(tiny_base, EngineConfig(enable_return_routed_experts=True))  # the server stops it
    body = {"input_ids": [1, 30, 31, 32], "return_routed_experts": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 1.0, "sampling_seed": 7}}
    cfg = engine.cfg
    with RolloutServer(engine) as server:
        info = httpx.get(f"{server.url}/get_server_info").json()
        out = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
        refused = httpx.post(f"{server.url}/generate", json={**body, "routed_experts_start_len": 9}, timeout=60)
    assert info["enable_return_routed_experts"] is True
    meta = out["meta_info"]
    rows = meta["prompt_tokens"] + meta["completion_tokens"] - 1
    routes = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32).reshape(
        rows, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    tokens = body["input_ids"] + out["output_ids"]
    assert same_experts(torch.from_numpy(routes.copy()), full_forward_routes(engine, tokens)[:-1])
    assert refused.status_code == 400 and "routed_experts_start_len=9 is higher" in refused.text

    plain = RolloutEngine(tiny_base)  # no --enable-return-routed-experts: served, without the field (SGLang)
    with RolloutServer(plain) as server:
        info = httpx.get(f"{server.url}/get_server_info").json()
        out = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    assert info["enable_return_routed_experts"] is False
    assert "routed_experts" not in out["meta_info"] and out["output_ids"]
