"""The divisibility and sizing rules a layout must pass; each rejection names its rule id and the fix.

Rejections (memory ones live in engines/layout/__init__.py):
  world-dense     actor world % (TP*PP*CP) == 0; DP = world / (TP*PP*CP)
  world-expert    actor world % (ETP*EP*PP) == 0; EDP = world / (ETP*EP*PP). MoE parallel folding: the expert
                  grid is laid over the same ranks, EP formed from the TP x CP x DP ranks of a pipeline stage,
                  so EP may exceed DP (TP8 PP8 EP8 on 64 GPUs is legal with DP = 1)
  heads-tp        attention heads % TP == 0       experts-ep   routed experts % EP == 0
  moe-ffn-etp     moe_intermediate % ETP == 0     sp-needs-tp  --sequence-parallel needs TP > 1
  pp-layer-split  the stages cover every layer: layers % PP == 0 without first/last sizes, otherwise the middle
                  stages share the rest evenly (megatron-core's uneven-PP rule)
  batch-steps / batch-dp   rollout_batch * n_samples % steps == 0; the global batch % DP == 0
  sample-fits     packed micro-batches: max_tokens_per_gpu * CP >= the longest sample (prompt + response)
  cluster-nodes   rollout nodes < nodes (0 = colocated)
  rollout-*       SGLang: rollout GPUs % engine GPUs, engine TP % EP and % DP (moe_tp = TP / EP), experts % EP,
                  heads % attention TP, context >= prompt + response, max_total_tokens >= one request
Warnings: o-groups-tp, sp-with-ep, cp-allgather, recompute, rollout-multinode, rollout-kv-tokens.

Sources: megatron-core 0.16 `parallel_state.initialize_model_parallel` (the two world rules),
`TransformerConfig.__post_init__` (heads % TP, uneven PP split), `MoELayer` (experts % EP),
`ModelParallelConfig` (SP needs TP; EP with TP wants SP); Miles (global batch = rollout batch * n_samples /
steps, packed micro-batches of --max-tokens-per-gpu, --allgather-cp for DeepSeek-V4); SGLang server args.
"""

from __future__ import annotations

import math

from engines.layout.specs import LayoutInput

def balanced_stages(num_layers: int, pp: int) -> tuple[int | None, int | None]:
    """(first, last) stage sizes that cover the layers with the smallest largest stage (None = not needed).

    Ties prefer the most even split, then fewer overrides; 43 layers on PP4 give (None, 10) = the seed's
    11+11+11+10, on PP8 (4, 3) = 4+6*6+3.
    """
    if num_layers % pp == 0:
        return None, None
    options = []
    for mid in range(1, num_layers + 1):
        last = num_layers - mid * (pp - 1)
        if last > 0:
            options.append((max(mid, last), max(mid, last) - min(mid, last), 1, None, last))
        rest = num_layers - mid * (pp - 2)
        if pp > 2 and rest >= 2:
            first = math.ceil(rest / 2)
            stages = (mid, first, rest - first)
            options.append((max(stages), max(stages) - min(stages), 2, first, rest - first))
    if not options:
        return None, None
    _, _, _, first, last = min(options)
    return first, last


def pipeline_split(num_layers: int, pp: int, first: int | None, last: int | None) -> tuple[list[int], str | None]:
    """Layers per stage as megatron-core assigns them, or ([], reason) when the stages cannot cover the model."""
    middle_layers, middle_stages = num_layers, pp
    for given in (first, last):
        if given is not None:
            if given <= 0:
                return [], f"[pp-layer-split] a first/last stage size must be > 0 (got {given}); fix: drop it."
            middle_layers -= given
            middle_stages -= 1
    good_first, good_last = balanced_stages(num_layers, pp)
    flags = " ".join(f"--pp-{name} {v}" for name, v in (("first", good_first), ("last", good_last)) if v)
    fix = (f"fix: --pp {pp} {flags}" if flags else f"fix: drop --pp-first/--pp-last ({num_layers} % {pp} == 0)")
    if pp > num_layers:
        fix = f"fix: PP at most {num_layers}"
    if middle_stages < 0:
        return [], f"[pp-layer-split] PP={pp} has no room for both a first and a last stage; {fix}."
    if middle_layers < 0 or bool(middle_layers) != bool(middle_stages) or (
            middle_stages and middle_layers % middle_stages):
        return [], (f"[pp-layer-split] {pp} stages (first={first}, last={last}) do not cover the {num_layers} "
                    f"layers: {middle_layers} layers left for {middle_stages} middle stages; {fix}.")
    mid = [middle_layers // middle_stages] * middle_stages if middle_stages else []
    return ([first] if first is not None else []) + mid + ([last] if last is not None else []), None


def check_rules(inp: LayoutInput) -> tuple[list[str], list[str], int, int, list[int]]:
    """(reasons, warnings, DP, EDP, layers per stage) for the actor side and the batch; rollout via check_rollout."""
    m, c, p, t = inp.model, inp.cluster, inp.parallel, inp.train
    reasons: list[str] = []
    warnings: list[str] = []
    world, etp = c.actor_world, p.expert_tp
    if not c.colocated and c.rollout_nodes >= c.nodes:
        reasons.append(f"[cluster-nodes] {c.rollout_nodes} rollout nodes leave no actor node out of {c.nodes}; "
                       "fix: lower --rollout-nodes below --nodes (0 colocates rollout and actor).")
    dense = p.tp * p.pp * p.cp
    if world % dense:
        reasons.append(f"[world-dense] TP*PP*CP = {p.tp}*{p.pp}*{p.cp} = {dense} does not divide the actor world "
                       f"of {world} GPUs ({c.actor_nodes} nodes x {c.gpus_per_node}); fix: pick sizes whose "
                       f"product divides {world} (TP*CP*PP in {_divisors(world)}), or change the actor node count.")
    expert = etp * p.ep * p.pp
    if world % expert:
        good = [e for e in _divisors(world) if world % (etp * p.pp * e) == 0 and m.n_routed_experts % e == 0]
        reasons.append(f"[world-expert] ETP*EP*PP = {etp}*{p.ep}*{p.pp} = {expert} does not divide the actor world "
                       f"of {world} GPUs (MoE parallel folding lays the expert grid over the same ranks); fix: "
                       + (f"EP in {good}." if good else "a PP/ETP that divides the world, then a matching EP."))
    dp, edp = max(world // dense, 1), max(world // expert, 1)
    if m.num_heads % p.tp:
        reasons.append(f"[heads-tp] TP={p.tp} does not divide the {m.num_heads} attention heads; fix: TP in "
                       f"{[d for d in (1, 2, 4, 8, 16) if m.num_heads % d == 0]}.")
    if m.n_routed_experts % p.ep:
        reasons.append(f"[experts-ep] EP={p.ep} does not divide the {m.n_routed_experts} routed experts; fix: EP "
                       f"in {[d for d in (1, 2, 4, 8, 16, 32, 64) if m.n_routed_experts % d == 0]}.")
    if m.moe_intermediate_size % etp:
        reasons.append(f"[moe-ffn-etp] ETP={etp} does not divide moe_intermediate_size {m.moe_intermediate_size}; "
                       "fix: --etp 1.")
    if p.tp > m.o_groups or m.o_groups % p.tp:
        warnings.append(f"[o-groups-tp] TP={p.tp} splits the {m.o_groups} output-projection groups; Miles' "
                        "DeepSeek-V4 attention has only been run with TP dividing o_groups.")
    stages, why = pipeline_split(m.num_layers, p.pp, p.first_stage_layers, p.last_stage_layers)
    if why:
        reasons.append(why)
    if p.sp and p.tp == 1:
        reasons.append("[sp-needs-tp] --sequence-parallel needs TP > 1; fix: drop it or raise --tp.")
    if p.ep > 1 and p.tp > 1 and not p.sp:
        warnings.append("[sp-with-ep] EP with TP > 1 needs --sequence-parallel (megatron-core warns).")
    if p.cp > 1:
        warnings.append("[cp-allgather] DeepSeek-V4 has no zigzag CP path in Miles: pass --allgather-cp.")
    if (t.rollout_batch_size * t.n_samples_per_prompt) % t.num_steps_per_rollout:
        reasons.append(f"[batch-steps] rollout_batch x n_samples = {t.rollout_batch_size * t.n_samples_per_prompt} "
                       f"samples do not split into {t.num_steps_per_rollout} optimizer steps; fix: make "
                       "--num-steps-per-rollout divide it.")
    elif t.global_batch % dp:
        reasons.append(f"[batch-dp] the global batch of {t.global_batch} samples does not split over DP={dp}; fix: "
                       "a rollout batch x n_samples (per step) that DP divides, or a layout with another DP.")
    if t.micro_batching == "packed" and t.max_tokens_per_gpu * p.cp < t.sample_tokens:
        reasons.append(f"[sample-fits] a full sample ({t.max_prompt_len} prompt + {t.max_response_len} response "
                       f"tokens) exceeds max_tokens_per_gpu x CP = {t.max_tokens_per_gpu * p.cp}; fix: raise "
                       "--max-tokens-per-gpu or --cp.")
    if t.recompute == "none" and p.pp > 1:
        warnings.append("[recompute] no activation recompute with PP > 1 keeps PP micro-batches of activations.")
    check_rollout(inp, reasons, warnings)
    return reasons, warnings, dp, edp, stages


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_rollout(inp: LayoutInput, reasons: list[str], warnings: list[str]) -> None:
    """Append the SGLang-side rejections/warnings: engine shapes, context and KV-pool sizes."""
    m, c, r, t = inp.model, inp.cluster, inp.rollout, inp.train
    if c.rollout_gpus % r.engine_tp:
        reasons.append(f"[rollout-engines] {c.rollout_gpus} rollout GPUs do not hold whole engines of "
                       f"{r.engine_tp} GPUs; fix: an engine TP that divides {c.rollout_gpus}.")
    if r.engine_tp % r.engine_ep or r.engine_tp % r.engine_dp:
        reasons.append(f"[rollout-tp-ep] SGLang needs engine TP ({r.engine_tp}) divisible by EP ({r.engine_ep}) "
                       f"and DP ({r.engine_dp}) (moe_tp = tp / ep); fix: --sglang-ep-size dividing the TP.")
    if m.n_routed_experts % r.engine_ep:
        reasons.append(f"[rollout-experts-ep] SGLang EP={r.engine_ep} does not divide {m.n_routed_experts} experts; "
                       "fix: a power-of-two EP.")
    if r.engine_dp <= r.engine_tp and m.num_heads % max(r.engine_tp // r.engine_dp, 1):
        reasons.append(f"[rollout-heads-tp] attention TP {r.engine_tp // r.engine_dp} does not divide "
                       f"{m.num_heads} heads; fix: lower --sglang-tp-size or raise --sglang-dp-size.")
    if r.engine_tp > c.gpus_per_node:
        warnings.append(f"[rollout-multinode] an engine of {r.engine_tp} GPUs spans nodes (SGLang --nnodes).")
    if r.context_length < t.sample_tokens:
        reasons.append(f"[rollout-context] context length {r.context_length} < prompt {t.max_prompt_len} + response "
                       f"{t.max_response_len}; SGLang rejects longer requests; fix: raise --context-length.")
    if r.max_total_tokens < r.context_length:
        reasons.append(f"[rollout-kv-tokens] max_total_tokens {r.max_total_tokens} cannot hold one request of "
                       f"{r.context_length} tokens; fix: raise --sglang-max-total-tokens.")
    elif r.max_total_tokens < r.max_running_requests * t.sample_tokens:
        warnings.append(f"[rollout-kv-tokens] {r.max_running_requests} running requests of up to "
                        f"{t.sample_tokens} tokens exceed the {r.max_total_tokens}-token pool; SGLang will retract.")
