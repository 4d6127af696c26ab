"""`align()`: generate once, rescore the same tokens with trainer and reference, localise, gate.

Steps (DESIGN.md data flow, `align`):
  1. our rollout engine, on the HF FP8 checkpoint, samples one response for each of N held-out prompts
     (seeded) and reports each sampled token's raw logprob;
  2. the trainer (transformers' model holding the torch_dist weights read by megatron-core, BF16
     autocast as in training) and transformers' reference (`from_pretrained` on the HF directory, fp32)
     rescore exactly those tokens;
  3. per-token |Δlogprob| statistics, rollout vs trainer (the gated number, the seed's
     `train_rollout_logprob_abs_diff`), overall and by response position, plus the two other pairs;
  4. the same tokens through our engine's weights and the trainer's model, both in fp32, layer by
     layer (layerwise.py), naming the first layer and sub-block where they part;
  5. passed = every threshold holds (and, unless disabled, no sub-block diverges).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Literal

import torch

from checkpoints.hf import read_config
from engines.align.inputs import AlignError, Rollout, generate, load_torch_dist
from engines.align.layerwise import localise
from rl.stats import abs_diff_stats, by_position

DTYPES = ("float32", "bfloat16")


@dataclass(kw_only=True)
class AlignConfig:
    n_prompts: int = 32
    """Held-out prompts; one sampled response each."""
    max_new_tokens: int = 32
    """Longest response generated."""
    temperature: float = 1.0
    """Sampling temperature of the rollout (1.0: what GRPO samples with)."""
    seed: int = 0
    """Seed of the held-out split and of the sampling."""
    rollout_dtype: str = "float32"
    """Runtime dtype of the rollout engine's dequantized weights (the engine's default, as `v4rl train`)."""
    trainer_dtype: str = "bfloat16"
    """Trainer compute dtype for rescoring (BF16 autocast, as in training)."""
    mean_threshold: float = 0.09
    """Gate on the mean rollout-vs-trainer |Δlogprob| (the seed reports ~0.09 at 284B, FP8 vs BF16)."""
    p99_threshold: float | None = None
    """Gate on its 99th percentile (None: not gated)."""
    max_threshold: float | None = None
    """Gate on its maximum (None: not gated)."""
    layer_rel_tol: float = 1e-3
    """A sub-block diverges when some token's relative L2 error (fp32 vs fp32) exceeds this."""
    router_tol: float = 0.0
    """A router diverges when more than this fraction of tokens get a different expert set."""
    fail_on_divergence: bool = True
    """Fail the gate when a sub-block diverges, even if the token statistics are within thresholds."""
    against: Literal["trainer", "reference"] = "trainer"
    """transformers model our engine is compared with layer by layer (trainer: the torch_dist weights)."""
    position_bucket: int = 1
    """Response positions pooled per `by_position` entry."""

    def __post_init__(self) -> None:
        if self.n_prompts < 1:
            raise ValueError(f"n_prompts must be >= 1, got {self.n_prompts}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        for name in ("rollout_dtype", "trainer_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name} must be one of {DTYPES}, got {getattr(self, name)!r}")
        for name in ("mean_threshold", "p99_threshold", "max_threshold", "layer_rel_tol", "router_tol"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.against not in ("trainer", "reference"):
            raise ValueError(f"against must be 'trainer' or 'reference', got {self.against!r}")
        if self.position_bucket < 1:
            raise ValueError(f"position_bucket must be >= 1, got {self.position_bucket}")


def _by_length_logprobs(forward, seqs: list[tuple[list[int], list[int]]], vocab: int) -> list[list[float]]:
    """engines.align.score.token_logprobs on groups of equal length (no padding reaches transformers' model)."""
    from engines.align.score import token_logprobs

    out: list[list[float]] = [[] for _ in seqs]
    groups: dict[int, list[int]] = {}
    for i, (p, r) in enumerate(seqs):
        groups.setdefault(len(p) + len(r), []).append(i)
    for idx in groups.values():
        rows = [{"prompt_ids": seqs[i][0], "response_ids": seqs[i][1]} for i in idx]
        for i, lp in zip(idx, token_logprobs(forward, rows, vocab_size=vocab)):
            out[i] = lp
    return out


def _padded(rows: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] values and mask from ragged rows."""
    width = max(len(r) for r in rows)
    values = torch.zeros(len(rows), width, dtype=torch.float64)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        values[i, :len(r)] = torch.tensor(r, dtype=torch.float64)
        mask[i, :len(r)] = True
    return values, mask


def _finite(x: float) -> float | None:
    return None if math.isnan(x) else x


def gate(stats: dict, first: dict | None, config: AlignConfig) -> list[str]:
    """Reasons the check fails (empty: passed): the token thresholds, and a diverging sub-block if one is named."""
    failures = []
    for key, limit in (("mean", config.mean_threshold), ("p99", config.p99_threshold), ("max", config.max_threshold)):
        if limit is not None and stats[key] > limit:
            failures.append(f"rollout vs trainer |dlogprob| {key} {stats[key]:.4g} > threshold {limit:g}")
    if first is not None and config.fail_on_divergence:
        failures.append(f"layer {first['layer']} {first['sub_block']} diverges in fp32: {first['metric']} "
                        f"{first['value']:.3g} > {first['tolerance']:g} (from position {first['first_position']})")
    return failures


def thresholds(config: AlignConfig) -> dict:
    return {"mean": config.mean_threshold, "p99": config.p99_threshold, "max": config.max_threshold,
            "layer_rel_tol": config.layer_rel_tol, "router_tol": config.router_tol,
            "fail_on_divergence": config.fail_on_divergence}


def token_report(rollout_lp: list[list[float]], trainer_lp: list[list[float]], config: AlignConfig, *,
                 reference: list[list[float]] | None = None) -> dict:
    """The report's token statistics over the same response tokens: `token_abs_diff` (rollout vs trainer, the
    gated number), `by_position`, `pairs` and `n_tokens`; shared by the CPU and the cluster gate."""
    rollout_t, mask = _padded(rollout_lp)
    trainer_t, _ = _padded(trainer_lp)
    stats = abs_diff_stats(rollout_t, trainer_t, mask)
    means, counts = by_position(rollout_t, trainer_t, mask, bucket=config.position_bucket, return_counts=True)
    pairs = {"rollout_vs_trainer": stats}
    if reference is not None:
        reference_t, _ = _padded(reference)
        pairs.update(rollout_vs_reference=abs_diff_stats(rollout_t, reference_t, mask),
                     trainer_vs_reference=abs_diff_stats(trainer_t, reference_t, mask))
    return {"token_abs_diff": stats, "n_tokens": int(mask.sum()),
            "by_position": {"bucket": config.position_bucket, "mean": [_finite(float(x)) for x in means],
                            "tokens": [int(c) for c in counts]},
            "pairs": pairs}


def align(model_dir: str | Path, torch_dist_dir: str | Path, config: AlignConfig | None = None,
          *, log: Callable[[str], None] = lambda msg: None) -> dict:
    """Run the whole check and return the JSON-ready report (module docstring; schema in engines/align)."""
    from engines.align.score import load_reference
    from engines.train.trainer import Trainer, TrainerConfig

    config = config or AlignConfig()
    t0 = time.perf_counter()
    try:
        cfg, _ = read_config(model_dir)
    except (OSError, ValueError) as exc:
        raise AlignError(f"--model {model_dir} is not a DeepSeek-V4 HF checkpoint: {exc}") from exc
    log(f"loading the trainer from {torch_dist_dir} through megatron-core ({config.trainer_dtype} compute)")
    trainer = Trainer.from_native(cfg, load_torch_dist(torch_dist_dir, cfg),
                                  TrainerConfig(compute_dtype=config.trainer_dtype))
    t_load = time.perf_counter()
    log(f"generating {config.n_prompts} rollouts with our engine on {model_dir}")
    try:
        rollouts, ours_fp32 = generate(model_dir, n_prompts=config.n_prompts, seed=config.seed,
                                       temperature=config.temperature, max_new_tokens=config.max_new_tokens,
                                       dtype=config.rollout_dtype)
    except AlignError:
        raise
    except (OSError, ValueError) as exc:
        raise AlignError(f"our rollout engine cannot serve {model_dir}: {exc}") from exc
    scored: list[Rollout] = [r for r in rollouts if r.response_ids]
    if not scored:
        raise AlignError(f"all {len(rollouts)} responses are empty (EOS first); nothing to compare. Raise --prompts")
    t_gen = time.perf_counter()

    log(f"rescoring {sum(len(r.response_ids) for r in scored)} tokens with the trainer and the reference "
        "(from_pretrained, float32)")
    seqs = [(r.prompt_ids, r.response_ids) for r in scored]
    trainer_lp = trainer.logprobs(seqs)
    reference = load_reference(model_dir, torch.float32)
    reference_lp = _by_length_logprobs(lambda ids: reference(input_ids=ids).logits, seqs, cfg.vocab_size)
    t_score = time.perf_counter()

    tokens = token_report([r.logprobs for r in scored], trainer_lp, config, reference=reference_lp)
    log(f"localising layer by layer in float32 against the {config.against}")
    theirs = trainer.model if config.against == "trainer" else reference
    loc = localise(ours_fp32, theirs.float(), [r.prompt_ids + r.response_ids for r in scored],
                   rel_tol=config.layer_rel_tol, router_tol=config.router_tol)
    t_loc = time.perf_counter()

    failures = gate(tokens["token_abs_diff"], loc.first_divergence, config)
    return {
        "passed": not failures,
        "failures": failures,
        **tokens,
        "first_divergence": loc.first_divergence,
        "per_layer": loc.per_layer,
        "thresholds": thresholds(config),
        "n_prompts": len(rollouts),
        "n_sequences": len(scored),
        "n_empty_responses": len(rollouts) - len(scored),
        "engines": {"rollout": f"ours (engines/rollout), HF checkpoint as stored, runtime {config.rollout_dtype}",
                    "trainer": f"transformers DeepseekV4ForCausalLM from torch_dist via megatron-core, "
                               f"{config.trainer_dtype} compute",
                    "reference": "transformers DeepseekV4ForCausalLM.from_pretrained, float32"},
        "localisation": {"dtype": "float32", "ours": "rollout engine's weights (dequantized as it serves them)",
                         "against": config.against,
                         "why_fp32": "bf16 rounding noise would mask a small mismatch or fake a large one",
                         "metric": "per-token relative L2 error ||ours - theirs|| / ||theirs||; routers: "
                                   "fraction of tokens with a different expert set"},
        "finish_reasons": {k: sum(r.finish_reason == k for r in rollouts) for k in sorted({r.finish_reason
                                                                                           for r in rollouts})},
        "config": asdict(config),
        "inputs": {"model": str(model_dir), "torch_dist": str(torch_dist_dir)},
        "seconds": {"load_trainer": round(t_load - t0, 3), "generate": round(t_gen - t_load, 3),
                    "rescore": round(t_score - t_gen, 3), "localise": round(t_loc - t_score, 3),
                    "total": round(t_loc - t0, 3)},
    }


def markdown(report: dict) -> str:
    """The report as readable markdown (the Prefect artifact and the run report's section): verdict, the
    |Δlogprob| statistics of each engine pair against the thresholds, the first diverging layer, what each engine
    was; the JSON keeps everything else."""
    def num(value) -> str:
        return "" if value is None else f"{value:.4f}" if abs(value) >= 1e-3 or value == 0 else f"{value:.1e}"

    limits = report.get("thresholds", {})
    pairs = report.get("pairs") or {"rollout_vs_trainer": report["token_abs_diff"]}
    lines = [f"**{'passed' if report['passed'] else 'FAILED'}**: {report.get('n_tokens', '?')} response tokens of "
             f"{report.get('n_sequences', '?')} sequences ({report.get('n_empty_responses', 0)} empty responses "
             "skipped), each scored by every engine.", "",
             "| engines compared | mean \\|Δlogprob\\| | p50 | p99 | max |", "|---|---|---|---|---|"]
    for name, stats in pairs.items():
        gated = " (gated)" if name == "rollout_vs_trainer" else ""
        lines.append(f"| {name.replace('_', ' ')}{gated} | " + " | ".join(num(stats.get(k)) for k in
                                                                         ("mean", "p50", "p99", "max")) + " |")
    gates = [f"{k} {limits[k]:g}" for k in ("mean", "p99", "max") if limits.get(k) is not None]
    lines += ["", f"Thresholds on rollout vs trainer: {', '.join(gates) or 'none'}."]
    first = report.get("first_divergence")
    if first:
        lines.append(f"First divergence (float32, layer by layer): layer {first['layer']} {first['block']} "
                     f"(`{first['sub_block']}`), {first['metric']} {first['value']:.3g} > {first['tolerance']:g} "
                     f"from response position {first['first_position']}.")
    elif report.get("per_layer"):
        lines.append("First divergence (float32, layer by layer): none.")
    else:
        lines.append("Layer-by-layer localisation: not run here (" +
                     str(report.get("localisation", {}).get("skipped", "no per-layer data")) + ").")
    if report.get("failures"):
        lines += ["", "Failures:", ""] + [f"- {f}" for f in report["failures"]]
    engines = report.get("engines") or {}
    if engines:
        lines += ["", "| engine | what ran |", "|---|---|"] + [f"| {k} | {v} |" for k, v in engines.items()]
    return "\n".join(lines) + "\n"
