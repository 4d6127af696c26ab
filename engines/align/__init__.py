"""Train-vs-rollout alignment: the seed's token-identical comparison, plus where a mismatch starts.

Our rollout engine (FP8 checkpoint) generates once; the trainer (torch_dist via megatron-core, BF16) and
transformers' reference rescore exactly those tokens; per-token |Δlogprob| statistics overall and by
response position; then both implementations run the same tokens layer by layer in fp32 and the report
names the first layer and sub-block (attention, mhc, router, moe) where they part.

    v4rl align --model ckpt/hf-fp8 --torch-dist ckpt/torch_dist --prompts 32 --json align.json
    # exit 0: passed; 1: over a threshold (or a diverging sub-block); 2: bad input

    from engines.align import AlignConfig, align
    report = align("ckpt/hf-fp8", "ckpt/torch_dist", AlignConfig(n_prompts=32))

Report (JSON):
    passed              bool: every threshold holds (and no sub-block diverges, unless disabled)
    failures            [str]: why not
    token_abs_diff      {"mean", "p50", "p99", "max"} of |rollout lp - trainer lp| over response tokens
    by_position         {"bucket", "mean": [float|null per response position], "tokens": [int]}
    pairs               the same statistics for rollout_vs_trainer, rollout_vs_reference, trainer_vs_reference
    first_divergence    null or {"layer", "block": attention|mhc|router|moe, "sub_block": attention|mhc_attn|
                        router|moe|mhc_ffn, "metric", "value", "tolerance", "first_position"}
    per_layer           [{"layer", "hash_routed", "attention"|"mhc_attn"|"moe"|"mhc_ffn": {"max_rel",
                        "mean_rel", "max_abs", "tokens_over_tol", "non_finite_tokens", "tokens", "first_position",
                        "diverged"},
                        "router": {"mismatch_frac", "mismatched_tokens", "tokens", "first_position", "diverged"}}]
    thresholds          {"mean", "p99", "max", "layer_rel_tol", "router_tol", "fail_on_divergence"}
    n_prompts, n_sequences, n_empty_responses, n_tokens, finish_reasons, engines, localisation, config,
    inputs, seconds

Tests plant the seed's two bugs in our engine (tests/planted.py, by monkeypatch) and check the report names them.
"""

from engines.align.inputs import AlignError, Rollout, generate, held_out_prompts, load_torch_dist
from engines.align.layerwise import BLOCK_OF, SUB_BLOCKS, Localisation, localise
from engines.align.report import AlignConfig, align

__all__ = ["AlignConfig", "AlignError", "BLOCK_OF", "Localisation", "Rollout", "SUB_BLOCKS", "align", "generate",
           "held_out_prompts", "load_torch_dist", "localise"]
