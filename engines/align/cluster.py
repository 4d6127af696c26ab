"""The cluster alignment gate: the real engines score the same tokens; nothing of the model loads on this node.

A 284B checkpoint cannot be loaded by our CPU engines or transformers' fp32 reference on a CPU node (A17), so
on the cluster path the gate is:

  1. SGLang generates once with logprobs: `sglang_rollouts`, our SGLang client against an SGLang server
     serving the HF FP8 checkpoint (`meta_info.output_token_logprobs`, the raw logprob of each sampled token);
  2. the batch becomes Miles' rollout-data file (`write_rollout_data`): what miles/ray/rollout/debug_data.py
     `save_debug_rollout_data` writes and `load_debug_rollout_data` reads, `torch.save({"rollout_id",
     "metadata", "samples": [Sample.to_dict()]})` with each sample's `tokens` = prompt + response,
     `response_length`, `loss_mask`, `rollout_log_probs`, `status`;
  3. Megatron, through Miles' train-only debug run of that file (engines/miles/jobs.py `align_argv`:
     `--load-debug-rollout-data`, `--save-debug-train-data`, `--debug-disable-optimizer`, our converted
     checkpoint as --ref-load), recomputes the logprobs of exactly those tokens and every rank dumps its batch;
  4. `read_train_dumps` takes Megatron's `log_probs` from the pipeline's last stage, per sample, checking the
     tokens are the ones SGLang produced; `cluster_report` gates with the same thresholds (AlignConfig) and
     writes the same report keys as the CPU gate (engines/align/report.py), `first_divergence` None: the
     layer-by-layer localisation needs both models on one host (the CPU gate on a smaller checkpoint does it).

`gate_batch` runs 1-2 given an SGLang client, `score_batch` 3-4 given a function that runs a Miles job (on the
cluster: `gpu`; engines/backends/miles.py `align_gate` wires both, with the SGLang server stopped before
Megatron starts). On CPU the tests drive every step but Megatron's forward against Miles' own code
(tests/conformance/test_miles_log_and_gate.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from engines.align.inputs import AlignError, Rollout
from engines.align.report import AlignConfig, gate, thresholds, token_report

MILES_STATUS = {"stop": "completed", "length": "truncated", "abort": "aborted"}
"""SGLang finish_reason type -> Miles Sample.Status value (Sample.update_from_meta_info)."""
ROLLOUT_DATA = "rollout_data/{rollout_id}.pt"
TRAIN_DUMP = "train_data/{rollout_id}_{rank}.pt"
"""Path templates under the gate's shared directory, formatted by Miles per rollout (and rank)."""


def sglang_rollouts(client: Any, prompts: Sequence[Sequence[int]], *, n: int, temperature: float,
                    max_new_tokens: int, seed: int) -> list[list[Rollout]]:
    """n samples per prompt from an SGLang server (our SGLangClient), with the raw logprob of every token."""
    params = {"temperature": temperature, "max_new_tokens": max_new_tokens, "n": n, "sampling_seed": seed}
    outs = client.generate_ids(prompts, params, return_logprob=True)
    if len(outs) != len(prompts) * n:
        raise AlignError(f"the SGLang server returned {len(outs)} outputs for {len(prompts)} prompts x n={n}")
    groups = []
    for i, prompt in enumerate(prompts):
        group = []
        for o in outs[i * n:(i + 1) * n]:
            if len(o.output_logprobs) != len(o.output_ids) or any(lp is None for lp in o.output_logprobs):
                raise AlignError("the SGLang server returned no logprob for some sampled tokens; it must answer "
                                 "return_logprob=True with meta_info.output_token_logprobs")
            group.append(Rollout(list(prompt), list(o.output_ids), [float(x) for x in o.output_logprobs],
                                 o.finish_type))
        groups.append(group)
    return groups


def miles_samples(groups: Sequence[Sequence[Rollout]], *, decode: Callable[[list[int]], str] | None = None,
                  labels: Sequence[str] | None = None, weight_version: str | None = None) -> list[dict[str, Any]]:
    """The groups as Miles' `Sample.to_dict()` rows (group_index per prompt, index per sample)."""
    rows = []
    for g, group in enumerate(groups):
        for r in group:
            if r.finish_reason not in MILES_STATUS:
                raise AlignError(f"finish reason {r.finish_reason!r} has no Miles status (known: {sorted(MILES_STATUS)})")
            rows.append({
                "group_index": g, "index": len(rows), "prompt": decode(r.prompt_ids) if decode else "",
                "tokens": list(r.prompt_ids) + list(r.response_ids), "response": decode(r.response_ids) if decode else "",
                "response_length": len(r.response_ids), "label": labels[g] if labels else None, "reward": 0.0,
                "loss_mask": [1] * len(r.response_ids), "rollout_log_probs": list(r.logprobs),
                "weight_versions": [weight_version] if weight_version else [], "status": MILES_STATUS[r.finish_reason],
                "metadata": {}, "spec_info": {}, "prefix_cache_info": {}})
    return rows


def write_rollout_data(path: str | Path, samples: list[dict[str, Any]], *, rollout_id: int = 0) -> Path:
    """Miles' rollout-data file (module docstring, step 2), written to a temporary name and renamed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save({"rollout_id": rollout_id, "metadata": {}, "samples": samples}, tmp)
    tmp.replace(path)
    return path


def read_train_dumps(dump_dir: str | Path, samples: Sequence[dict[str, Any]], *, rollout_id: int = 0
                     ) -> list[list[float]]:
    """Megatron's logprobs of every sample's response, in `samples` order, from Miles' train-data dumps
    (`save_debug_train_data_for_rank`: {rollout_id, rank, rollout_data, cp_rank, cp_size, qkv_format})."""
    files = sorted(Path(dump_dir).glob(f"{rollout_id}_*.pt"))
    if not files:
        raise AlignError(f"no Miles train-data dump {rollout_id}_<rank>.pt in {dump_dir}: did the align job run with "
                         "--save-debug-train-data (and finish its rollout)?")
    scored: dict[int, list[float]] = {}
    by_index = {s["index"]: s for s in samples}
    for f in files:
        # written by Miles on the user's cluster: python objects and (GPU) tensors, hence weights_only=False
        dump = torch.load(f, map_location="cpu", weights_only=False)
        data = dump["rollout_data"]
        if dump.get("cp_size", 1) != 1:
            raise AlignError(f"{f}: context parallel size {dump['cp_size']} splits each sample's logprobs over ranks; "
                             "run the align job with --context-parallel-size 1")
        if "log_probs" not in data:
            continue  # not the pipeline's last stage: Megatron stores the logprobs there only
        for index, tokens, lp in zip(data["sample_indices"], data["tokens"], data["log_probs"], strict=True):
            index = int(index)
            ours = by_index.get(index)
            if ours is None or [int(t) for t in torch.as_tensor(tokens).tolist()] != ours["tokens"]:
                raise AlignError(f"{f}: sample {index} holds other tokens than the rollout-data file's; the dump is "
                                 "not of this gate's batch (stale directory?)")
            values = [float(x) for x in torch.as_tensor(lp).float().tolist()]
            if len(values) != ours["response_length"]:
                raise AlignError(f"{f}: sample {index} has {len(values)} logprobs for {ours['response_length']} response "
                                 "tokens")
            scored.setdefault(index, values)
    missing = [s["index"] for s in samples if s["index"] not in scored]
    if missing:
        raise AlignError(f"Megatron's dumps in {dump_dir} lack samples {missing[:8]} ({len(missing)} of {len(samples)}); "
                         "every DP rank of the last pipeline stage must have written its file")
    return [scored[s["index"]] for s in samples]


def cluster_report(samples: Sequence[dict[str, Any]], trainer_lp: list[list[float]], config: AlignConfig, *,
                   engines: dict[str, str], inputs: dict[str, str], seconds: dict[str, float]) -> dict:
    """The CPU gate's report, from the cluster's engines (module docstring, step 4)."""
    scored = [(s, lp) for s, lp in zip(samples, trainer_lp, strict=True) if s["response_length"]]
    if not scored:
        raise AlignError(f"all {len(samples)} responses are empty (EOS first); nothing to compare. Raise --prompts")
    tokens = token_report([s["rollout_log_probs"] for s, _ in scored], [lp for _, lp in scored], config)
    failures = gate(tokens["token_abs_diff"], None, config)
    statuses = [s["status"] for s in samples]
    back = {v: k for k, v in MILES_STATUS.items()}
    return {"passed": not failures, "failures": failures, **tokens, "first_divergence": None, "per_layer": [],
            "thresholds": thresholds(config), "n_prompts": len({s["group_index"] for s in samples}),
            "n_sequences": len(scored), "n_empty_responses": len(samples) - len(scored), "engines": engines,
            "localisation": {"skipped": "the cluster gate compares the engines' token logprobs only; the layer-by-"
                                        "layer localisation needs both models on one host (v4rl align on CPU)"},
            "finish_reasons": {back[k]: statuses.count(k) for k in sorted(set(statuses))}, "config": asdict(config),
            "inputs": inputs, "seconds": seconds}


def gate_batch(client: Any, prompts: Sequence[Sequence[int]], config: AlignConfig, *, shared_dir: str | Path,
               n_samples_per_prompt: int, decode: Callable[[list[int]], str] | None = None,
               labels: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Steps 1-2: SGLang generates, the batch is written as Miles' rollout-data file under `shared_dir` (read by
    every node of the job); stale dumps of an earlier attempt are removed. Returns the samples written."""
    shared = Path(shared_dir)
    groups = sglang_rollouts(client, prompts, n=n_samples_per_prompt, temperature=config.temperature,
                             max_new_tokens=config.max_new_tokens, seed=config.seed)
    samples = miles_samples(groups, decode=decode, labels=labels)
    write_rollout_data(shared / ROLLOUT_DATA.format(rollout_id=0), samples)
    for stale in (shared / TRAIN_DUMP).parent.glob("0_*.pt"):
        stale.unlink()  # dumps of an earlier attempt must not be read as this batch's
    return samples


def score_batch(samples: list[dict[str, Any]], config: AlignConfig, *, shared_dir: str | Path,
                run_align_job: Callable[[str, str], Any], inputs: dict[str, str] | None = None,
                engines: dict[str, str] | None = None, seconds: dict[str, float] | None = None) -> dict:
    """Steps 3-4: `run_align_job(rollout_data_template, train_dump_template)` runs Miles' train-only job
    (jobs.align_argv) and returns when it finished; then the dumps are read and the batch gated."""
    shared = Path(shared_dir)
    t0 = time.perf_counter()
    run_align_job(str(shared / ROLLOUT_DATA), str(shared / TRAIN_DUMP))
    trainer_lp = read_train_dumps((shared / TRAIN_DUMP).parent, samples)
    timing = {**(seconds or {}), "rescore": round(time.perf_counter() - t0, 3)}
    return cluster_report(samples, trainer_lp, config, inputs=inputs or {}, seconds=timing, engines=engines or {
        "rollout": "SGLang (the cluster's server), HF checkpoint as stored",
        "trainer": "Megatron through Miles' train-only debug run, --ref-load = the converted torch_dist"})
