"""Miles' OWN DeepSeek-V4 Megatron model loads what v4rl converts and computes what v4rl computes, on CPU, for
both Miles generations: `gen1` (Miles main 31f1ca961 + Megatron-LM 2e64d788b, the plugin's names) and
`gen2-miles` (Miles e9e19b223 + Megatron-LM 6184c094a, Megatron's names, `--dsv4-impl miles`) in the default run;
`gen2-megatron` (`--dsv4-impl megatron --dsa-kernel-backend none`, Megatron's own PyTorch path) is `slow`.

Per generation one probe subprocess (engines/upstream/miles_model_check.py; ~2-4 min on 2 cores) builds Miles' model
through its model provider and `--spec` for a Miles-legal tiny config (tests/conformance/miles_model_harness.py),
and on the checkpoint v4rl's converter wrote: (a) the model's sharded_state_dict keys, global shapes and dtypes; (b) Miles'
own `load_checkpoint` after a sentinel fill, for the `release` and the numbered (`iter_0000020`) layout; (c) one
forward with per-layer sub-block outputs, then five forwards each with one planted fault. v4rl's own model runs
the same tokens in fp32 and bf16; Miles must agree with v4rl-fp32 within bounds derived from v4rl's bf16 noise,
and each fault must be named at its layer and block by v4rl's align Localisation.

    .venv/bin/python -m pytest tests/conformance/test_miles_model.py -q
"""

from __future__ import annotations

import pytest
import torch

from engines.upstream.miles_model_check import compare_keys
from engines.align.model_compare import compare_logprobs, compare_traces, ours_forward

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


KEYS = {"gen1": (118, 57), "gen2-miles": (134, None), "gen2-megatron": (134, None)}
"""Tensor keys and TE `_extra_state` objects Miles' tiny model asks for (conformance C1, C5)."""


@pytest.fixture(scope="module", params=["gen1", "gen2-miles", pytest.param("gen2-megatron", marks=pytest.mark.slow)])
def miles_run(request, tmp_path_factory, sglang_paths):
    """One generation's probe run: keys, the two loads, the clean and the faulty forwards."""
    from miles_model_harness import probe_generation

    if request.param == "gen1":
        miles, megatron, generation, impl = (request.getfixturevalue("miles_tree"),
                                             request.getfixturevalue("megatron_tree"), 1, None)
    else:
        miles, megatron, generation, impl = (request.getfixturevalue("miles_gen2_tree"),
                                             request.getfixturevalue("megatron_gen2_tree"), 2,
                                             request.param.split("-")[1])
    run = probe_generation(tmp_path_factory.mktemp(f"miles-model-{request.param}"), generation=generation,
                           impl=impl, miles_dir=miles, megatron_dir=megatron)
    run.label = request.param
    return run


@pytest.fixture(scope="module")
def ours(miles_run):
    """v4rl's own model on the same tokens: (fp32 trace, fp32 logits, bf16 trace, bf16 logits)."""
    from engines.align.score import load_ours

    fp32 = ours_forward(load_ours(miles_run.hf_dir, torch.float32), miles_run.tokens)
    bf16 = ours_forward(load_ours(miles_run.hf_dir, torch.bfloat16), miles_run.tokens)
    return (*fp32, *bf16)


def _report(run, name: str, obj: dict) -> None:
    """With $V4RL_MILES_MODEL_REPORT set, keep the measured numbers (README "Megatron conformance") there."""
    import json
    import os
    from pathlib import Path

    where = os.environ.get("V4RL_MILES_MODEL_REPORT")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        (Path(where) / f"{run.label}-{name}.json").write_text(json.dumps(obj, indent=1, default=str))


def test_keys_shapes_and_dtypes_equal_the_converter_output(miles_run):
    result = miles_run.result
    comparison = compare_keys(result.keys, miles_run.expected_keys)
    assert comparison.vocab_padded == ["embedding.word_embeddings.weight: model [512, 128] vs checkpoint [500, 128]",
                                       "output_layer.weight: model [512, 128] vs checkpoint [500, 128]"]
    assert comparison.ok, comparison.problems()  # Megatron's vocab padding aside, keys, shapes and dtypes equal
    keys, objects = KEYS[miles_run.label]
    assert len(result.keys) == keys and len(result.extra_state_objects) in (objects, len(result.extra_state_objects))
    assert all("_extra_state" in k for k in result.extra_state_objects)


def test_key_comparison_fails_on_a_renamed_key_and_a_wrong_tid2eid_shape(miles_run):
    renamed = dict(miles_run.expected_keys)
    key = sorted(k for k in renamed if k.startswith("decoder.layers.1.self_attention."))[0]
    renamed[key + "s"] = renamed.pop(key)
    bad = compare_keys(miles_run.result.keys, renamed)
    assert bad.missing == [key] and bad.unexpected == [key + "s"]
    assert any("will skip" in p for p in bad.problems())
    shape = dict(miles_run.expected_keys)
    key = "decoder.layers.0.mlp.router.tid2eid"
    shape[key] = [[shape[key][0][0], shape[key][0][1] + 1], shape[key][1]]
    assert compare_keys(miles_run.result.keys, shape).shape == [f"{key}: model [500, 2] vs checkpoint [500, 3]"]


@pytest.mark.parametrize("layout", ["release", "iter_0000020"])
def test_miles_load_checkpoint_loads_every_parameter(miles_run, layout):
    load = miles_run.result.loads[0 if layout == "release" else 1]
    assert load["dir"] == str(miles_run.release_root if layout == "release" else miles_run.numbered_root)
    assert load["will_skip"] == [] and load["at_sentinel"] == []
    # Megatron pads the vocab (500 -> 512 = --make-vocab-size-divisible-by 128 x TP 1): only the 12 pad rows of
    # the embedding and the output layer are not in the file (they load as zeros, never as the sentinel)
    assert load["partly_at_sentinel"] == {}
    assert load["loaded_params"] > 100


def test_forward_agrees_with_v4rl_layer_by_layer_and_in_logprobs(miles_run, ours):
    assert not miles_run.result.forward_error, miles_run.result.forward_error
    t32, l32, t16, l16 = ours
    clean = torch.load(miles_run.result.forwards["clean"])
    loc = compare_traces(clean["trace"], t32, t16, miles_run.cfg.mlp_layer_types)
    assert loc.first_divergence is None, loc.first_divergence
    logits = clean["logits"][..., :miles_run.cfg.vocab_size]
    lp = compare_logprobs(logits, l32, l16, miles_run.tokens)
    _report(miles_run, "clean", {"logprobs": lp, "per_layer": loc.per_layer})
    assert lp["within_bound"], lp
    assert lp["mean"] < 3 * lp["bf16_noise_mean"] + 1e-3


@pytest.mark.parametrize("fault", ["hash_table_shifted", "mhc_alpha_order", "compressor_ape", "indexer_weights",
                                   "attention_sink"])
def test_planted_faults_are_localised_to_their_layer_and_block(miles_run, ours, fault):
    assert not miles_run.result.forward_error, miles_run.result.forward_error
    t32, _, t16, _ = ours
    expected = dict((f["name"], where) for f, where in miles_run.faults)[fault]
    traced = torch.load(miles_run.result.forwards[fault])
    loc = compare_traces(traced["trace"], t32, t16, miles_run.cfg.mlp_layer_types)
    _report(miles_run, fault, {"first_divergence": loc.first_divergence})
    assert loc.first_divergence is not None, f"{fault} went unnoticed"
    assert (loc.first_divergence["layer"], loc.first_divergence["block"]) == expected, loc.first_divergence


def test_vocab_pad_rows_enter_miles_logprobs(miles_run):
    """Megatron pads the vocab to --make-vocab-size-divisible-by x TP; the pad rows load as zeros, so their logit
    is exactly 0 and Miles' own logprob function (over the padded width) counts them in the softmax."""
    assert not miles_run.result.forward_error, miles_run.result.forward_error
    clean = torch.load(miles_run.result.forwards["clean"])
    logits, vocab = clean["logits"], miles_run.cfg.vocab_size
    assert logits.shape[-1] == 512 and torch.equal(logits[..., vocab:], torch.zeros_like(logits[..., vocab:]))
    real = torch.log_softmax(logits[0, :-1, :vocab].double(), -1).gather(-1, miles_run.tokens[0, 1:, None]).squeeze(-1)
    padded = torch.log_softmax(logits[0, :-1].double(), -1).gather(-1, miles_run.tokens[0, 1:, None]).squeeze(-1)
    shift = (real - padded).abs().mean().item()
    assert shift > 1e-3  # 12 zero logits among ~0-valued ones: visible
    if "miles_logprobs" in clean:  # Miles' own calculate_log_probs_and_entropy agrees with the padded softmax
        assert torch.allclose(clean["miles_logprobs"].double().flatten(), padded, atol=1e-4)
