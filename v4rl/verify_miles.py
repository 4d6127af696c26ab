"""`v4rl verify-ckpt DIR --miles-dir M`: Miles' OWN DeepSeek-V4 model on a user's torch_dist checkpoint, on CPU.

Three checks (engines/upstream/miles_model_check.py runs Miles' model in a subprocess; docs: README "Megatron
conformance"):
  (a) keys   Miles' model's sharded_state_dict keys, global shapes and dtypes vs the checkpoint's;
  (b) load   every parameter filled with a sentinel, Miles' own load_checkpoint on DIR: nothing may stay at the
             sentinel and no `will skip` line may be printed;
  (c) forward (with --against HF_DIR, the HF checkpoint DIR was converted from) one forward of `tokens` random
             tokens through Miles' model (BF16) and v4rl's own model (fp32 and bf16), compared layer by layer and
             in logprobs within bounds derived from v4rl's own bf16 noise (engines/align/model_compare.py).
(b) and (c) build the model on the CPU, so they run only where it fits in memory (`fits_in_memory`); (a) then
runs on the meta device alone.

    report = verify_with_miles("ckpt/torch_dist", miles_dir="~/miles", against="ckpt/hf")
    report["ok"], report["keys"], report["loads"], report["forward"]
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

BYTES_PER_PARAM = 12
"""CPU memory per parameter for (b)+(c): Miles' BF16 model, v4rl's fp32 and bf16 copies, and loader buffers."""


def available_memory() -> int:
    """Bytes of memory this machine has available (MemAvailable, else total physical memory)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def fits_in_memory(n_params: int) -> bool:
    return n_params * BYTES_PER_PARAM < available_memory()


def _config(ckpt: Path, against: Path | None) -> dict[str, Any]:
    if against is not None:
        return json.loads((against / "config.json").read_text())
    from checkpoints.torch_dist import hf_config_of, resolve_iteration_dir

    config = hf_config_of(resolve_iteration_dir(ckpt))
    if config is None:
        raise ValueError(f"{ckpt} records no model config (common.pt); pass --against HF_DIR, the HF checkpoint it "
                         "was converted from")
    return dict(config)


def verify_with_miles(ckpt: str | Path, *, miles_dir: str | Path | None, megatron_dir: str | Path | None = None,
                      against: str | Path | None = None, impl: str | None = None, tokens: int = 256,
                      seed: int = 0, timeout: float = 3600.0) -> dict[str, Any]:
    """Run (a)-(c) (module docstring) and return the report; `ok` is every check that ran passing."""
    import torch

    from engines.miles.pins import MILES_GENERATIONS
    from engines.upstream.sources import megatron_tree, miles_tree
    from engines.model.config import ModelConfig
    from engines.miles.generation import detect_generation, dsv4_impl_args
    from engines.upstream.miles_model_check import (NUMERIC_STANDINS, checkpoint_keys, compare_keys, probe_argv,
                                                 run_probe, tile_kernels_mhc_reference)

    ckpt = Path(ckpt).expanduser()
    against = Path(against).expanduser() if against else None
    config = _config(ckpt, against)
    cfg = ModelConfig.from_hf_dict(config)
    gen = detect_generation(miles_tree(miles_dir))
    miles, megatron = miles_tree(miles_dir, MILES_GENERATIONS[gen.generation][0]), \
        megatron_tree(megatron_dir, MILES_GENERATIONS[gen.generation][1])
    extra = dsv4_impl_args(gen, impl)  # none for generation 1, whose parser has no --dsv4-impl
    impl = extra[1] if extra else None
    from checkpoints.torch_dist import megatron_specs

    n_params = sum(int(torch.Size(s.shape).numel()) for s in megatron_specs(cfg, gen.megatron_names).values())
    runs_on_cpu = fits_in_memory(n_params)
    if tokens % 128:
        raise ValueError(f"--tokens must be a multiple of 128 (Miles' compressor); got {tokens}")
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(seed))
    report: dict[str, Any] = {"ckpt": str(ckpt), "miles_dir": str(miles), "generation": gen.generation,
                              "dsv4_impl": impl, "parameters": n_params, "ran_on_cpu": runs_on_cpu}
    with tempfile.TemporaryDirectory(prefix="v4rl-verify-miles-") as tmp:
        hf_dir = against or Path(tmp)
        if against is None:
            (Path(tmp) / "config.json").write_text(json.dumps(config))
        argv = probe_argv(config, hf_dir=hf_dir, load_dir=ckpt, meta=not runs_on_cpu, generation=gen.generation,
                          extra=extra)
        request: dict[str, Any] = {"argv": argv, "do": ["keys"], "out_dir": tmp}
        env = {}
        if runs_on_cpu:
            request["load_dirs"] = [str(ckpt)]
            if against is not None:
                request.update(do=["keys", "forward"], tokens=ids.tolist(), kernels=str(NUMERIC_STANDINS))
                env["V4RL_TILE_KERNELS_MHC"] = str(tile_kernels_mhc_reference())
        result = run_probe(request, miles_dir=miles, megatron_dir=megatron, env=env, timeout=timeout)
        comparison = compare_keys(result.keys, checkpoint_keys(ckpt))
        report["keys"] = {"ok": comparison.ok, "model_keys": len(result.keys), "problems": comparison.problems(
            fix=f"convert with `v4rl convert SRC DST --miles-dir {miles}`")}
        report["loads"] = [{**load, "ok": not load["at_sentinel"] and not load["will_skip"] and "refused" not in load}
                           for load in result.loads]
        if result.forwards:
            report["forward"] = _forward_report(result.forwards["clean"], against, cfg, ids)
        elif result.raw.get("forward_skipped"):
            report["forward_skipped"] = result.raw["forward_skipped"]
    checks = [report["keys"]["ok"], *(load["ok"] for load in report["loads"])]
    if "forward" in report:
        checks += [report["forward"]["ok"]]
    report["ok"] = all(checks)
    return report


def _forward_report(path: str, against: Path, cfg, ids) -> dict[str, Any]:
    import torch

    from engines.align.score import load_ours
    from engines.align.model_compare import compare_logprobs, compare_traces, ours_forward

    miles = torch.load(path)
    t32, l32 = ours_forward(load_ours(against, torch.float32), ids)
    t16, l16 = ours_forward(load_ours(against, torch.bfloat16), ids)
    loc = compare_traces(miles["trace"], t32, t16, cfg.mlp_layer_types)
    logprobs = compare_logprobs(miles["logits"][..., :cfg.vocab_size], l32, l16, ids)
    return {"ok": loc.first_divergence is None and logprobs["within_bound"], "first_divergence": loc.first_divergence,
            "logprobs": logprobs, "per_layer": loc.per_layer}


def summary(report: dict[str, Any]) -> str:
    lines = [f"Miles' DeepSeek-V4 model ({report['miles_dir']}, generation {report['generation']}"
             f"{', --dsv4-impl ' + report['dsv4_impl'] if report['dsv4_impl'] else ''}) on {report['ckpt']}:"]
    keys = report["keys"]
    lines.append(f"  (a) keys: {'ok' if keys['ok'] else 'DIFFER'} ({keys['model_keys']} keys)")
    lines += [f"      {p}" for p in keys["problems"]]
    if not report["ran_on_cpu"]:
        lines.append(f"  (b)/(c) not run: {report['parameters']:,} parameters do not fit in this machine's memory")
    for load in report["loads"]:
        if "refused" in load:
            lines.append(f"  (b) load {load['dir']}: Miles refused it: {load['refused'].splitlines()[0][:400]}")
            continue
        lines.append(f"  (b) load {load['dir']}: " + ("ok, every parameter loaded" if load["ok"] else
                     f"{len(load['at_sentinel'])} parameters never loaded {load['at_sentinel'][:5]}; "
                     f"`will skip`: {load['will_skip'][:3]}"))
    if "forward_skipped" in report:
        lines.append(f"  (c) forward: {report['forward_skipped']}")
    if "forward" in report:
        f = report["forward"]
        lp = f["logprobs"]
        lines.append(f"  (c) forward: {'ok' if f['ok'] else 'DIFFERS'}: mean |dlogprob| {lp['mean']:.4f} vs v4rl's "
                     f"bf16 noise {lp['bf16_noise_mean']:.4f} (bound {lp['bound']:.4f}); first divergence: "
                     f"{f['first_divergence']}")
    return "\n".join(lines)


def plan_model_keys(preset: str, overrides: dict[str, Any], job, *, miles_dir: str | None,
                    megatron_dir: str | None):
    """For `v4rl plan --miles-dir`: Miles' model of that checkout (meta device) vs the checkpoint the job hands
    over (engines/upstream/miles_model_check.py check_job_model_keys)."""
    from engines.presets.runs import resolve
    from engines.upstream.miles_model_check import check_job_model_keys

    eff, _ = resolve(preset, overrides)
    return check_job_model_keys(eff, job, miles_dir=miles_dir, megatron_dir=megatron_dir)
