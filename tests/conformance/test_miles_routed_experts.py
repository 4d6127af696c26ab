"""Miles' own decoder of `meta_info.routed_experts` reads the embedded engine's answer (both vendored generations).

Miles (`--use-rollout-routing-replay`) sends `return_routed_experts` and decodes the answer with
`miles/rollout/generate_utils/generate_endpoint_utils.py` `get_routed_experts_from_response(args, output,
len(tokens) - 1)` (base64 int32, reshaped to (tokens, args.num_layers, top_k) with top_k taken from the buffer's
length). Here that function, run from the vendored tree in a subprocess, decodes a real /generate answer of
`v4rl serve-rollout --enable-return-routed-experts`, and what it returns equals a full forward's routing of the
same tokens.

    .venv/bin/python -m pytest tests/conformance/test_miles_routed_experts.py -q
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch

from engines.upstream.sources import engine_python
from engines.rollout.engine import EngineConfig, RolloutEngine
from engines.rollout.server import RolloutServer

DECODE = """
import json, sys, types
import numpy as np
from miles.rollout.generate_utils.generate_endpoint_utils import get_routed_experts_from_response

answer = json.load(open(sys.argv[1]))
tokens = answer["input_ids"] + answer["output_ids"]
routes = get_routed_experts_from_response(types.SimpleNamespace(num_layers=int(sys.argv[3])), answer, len(tokens) - 1)
np.save(sys.argv[2], routes)
"""


@pytest.mark.parametrize("generation", ["miles_tree", "miles_gen2_tree"])
def test_miles_decodes_the_routes_the_engine_used(generation, request, sglang_paths, tiny_base, tmp_path):
    miles = request.getfixturevalue(generation)
    engine = RolloutEngine(tiny_base, EngineConfig(enable_return_routed_experts=True))
    body = {"input_ids": [1, 40, 41, 42, 43], "return_routed_experts": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 3, "ignore_eos": True}}
    with RolloutServer(engine) as server:
        answer = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
        tokens = body["input_ids"] + answer["output_ids"]
        trace: list[dict] = []
        with torch.inference_mode():
            engine.model.full_torch(torch.tensor([tokens]), keep_cache=False, trace=trace)
    expected = torch.stack([t["router"][0] for t in trace], dim=1)[:-1].sort(-1).values.numpy()
    (tmp_path / "answer.json").write_text(json.dumps({**answer, "input_ids": body["input_ids"]}))
    engine_python(DECODE, [miles, *sglang_paths], cwd=miles, timeout=300,
                  args=[str(tmp_path / "answer.json"), str(tmp_path / "routes.npy"), str(engine.cfg.num_hidden_layers)])
    decoded = np.load(tmp_path / "routes.npy")
    assert decoded.dtype == np.int32
    assert decoded.shape == (len(tokens) - 1, engine.cfg.num_hidden_layers, engine.cfg.num_experts_per_tok)
    assert np.array_equal(np.sort(decoded, axis=-1), expected)
