"""The radixark/miles#3277 case in v4rl's engine and trainer: a request retracted mid-decode (pause mode retract, as
Miles pauses for a weight update), updated to new weights and resumed never pairs old logprobs with new routes.

The request's first tokens were sampled, and their logprobs computed, under the old weights; the re-prefill after
the update routes those same positions again under the new weights. The engine keeps the rows it recorded before
(engines/rollout/engine.py `add_prefill_routes`), so every routed-experts row is the routing of the very forward
that produced the logprob it pairs with; HTTPRollout's decode hands that row to the trainer, whose replay uses it.

    .venv/bin/python -m pytest tests/test_corrections_r3_retraction.py -q
"""

from __future__ import annotations

import threading

import torch

from engines.rollout.engine import EngineConfig, RequestSpec, RolloutEngine
from engines.rollout.sampling import SamplingParams

NEW_TOKENS = 24
RETRACT_AFTER = 6


def write_rerouted_copy(checkpoint, out, *, seed: int):
    """`checkpoint` with every router's gate moved by one standard deviation of noise and 2% noise elsewhere: a
    weight update after which the same tokens route to other experts."""
    from checkpoints.hf import load_hf_checkpoint, save_hf_checkpoint

    cfg, state = load_hf_checkpoint(checkpoint)
    g = torch.Generator().manual_seed(seed)
    for name, t in state.items():
        if t.is_floating_point() and t.numel() > 1:
            scale = 1.0 if name.endswith("ffn.gate.weight") else 0.02
            state[name] = t + scale * t.std() * torch.randn(t.shape, generator=g)
    return save_hf_checkpoint(out, cfg, state, tokenizer_dir=checkpoint, weight_format="fp8", expert_dtype="fp4",
                              scale_fmt="ue8m0")


def forward(engine: RolloutEngine, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(routes int32 [len, layers, top_k], logprob of each next token [len - 1]) of a whole-sequence torch forward
    under the engine's current weights."""
    trace: list[dict] = []
    with torch.inference_mode():
        logits, _ = engine.model.full_torch(torch.tensor([tokens]), keep_cache=False, trace=trace)
    routes = torch.stack([t["router"][0] for t in trace], dim=1).to(torch.int32)
    logits = logits[0]
    lp = torch.log_softmax(logits[:-1].float(), -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return routes, lp


def experts(rows: torch.Tensor) -> torch.Tensor:
    return rows.sort(-1).values  # sets: the torch ops' top-k leaves the order unspecified


def test_a_retracted_request_keeps_the_routes_of_its_logprobs(tiny_base, tmp_path):
    noisy = write_rerouted_copy(tiny_base, tmp_path / "rerouted", seed=7)
    engine = RolloutEngine(tiny_base, EngineConfig(enable_return_routed_experts=True))
    try:
        started, seen = threading.Event(), [0]

        def progress(i, snapshot):  # scheduler thread: note how far the request got, never block it
            seen[0] = len(snapshot.output_ids)
            if seen[0] >= RETRACT_AFTER:
                started.set()

        prompt = [1, 17, 40, 3, 99, 5, 61]
        spec = RequestSpec(rid="r", input_ids=prompt, seed=3, return_routed_experts=True,
                           sampling=SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, ignore_eos=True))
        (future,) = engine.submit([spec], progress=progress)
        assert started.wait(120), "the request produced no tokens"
        engine.pause("retract")
        kept = seen[0]  # output tokens whose logprobs came from the old weights
        assert RETRACT_AFTER <= kept < NEW_TOKENS
        engine.update_weights_from_disk(noisy, weight_version="new")  # applies while paused, then resumes
        out = future.result(300)
        assert out.num_retractions == 1 and len(out.output_ids) == NEW_TOKENS

        tokens = out.input_ids + out.output_ids
        new_routes, new_lp = forward(engine, tokens)
        engine.update_weights_from_disk(tiny_base, weight_version="old")
        old_routes, old_lp = forward(engine, tokens)
    finally:
        engine.shutdown()

    rows = out.routed_experts
    assert rows.shape == (len(tokens) - 1, *old_routes.shape[1:])
    # row p routed the forward that gave token p + 1 its logprob: output token j (position P + j) got its logprob
    # from row P + j - 1, so the first P + kept - 1 rows belong to the old weights, the rest to the new
    split = len(prompt) + kept - 1
    assert torch.equal(experts(rows[:split]), experts(old_routes[:split]))
    assert torch.equal(experts(rows[split:]), experts(new_routes[split:-1]))
    assert not torch.equal(experts(old_routes[:split]), experts(new_routes[:split]))  # the re-prefill routed anew
    lp = torch.tensor(out.output_logprobs)
    assert (lp[:kept] - old_lp[len(prompt) - 1:split]).abs().max() < 1e-3  # the kept logprobs: old weights
    assert (lp[kept:] - new_lp[split:]).abs().max() < 1e-3
    assert (old_lp - new_lp).abs().max() > 1e-2  # the two weight sets do differ where it matters

    # the trainer gets the same rows, sample by sample (HTTPRollout's decode of SGLang's base64 field)
    import base64

    from engines.train.actors import HTTPRollout

    encoded = base64.b64encode(rows.numpy().tobytes()).decode()
    answer = type("Answer", (), {"routed_experts": encoded, "output_ids": out.output_ids})()
    decoded = HTTPRollout(client=None, routed_experts_top_k=rows.shape[-1])._routes(answer, len(prompt))
    assert torch.equal(decoded, rows)
