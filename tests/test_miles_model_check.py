"""engines/upstream/miles_model_check.py without Miles: the key comparison and Megatron's vocab padding rule (the
probe runs of Miles' own model are in tests/conformance/test_miles_model*.py).

    .venv/bin/python -m pytest tests/test_miles_model_check.py -q
"""

from __future__ import annotations

from engines.upstream.miles_model_check import compare_keys, padded_vocab

MODEL = {"decoder.layers.0.self_attention.wq_a.weight": [[8, 4], "bfloat16"],
         "decoder.layers.0.mlp.router.tid2eid": [[10, 2], "int32"]}


def test_equal_key_sets_are_ok():
    assert compare_keys(MODEL, dict(MODEL)).ok


def test_a_renamed_key_is_missing_and_unexpected_with_the_fix():
    ckpt = {"decoder.layers.0.self_attention.linear_q_down_proj.weight": [[8, 4], "bfloat16"],
            "decoder.layers.0.mlp.router.tid2eid": [[10, 2], "int32"]}
    c = compare_keys(MODEL, ckpt)
    assert c.missing == ["decoder.layers.0.self_attention.wq_a.weight"]
    assert c.unexpected == ["decoder.layers.0.self_attention.linear_q_down_proj.weight"]
    problems = c.problems(fix="convert with --miles-dir")
    assert "will skip" in problems[0] and problems[-1] == "fix: convert with --miles-dir"


def test_shape_and_dtype_differences_are_named():
    ckpt = {**MODEL, "decoder.layers.0.mlp.router.tid2eid": [[10, 3], "int64"]}
    c = compare_keys(MODEL, ckpt)
    assert c.shape == ["decoder.layers.0.mlp.router.tid2eid: model [10, 2] vs checkpoint [10, 3]"]
    assert c.dtype == ["decoder.layers.0.mlp.router.tid2eid: model int32 vs checkpoint int64"]
    assert not c.ok


def test_vocab_padding_rows_are_not_a_shape_failure():
    model = {"embedding.word_embeddings.weight": [[512, 8], "bfloat16"], "output_layer.weight": [[512, 8], "bfloat16"]}
    c = compare_keys(model, {k: [[500, 8], "bfloat16"] for k in model})
    assert c.ok and len(c.vocab_padded) == 2
    assert not compare_keys(model, {k: [[520, 8], "bfloat16"] for k in model}).ok  # more rows than the model: bad


def test_megatron_vocab_padding():
    assert padded_vocab(129280, 1) == 129280  # Flash at TP 1: no pad rows
    assert padded_vocab(129280, 4) == 129536 and padded_vocab(129280, 8) == 130048
    assert padded_vocab(129280, 4, divisible_by=64) == 129280  # the divisor that removes them at TP 4
    assert padded_vocab(500, 1) == 512


def test_the_job_passes_a_vocab_divisor_only_where_megatron_would_pad():
    from engines.presets.runs import get_run_preset
    from engines.miles.train_args import padded_vocab, vocab_args, vocab_divisor

    assert vocab_divisor(129280, 4) == 64 and vocab_divisor(129280, 8) == 32 and vocab_divisor(500, 1) == 4
    for tp in (1, 2, 4, 8):
        assert padded_vocab(129280, tp, vocab_divisor(129280, tp)) == 129280
    seed, wide = get_run_preset("dsv4-flash-mi355x"), get_run_preset("dsv4-flash-mi355x-32gpu")
    assert seed.parallel.tp == 1 and vocab_args(seed, 129280) == []  # as Miles' launcher: nothing to pad
    assert wide.parallel.tp == 4 and vocab_args(wide, 129280) == ["--make-vocab-size-divisible-by", "64"]
