"""`v4rl bench rollout --config-sweep --json OUT`: our rollout engine against transformers `generate` on several
DeepSeek-V4 shapes, not only tiny-cpu, at 1 thread and at torch's default thread count.

Each case is a random DeepSeek-V4 checkpoint (FP8 + FP4 experts, as `v4rl bootstrap` writes them) that both
sides load from the same directory: our engine through its HTTP server (SGLang's /generate, RAW logprobs
returned), transformers' `DeepseekV4ForCausalLM.from_pretrained(...).generate` (do_sample, its DeepSeek-V4
cache), fp32, the same batch of random prompts, temperature 1, EOS ignored so both produce batch x new_tokens
tokens. Within a thread setting the two alternate `repeats` times (the machine may be shared): the speedup
is the median of the per-pair ratios; tok/s is each side's best run. Both compute on a worker thread of this
process with the same intra-op thread setting.

The cases cover hidden 128-512, index top-k 4-64, 8-64 routed experts (top-2 to top-6), every layer type
(sliding, CSA, HCA), hash and top-k MoE, and compress rates 4/128 (what SGLang accepts) plus one case at
8/32. Prompts are longer than the HCA rate, so every compressed branch has entries while decoding, and
longer than CSA rate x (index top-k + 1), so the indexer really selects.

Per case, `decode_step` says where a step's time goes at 1 thread (bench/decode_profile.py, as in
bench/rollout.py's breakdown: aten ops dispatched, wall ms, aten matmul ms, both sides on the same rows after
the same prefill, and for ours the ms in each fused kernel) and `prefill` times one prefill of the batch on
both sides: where the time goes when a goal is not met.

    v4rl bench rollout --config-sweep --json runs/bench/rollout-sweep.json     # ~10 min on 2 idle cores
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Same reason and same caveat as bench/rollout.py: set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from bench import load_average, machine_info  # noqa: E402
from bench.decode_profile import step_profiles, timed  # noqa: E402
from bench.rollout import THREAD_SETTINGS, _hf_generate  # noqa: E402
from engines.model import kernels  # noqa: E402
from engines.model.config import CSA, HASH_MOE, HCA, SLIDING, TOPK_MOE, ModelConfig  # noqa: E402

GOAL = 1.5


@dataclass(frozen=True)
class SweepCase:
    """One model shape and workload of the sweep."""

    name: str
    model: ModelConfig
    batch: int
    """Distinct prompts, one sample each."""
    prompt_len: int
    new_tokens: int


def _model(*, hidden: int, layer_types: list[str], hash_layers: int, heads: int, head_dim: int, experts: int,
           top_k: int, index_topk: int, index_heads: int, index_dim: int, rates: tuple[int, int], window: int,
           o_groups: int, vocab: int) -> ModelConfig:
    n = len(layer_types)
    return ModelConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=n, num_attention_heads=heads, head_dim=head_dim,
        q_lora_rank=hidden, partial_rotary_factor=0.25, max_position_embeddings=4096, layer_types=layer_types,
        mlp_layer_types=[HASH_MOE] * hash_layers + [TOPK_MOE] * (n - hash_layers),
        compress_rates={CSA: rates[0], HCA: rates[1]}, sliding_window=window, o_groups=o_groups, o_lora_rank=128,
        index_n_heads=index_heads, index_head_dim=index_dim, index_topk=index_topk, n_routed_experts=experts,
        num_experts_per_tok=top_k, moe_intermediate_size=128 if hidden != 256 else 256, hc_mult=4,
        bos_token_id=0, eos_token_id=1, pad_token_id=2)


CASES = (
    SweepCase("h128-e8-topk4", _model(hidden=128, layer_types=[SLIDING, CSA, HCA, CSA], hash_layers=2, heads=4,
                                       head_dim=64, experts=8, top_k=2, index_topk=4, index_heads=8, index_dim=16,
                                       rates=(4, 128), window=32, o_groups=2, vocab=512),
              batch=64, prompt_len=160, new_tokens=64),
    SweepCase("h256-e16-topk16", _model(hidden=256, layer_types=[SLIDING, CSA, HCA, CSA, HCA, CSA], hash_layers=1,
                                         heads=8, head_dim=64, experts=16, top_k=4, index_topk=16, index_heads=16,
                                         index_dim=32, rates=(4, 128), window=64, o_groups=4, vocab=1024),
              batch=32, prompt_len=200, new_tokens=64),
    SweepCase("h384-e32-topk32-rates8-32", _model(hidden=384, layer_types=[HCA, CSA, SLIDING, CSA], hash_layers=2,
                                                   heads=6, head_dim=64, experts=32, top_k=4, index_topk=32,
                                                   index_heads=8, index_dim=32, rates=(8, 32), window=48, o_groups=3,
                                                   vocab=2048),
              batch=24, prompt_len=288, new_tokens=64),
    SweepCase("h512-e64-topk64", _model(hidden=512, layer_types=[SLIDING, CSA, HCA, CSA], hash_layers=1, heads=8,
                                         head_dim=128, experts=64, top_k=6, index_topk=64, index_heads=16,
                                         index_dim=64, rates=(4, 128), window=128, o_groups=8, vocab=4096),
              batch=16, prompt_len=320, new_tokens=64),
)


def main(json_out: Path, *, repeats: int = 3, cases: tuple[SweepCase, ...] = CASES) -> dict[str, Any]:
    json_out = Path(json_out)
    started = time.perf_counter()
    result: dict[str, Any] = {"machine": machine_info(), "goal": f">= {GOAL}x at every thread setting",
                              "repeats": repeats, "dtype": "float32", "cases": []}
    with tempfile.TemporaryDirectory(prefix="v4rl-bench-sweep-") as tmp:
        for case in cases:
            result["cases"].append(_run_case(case, Path(tmp) / case.name, repeats))
    speedups = [t["speedup"] for c in result["cases"] for t in c["by_threads"].values()]
    result.update(min_speedup=min(speedups), met_everywhere=min(speedups) >= GOAL,
                  native_kernels=kernels.status(), wall_s=time.perf_counter() - started)
    result["machine"]["load_avg_1m_at_end"] = load_average()
    _write_json(json_out, result)
    result["plot"] = str(_plot(result, json_out.with_suffix(".png")))
    _write_json(json_out, result)
    _print_summary(result, json_out)
    return result


# ---------------------------------------------------------------------------------------------- one case
def _run_case(case: SweepCase, model_dir: Path, repeats: int) -> dict[str, Any]:
    from engines.align.score import load_reference

    _random_checkpoint(case.model, model_dir)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, case.model.vocab_size, (case.batch, case.prompt_len), generator=g)
    reference = load_reference(model_dir)
    by_threads = {("default" if t is None else f"{t}_thread"): _generation_at(case, model_dir, reference, prompts,
                                                                              repeats, t)
                  for t in THREAD_SETTINGS}
    return {"name": case.name, "model": _describe(case.model), "batch": case.batch, "prompt_len": case.prompt_len,
            "new_tokens": case.new_tokens, "by_threads": by_threads,
            "goal_met": all(r["speedup"] >= GOAL for r in by_threads.values()),
            **_breakdown(model_dir, reference, prompts)}


def _random_checkpoint(cfg: ModelConfig, out: Path) -> Path:
    from checkpoints.hf import save_hf_checkpoint
    from engines.train.hf_model import build_reference_model, native_from_reference

    return save_hf_checkpoint(out, cfg, native_from_reference(build_reference_model(cfg, seed=0)))


def _describe(cfg: ModelConfig) -> dict[str, Any]:
    return {"hidden": cfg.hidden_size, "layers": cfg.layer_types, "mlp_layers": cfg.mlp_layer_types,
            "heads": cfg.num_attention_heads, "head_dim": cfg.head_dim, "routed_experts": cfg.n_routed_experts,
            "experts_per_token": cfg.num_experts_per_tok, "index_topk": cfg.index_topk,
            "index_heads": cfg.index_n_heads, "compress_rates": cfg.compress_rates,
            "sliding_window": cfg.sliding_window, "vocab": cfg.vocab_size, "hc_mult": cfg.hc_mult}


def _generation_at(case: SweepCase, model_dir: Path, reference, prompts: torch.Tensor, repeats: int,
                   threads: int | None) -> dict[str, Any]:
    """Ours over HTTP and transformers' generate, alternating, both on a compute thread with these threads."""
    from engines.model.fused_model import shape_signature
    from engines.rollout.engine import EngineConfig, RolloutEngine
    from engines.rollout.server import RolloutServer
    from engines.rollout.sglang import SGLangClient

    rows = prompts.tolist()
    sampling = {"max_new_tokens": case.new_tokens, "temperature": 1.0, "ignore_eos": True}
    worker = ThreadPoolExecutor(1, thread_name_prefix="transformers",
                                initializer=None if threads is None else torch.set_num_threads,
                                initargs=() if threads is None else (threads,))
    try:
        with RolloutServer(RolloutEngine(model_dir, EngineConfig(threads=threads))) as server, \
                SGLangClient(server.url, timeout=1800) as client:
            def ours(batch: list[list[int]], params: dict[str, Any]) -> float:
                server.engine.flush_cache()  # every run prefills from scratch
                return timed(lambda: client.generate_ids(batch, params, return_logprob=True))

            def hf(batch: torch.Tensor, n_new: int) -> float:
                return worker.submit(_hf_generate, reference, batch, n_new).result()

            ours(rows[:2], {"max_new_tokens": 2, "ignore_eos": True})  # warm-up (and the kernels' check), both sides
            hf(prompts[:2], 2)
            runs = [(ours(rows, sampling), hf(prompts, case.new_tokens)) for _ in range(repeats)]
            checked = server.engine.status()["native_kernels"]["fused_decode"]["checked"]
            signature = shape_signature(case.model)
    finally:
        worker.shutdown()
    tokens = case.batch * case.new_tokens
    return {"threads": "default" if threads is None else threads,
            "ours_tok_s": tokens / min(o for o, _ in runs), "transformers_tok_s": tokens / min(h for _, h in runs),
            "speedup": statistics.median(h / o for o, h in runs),
            "runs_s": [{"ours": o, "transformers": h} for o, h in runs],
            "fused_decode": {signature: checked.get(signature)}}  # this shape only: the process may hold others


def _breakdown(model_dir: Path, reference, prompts: torch.Tensor, steps: int = 5) -> dict[str, Any]:
    """At 1 thread: one prefill of the batch and one decode step after it, both sides (see module docstring)."""
    from engines.align.score import load_ours

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ours = load_ours(model_dir)
    ours.fused_kernels = True  # as the rollout engine runs it
    try:
        with torch.inference_mode():
            tokens = prompts[:, -1].clone()
            ours.prefill(prompts[:2], all_logits=False)  # the fused kernels' check happens on first use
            prefill = {"ours_s": min(timed(lambda: ours.prefill(prompts, all_logits=False)) for _ in range(2)),
                       "transformers_s": min(timed(lambda: reference(input_ids=prompts, use_cache=True,
                                                                     logits_to_keep=1)) for _ in range(2))}
            prefill["speedup"] = prefill["transformers_s"] / prefill["ours_s"]
            mine, theirs = step_profiles(ours, reference, prompts, tokens, steps)
    finally:
        torch.set_num_threads(threads)
    return {"prefill": prefill,
            "decode_step": {"rows": len(prompts), "threads": 1, "ours": mine, "transformers": theirs,
                            "speedup": theirs["step_ms"] / mine["step_ms"],
                            "note": "bench/decode_profile.py: ops are aten ops per step (a fused kernel call is not "
                                    "one), matmul_ms the profiler self time of aten mm/bmm/addmm/baddbmm (ours "
                                    "multiply inside the fused linear and moe), kernels_ms wall ms per step in each "
                                    "fused kernel; both prefills project only the last position to the vocabulary "
                                    "(transformers: logits_to_keep=1, as generate)"}}


# ---------------------------------------------------------------------------------------------- output
def _write_json(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, path)


def _plot(result: dict[str, Any], path: Path) -> Path:
    from engines.runs.report import _save, plt

    cases = result["cases"]
    settings = list(cases[0]["by_threads"])
    fig, ax = plt.subplots(figsize=(1.6 + 1.7 * len(cases), 3.6))
    width = 0.8 / len(settings)
    for i, setting in enumerate(settings):
        values = [c["by_threads"][setting]["speedup"] for c in cases]
        bars = ax.bar([k + (i - (len(settings) - 1) / 2) * width for k in range(len(cases))], values, width,
                      label=setting.replace("_", " "))
        ax.bar_label(bars, fmt="%.2fx", fontsize=8)
    ax.axhline(GOAL, color="grey", linestyle="--", linewidth=1, label=f"goal {GOAL}x")
    ax.set_xticks(range(len(cases)), [c["name"] for c in cases], fontsize=8)
    ax.set_ylabel("speedup over transformers generate")
    ax.set_title("rollout throughput, ours (HTTP) vs transformers generate, same weights and batch", fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _print_summary(result: dict[str, Any], json_out: Path) -> None:
    for c in result["cases"]:
        runs = ", ".join(f"{k}: {r['speedup']:.2f}x ({r['ours_tok_s']:.0f} vs {r['transformers_tok_s']:.0f} tok/s)"
                         for k, r in c["by_threads"].items())
        d, p = c["decode_step"], c["prefill"]
        print(f"{c['name']} ({c['batch']} x {c['prompt_len']} + {c['new_tokens']}): {runs}; decode step "
              f"{d['ours']['step_ms']:.1f} vs {d['transformers']['step_ms']:.1f} ms ({d['ours']['ops']} vs "
              f"{d['transformers']['ops']} ops), prefill {p['ours_s']:.2f} vs {p['transformers_s']:.2f} s")
    print(f"lowest speedup {result['min_speedup']:.2f}x (goal >= {GOAL}x everywhere: "
          f"{'met' if result['met_everywhere'] else 'not met'}); {result['wall_s']:.0f} s; wrote {json_out} and "
          f"{result['plot']}")
