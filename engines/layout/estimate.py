"""Memory and communication estimates for a layout. Estimates, not measurements: the formulas are below.

Actor GPU of pipeline stage s (holding `n_s` layers; stage 0 adds the embedding, the last stage the head):
  local params   P = dense / TP + experts / (EP * ETP)               (vocab-parallel embedding/head: / TP)
  parameters     2 B * P (BF16)          gradients  4 B * P (fp32 main grads; 2 B without fp32 accumulation)
  optimizer      12 B (fp32 master + Adam m + v) per sharded param: dense / (DP*CP) + experts / EDP with the
                 distributed optimizer (all of P without it); `optimizer_offload` of it lives in host RAM
  activations    T tokens per micro-batch (max_tokens_per_gpu packed; the longest sample / CP per-sample); 1F1B keeps in_flight = min(PP - s, micro-batches)
                 in flight. full recompute: in_flight * n_s * (T * hc_mult * H * 2 B, the mHC residual streams,
                 / TP with SP) + 2 x one layer's full activations (recompute + backward working set);
                 selective: in_flight * n_s * (full - attention core); none: in_flight * n_s * full.
                 Per-token layer bytes: shape.activation_bytes_per_token; TP-sharded parts counted as / TP.
  logits         last stage: T * vocab / TP * 4 B * 2 (fp32 logits + their gradient, for log-probs/entropy)
  reserve        TrainSpec.reserve_gb (context, collective buffers, workspaces, fragmentation)
Host RAM per node (when offloading): gpus_per_node x the worst stage's offloaded Adam state + 64 GB (Ray, OS).

Rollout GPU (one SGLang engine = engine_tp GPUs): routed experts (FP8 1 B + fp32 128x128 block scales, or
FP4 0.5 B + UE8M0 per 32) / engine_tp (EP splits experts, moe_tp = TP/EP splits each one); FP8 dense linears
and BF16 rest / attention TP (engine_tp / engine_dp); embedding and head / engine_tp; KV pool = max_total_tokens
x kv_bytes_per_token / engine_dp (see shape.py: the single shared KV head is replicated over attention TP);
per-request state = max_running_requests x (sliding windows + compressor tails) / engine_dp.

Communication per optimizer step, bytes per GPU on the busiest stage (ring collectives move 2(g-1)/g of the
buffer): micro-batches M = global_batch x (prompt + response) / (DP x T x CP) packed, full-length samples (an
upper bound), or global_batch / DP per-sample. Passes: log-prob forward + training forward + full-recompute forward (if on) + backward (same volume).
  tp_allreduce   2 per layer per pass of T x H x 2 B          ep_alltoall  dispatch + combine, T x top_k x H x 2 B
  pp_sendrecv    T x hc_mult x H x 2 B per pass (x2 on middle stages)  cp_allgather  T x head_dim x 2 B per layer
  dp_grad_sync / edp_grad_sync   reduce-scatter of grads + all-gather of BF16 params over DP*CP / EDP
Seconds use the intra-node bandwidth when the group stays inside a node under Megatron's tp-cp-ep-dp-pp rank
order, the inter-node bandwidth otherwise; they only rank layouts against each other.
"""

from __future__ import annotations

import math

from engines.layout.shape import activation_bytes_per_token, embedding_params, kv_bytes_per_token, layer_params
from engines.layout.shape import request_state_bytes
from engines.layout.specs import GB, CommEstimate, LayoutInput, RolloutMemory, StageMemory

HOST_RESERVE_GB = 64.0
ADAM_BYTES = 12


def stage_params(inp: LayoutInput, stages: list[int]) -> list[tuple[float, float]]:
    """(dense, routed-expert) parameters held by one GPU of each stage."""
    m, p = inp.model, inp.parallel
    first, last = embedding_params(m)
    out, start = [], 0
    for s, n in enumerate(stages):
        lps = [layer_params(m, i) for i in range(start, start + n)]
        start += n
        dense = sum(lp.dense for lp in lps) + (first if s == 0 else 0) + (last if s == len(stages) - 1 else 0)
        out.append((dense / p.tp, sum(lp.experts for lp in lps) / (p.ep * p.expert_tp)))
    return out


def micro_batches(inp: LayoutInput, dp: int) -> int:
    """Micro-batches per DP rank per optimizer step: packed with all samples at full length (an upper bound),
    or one per sample."""
    t = inp.train
    if t.micro_batching == "per-sample":
        return max(1, math.ceil(t.global_batch / dp))
    return max(1, math.ceil(t.global_batch * t.sample_tokens / (dp * t.max_tokens_per_gpu * inp.parallel.cp)))


def actor_memory(inp: LayoutInput, stages: list[int], dp: int, edp: int) -> list[StageMemory]:
    """Per-stage device memory of one actor GPU (module docstring for the formulas)."""
    m, p, t = inp.model, inp.parallel, inp.train
    T, grad_bytes = t.micro_batch_tokens(p.cp), 4 if t.fp32_grads else 2
    boundary = T * m.hc_mult * m.hidden_size * 2 / (p.tp if p.sp else 1)
    out, start = [], 0
    for s, ((dense, experts), n) in enumerate(zip(stage_params(inp, stages), stages)):
        local = dense + experts
        shard = dense / (dp * p.cp) + experts / edp if t.distributed_optimizer else local
        optimizer = ADAM_BYTES * shard
        per_tok = [activation_bytes_per_token(m, i) for i in range(start, start + n)]
        start += n
        in_flight = max(1, min(p.pp - s, micro_batches(inp, dp)))
        one_layer = max(full for full, _ in per_tok) * T / p.tp
        if t.recompute == "full":
            act = in_flight * n * boundary + 2 * one_layer
        elif t.recompute == "selective":
            act = in_flight * sum(full - core for full, core in per_tok) * T / p.tp + 2 * one_layer
        else:
            act = in_flight * sum(full for full, _ in per_tok) * T / p.tp + one_layer
        logits = T * m.vocab_size / p.tp * 4 * 2 if s == len(stages) - 1 else 0.0
        out.append(StageMemory(stage=s, layers=n, params=2 * local / GB, grads=grad_bytes * local / GB,
                               optimizer=(1 - t.optimizer_offload) * optimizer / GB,
                               optimizer_host=t.optimizer_offload * optimizer / GB, activations=act / GB,
                               logits=logits / GB, reserve=t.reserve_gb))
    return out


def host_memory_per_node(inp: LayoutInput, stages: list[StageMemory]) -> float:
    """Host RAM one actor node needs for offload: every GPU's offloaded Adam state (worst stage) + a reserve.

    0 when nothing is offloaded (the planner then does not check host memory).
    """
    worst = max((s.optimizer_host for s in stages), default=0.0)
    return inp.cluster.gpus_per_node * worst + HOST_RESERVE_GB if worst else 0.0


def rollout_memory(inp: LayoutInput) -> RolloutMemory:
    """Device memory of one SGLang GPU (module docstring for the formulas)."""
    m, r = inp.model, inp.rollout
    lps = [layer_params(m, i) for i in range(m.num_layers)]
    fp8, other, experts = (sum(lp.fp8 for lp in lps), sum(lp.other for lp in lps), sum(lp.experts for lp in lps))
    first, last = embedding_params(m)
    expert_bytes = 1 + 4 / (128 * 128) if r.expert_format == "fp8" else 0.5 + 1 / 32
    attn_tp = max(r.engine_tp // max(r.engine_dp, 1), 1)
    weights = experts * expert_bytes / r.engine_tp + (fp8 * (1 + 4 / (128 * 128)) + 2 * other) / attn_tp
    weights += 2 * (first + last) / r.engine_tp
    per_token = kv_bytes_per_token(m, r.kv_bytes_per_elem)
    kv = r.max_total_tokens * per_token / max(r.engine_dp, 1)
    state = r.max_running_requests * request_state_bytes(m, r.kv_bytes_per_elem) / max(r.engine_dp, 1)
    return RolloutMemory(weights=weights / GB, kv_cache=kv / GB, request_state=state / GB, reserve=r.reserve_gb,
                         kv_bytes_per_token=per_token)


def _ring(group: int) -> float:
    return 2 * (group - 1) / group if group > 1 else 0.0


def communication(inp: LayoutInput, stages: list[int], dp: int, edp: int) -> CommEstimate:
    """Bytes and seconds per optimizer step for one GPU of the busiest stage (module docstring)."""
    m, c, p, t = inp.model, inp.cluster, inp.parallel, inp.train
    T, L, etp = t.micro_batch_tokens(p.cp), max(stages), p.expert_tp
    micro = micro_batches(inp, dp)
    passes = 2 + (1 if t.recompute == "full" else 0) + 1
    act = T * m.hidden_size * 2
    dense, experts = max(stage_params(inp, stages), key=lambda de: de[0] + de[1])
    grad_bytes = (4 if t.fp32_grads else 2) + 2
    moved = {
        "tp_allreduce": passes * micro * L * 2 * act * _ring(p.tp),
        "ep_alltoall": passes * micro * L * 2 * act * m.top_k * (p.ep - 1) / p.ep,
        "pp_sendrecv": (passes * micro * T * m.hc_mult * m.hidden_size * 2 * (2 if p.pp > 2 else 1)
                        if p.pp > 1 else 0.0),
        "cp_allgather": passes * micro * L * T * m.head_dim * 2 * (p.cp - 1),
        "dp_grad_sync": dense * grad_bytes * _ring(dp * p.cp) / 2,
        "edp_grad_sync": experts * grad_bytes * _ring(edp) / 2,
    }
    gpn = c.gpus_per_node if c.actor_nodes > 1 else c.actor_world

    def crosses(stride: int, size: int) -> bool:
        return size > 1 and stride * size > gpn

    spans = {"tp_allreduce": crosses(1, p.tp), "ep_alltoall": crosses(etp, p.ep),
             "pp_sendrecv": crosses(p.tp * p.cp * dp, p.pp), "cp_allgather": crosses(p.tp, p.cp),
             "dp_grad_sync": crosses(p.tp, p.cp * dp), "edp_grad_sync": crosses(etp * p.ep, edp)}
    seconds = {k: v / ((c.inter_node_gbps if spans[k] else c.intra_node_gbps) * GB) for k, v in moved.items()}
    return CommEstimate(bytes=moved, seconds=seconds, cross_node=tuple(k for k, v in spans.items() if v and moved[k]),
                        micro_batches=micro)
