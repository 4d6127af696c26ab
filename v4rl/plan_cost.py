"""`v4rl plan`'s storage cost section: what one Miles job start and one save cost for the preset, and the run's
total, one job per segment (v4rl before) vs one job per run (now). Library: engines/miles/costs.py.

    v4rl plan --preset dsv4-flash-mi355x                           # includes the cost lines
    v4rl plan --preset dsv4-flash-mi355x --storage-gb-per-s 2 --no-save-optim --json
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engines.miles.costs import GB, job_costs, run_costs


def cost_json(preset: str, overrides: Mapping[str, Any], *, storage_gb_per_s: float, save_optim: bool) -> dict:
    """The cost of a job start and a save, and the run's totals before/after, as one JSON object."""
    from engines.presets.runs import resolve

    effective, _ = resolve(preset, overrides)
    costs = job_costs(preset, overrides, storage_gb_per_s=storage_gb_per_s, save_optim=save_optim)
    shape = dict(steps=effective.num_rollout, eval_interval=effective.eval.interval,
                 save_interval=effective.miles.save_interval or effective.num_rollout)
    runs = {name: vars(r) for name, r in run_costs(costs, **shape).items()}
    return {**costs.to_json(), "run": shape, "runs": runs}


def cost_lines(obj: dict) -> list[str]:
    """The cost section as text lines (sizes in GB = 1e9 bytes)."""
    rate = obj["storage_gb_per_s"]
    optim = f"optimizer {obj['save_optimizer_bytes'] / GB:,.0f} GB" if obj["save_optimizer_bytes"] \
        else "no optimizer (--no-save-optim)"
    lines = [f"storage cost at {rate:g} GB/s (--storage-gb-per-s; lower bounds: replicas read more):",
             f"  one save: {obj['save_bytes'] / GB:,.0f} GB written (weights {obj['save_weights_bytes'] / GB:,.0f} GB "
             f"BF16, {optim}) = {obj['save_seconds'] / 60:,.1f} min",
             f"  one job start: {obj['sglang_engines']} SGLang engines x {obj['rollout_checkpoint_bytes'] / GB:,.0f} GB "
             f"rollout checkpoint + actor {obj['start_fresh_bytes'] / GB:,.0f} GB (--ref-load) = "
             f"{obj['start_fresh_seconds'] / 60:,.1f} min; a resumed job's actor reads --load instead, "
             f"{obj['start_resume_bytes'] / GB:,.0f} GB: {obj['start_resume_seconds'] / 60:,.1f} min",
             f"  the run ({obj['run']['steps']} rollouts, eval every {obj['run']['eval_interval']}, save every "
             f"{obj['run']['save_interval']}):"]
    for name, r in obj["runs"].items():
        lines.append(f"    {name}: {r['jobs']} job starts, {r['saves']} saves, {r['bytes_read'] / 1e12:,.1f} TB read + "
                     f"{r['bytes_written'] / 1e12:,.1f} TB written = {r['seconds'] / 3600:,.1f} h of storage I/O")
    return lines
