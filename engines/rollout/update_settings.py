"""SGLang settings v4rl sets on every rollout engine it starts so that an online weight update reproduces a fresh
load: the environment of `launcher.launch_env` (v4rl's own SGLang servers) and of the Miles job
(`engines/miles/env.py`, every rank, SGLang engines included).

SGLANG_OPT_FP8_WO_A_GEMM (SGLang 0.5.23 default 1) keeps the attention's grouped output projection `wo_a` in FP8 and
runs it as one absorbed GEMM. Its post-load step (`DeepseekV4ForCausalLM._setup_fp8_wo_a_scales`) reshapes
`wo_a.weight_scale_inv` to [groups, o_lora_rank/128, in/128] (CUDA: DeepGEMM's layout; ROCm: aiter's UE8M0 byte
scales, the weight re-quantized when its scales are not powers of two) and `restore_weights_before_loading` never
puts it back, so the next `load_weights` of an online update reads into a parameter of another shape (conformance
C9: `[2,1,1]` vs `[2,1]` on CPU). It also needs `o_lora_rank` to be a multiple of the 128-wide FP8 block, or the
FIRST load fails (`shape '[2, 0, 1]' is invalid`: tiny-cpu's o_lora_rank is 64; C8). With 0 SGLang dequantizes wo_a
to BF16 at load and post-processing is an identity there, which round-trips (C9; the distributed path needs wo_a's
scale under `.wo_a.scale`, which `launcher.sglang_named_tensors` sends). Miles' own CUDA launcher sets 0 as
well (`scripts/run_deepseek_v4.py`: "SGLANG_OPT_FP8_WO_A_GEMM": "0"); its AMD launcher (and the seed's PR-branch
one) leaves SGLang's default, running on Miles' `sglang-miles` branch.

    env.update(wo_a_gemm_env(o_lora_rank))   # {"SGLANG_OPT_FP8_WO_A_GEMM": "0"} while the default cannot round-trip
"""

from __future__ import annotations

WO_A_GEMM_VAR = "SGLANG_OPT_FP8_WO_A_GEMM"
FP8_BLOCK = 128
"""SGLang's FP8 block edge (weight_block_size [128, 128]); the fp8 wo_a GEMM needs o_lora_rank to be a multiple."""

DEFAULT_WO_A_ROUND_TRIPS = False
"""Whether SGLang's default fp8 wo_a path reproduces a fresh load after an online update. False for SGLang 0.5.23,
measured on CPU by the SGLang model conformance suite (conformance C9; restore -> load -> post-process leaves
wo_a.weight_scale_inv reshaped). Turn True only when that suite passes the default mode on a new pin; then only
models whose o_lora_rank is not a multiple of 128 get the variable."""


def wo_a_gemm_off_reason(o_lora_rank: int | None) -> str | None:
    """Why the engine must run with SGLANG_OPT_FP8_WO_A_GEMM=0 (None: SGLang's default is safe for this model)."""
    if o_lora_rank is not None and o_lora_rank % FP8_BLOCK:
        return (f"o_lora_rank {o_lora_rank} is not a multiple of SGLang's {FP8_BLOCK}-wide FP8 block, so the default "
                "fp8 wo_a GEMM fails the first load (_setup_fp8_wo_a_scales)")
    if not DEFAULT_WO_A_ROUND_TRIPS:
        return ("SGLang's default fp8 wo_a path reshapes wo_a.weight_scale_inv after loading and never restores it, "
                "so an online weight update does not reproduce a fresh load (conformance C9)")
    return None


def wo_a_gemm_env(o_lora_rank: int | None) -> dict[str, str]:
    """The SGLANG_OPT_FP8_WO_A_GEMM setting for a model with this o_lora_rank (None: not known here)."""
    return {WO_A_GEMM_VAR: "0"} if wo_a_gemm_off_reason(o_lora_rank) else {}
