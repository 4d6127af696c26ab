"""`v4rl bench learning --json OUT [--arms A,B] [--seeds N] [--steps N]`: does FP8 rollout with a correction learn
like BF16 rollout? (issue 29)

Every arm is a real embedded run (engines.train.run.run_training, what `v4rl train` runs: rollout server over
HTTP, trainer, weight sync every step) on tiny-cpu, from the same base, on the same prompts in the same order and
with the same held-out evaluation for a given seed (the loop's seed sets data order, sampling and evaluation):

  bf16-tis      unquantized BF16 rollout (TrainRunConfig.rollout_weights bf16) + token TIS: the baseline
  fp8-none      FP8 rollout, no correction (the mismatch measured only)
  fp8-tis       FP8 rollout + token TIS (the seed's)
  fp8-icepop    FP8 rollout + IcePop (token mask outside [0.5, 2])
  fp8-geo-mask  FP8 rollout + geometric sequence masking with the veto, bounds [0.99, 1.01] (SkyRL's first
                recommendation; Miles' MIS default 0.9999/1.0001 masked 97% of tiny-cpu's sequences)
  fp8-opsm      FP8 rollout + off-policy sequence masking only (DeepSeek-V3.2's OPSM, delta 1e-4)
  fp8-r3-tis    FP8 rollout + routing replay + token TIS

Those seven are the issue's arms and the default. In all of them the FP8 arms' trainer forwards with the FP8
weights the rollout serves (quantization-aware, the embedded default), which leaves little mismatch to correct.
The BF16-trainer arms take that away, as on the cluster, where Megatron's forward uses its BF16 weights:

  fp8-bf16trainer-none    FP8 rollout, trainer forwards BF16 weights, no correction
  fp8-bf16trainer-tis     the same + token TIS

Per arm and evaluation: held-out pass@1 and pass@8, mean and standard error across seeds (null with one seed);
per arm: mean |Δlogprob| train vs rollout, masked token / sequence shares, router mismatch, seconds per step.
With bf16-tis among the arms, each arm also gets its pass@1 gap to it, paired by seed (gap_to_baseline), and its
seconds per step relative to it. OUT is written to a temporary name and renamed; the curves go to <OUT stem>.png beside it. With `--work-dir DIR`
every finished run leaves DIR/<arm>/seed-<n>/bench-run.json, and the same command run again reuses those and
reruns only the runs that had not finished (an interrupted experiment of hours continues where it stopped).

    v4rl bench learning --json runs/bench/learning.json --seeds 3 --steps 30
    v4rl bench learning --json /tmp/l.json --arms bf16-tis,fp8-tis --seeds 1 --steps 2
    v4rl bench learning --json docs/bench-learning.json --work-dir runs/learning --prompts-per-step 32 --n-eval 100
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench/e2e.py: spin-waiting libgomp on a loaded machine

from bench import load_average, machine_info  # noqa: E402
from rl.correction_setting import RolloutCorrection  # noqa: E402



@dataclass(frozen=True)
class Arm:
    """What one arm changes; everything else is the same for every arm."""

    rollout_weights: str
    """fp8 or bf16 (TrainRunConfig.rollout_weights)."""
    correction: RolloutCorrection
    quantization_aware: bool | None = None
    """The trainer forwards with the FP8 weights the rollout serves; None: on for FP8 rollout (the embedded
    default), off for BF16 rollout (nothing to reproduce)."""

    @property
    def trainer_sees_fp8(self) -> bool:
        return self.rollout_weights == "fp8" if self.quantization_aware is None else self.quantization_aware


ARMS: dict[str, Arm] = {
    "bf16-tis": Arm("bf16", RolloutCorrection(mode="tis")),
    "fp8-none": Arm("fp8", RolloutCorrection(mode="none")),
    "fp8-tis": Arm("fp8", RolloutCorrection(mode="tis")),
    "fp8-icepop": Arm("fp8", RolloutCorrection(mode="icepop")),
    "fp8-geo-mask": Arm("fp8", RolloutCorrection(mode="geo-mask", reject_low=0.99, reject_high=1.01)),
    "fp8-opsm": Arm("fp8", RolloutCorrection(mode="none", opsm=True)),
    "fp8-r3-tis": Arm("fp8", RolloutCorrection(mode="tis", routing_replay=True)),
}
"""The issue's arms, run by default."""
BF16_TRAINER_ARMS: dict[str, Arm] = {
    "fp8-bf16trainer-none": Arm("fp8", RolloutCorrection(mode="none"), quantization_aware=False),
    "fp8-bf16trainer-tis": Arm("fp8", RolloutCorrection(mode="tis"), quantization_aware=False),
}
"""FP8 rollout against a trainer that forwards its BF16 weights (the cluster's mismatch); run with --arms."""
ALL_ARMS = {**ARMS, **BF16_TRAINER_ARMS}
STEP_METRICS = {"abs_dlogprob": "train/train_rollout_logprob_abs_diff",
                "masked_token_frac": "train/correction_masked_token_frac",
                "masked_seq_frac": "train/correction_masked_seq_frac", "opsm_clipfrac": "train/opsm_clipfrac",
                "router_mismatch_frac": "train/router_mismatch_frac", "step_seconds": "perf/step_time"}
"""Per-step numbers averaged per arm (over steps and seeds) -> the metrics.jsonl key they come from."""


@dataclass(frozen=True, kw_only=True)
class LearningSettings:
    """Sizes shared by every arm (tiny-cpu's by default)."""

    steps: int = 30
    """GRPO steps per run."""
    seeds: int = 3
    """Runs per arm, seeds 0 .. seeds-1 (each seed: its own data order, sampling and evaluation, shared by arms)."""
    prompts_per_step: int = 128
    """Prompts per step (tiny-cpu's 128)."""
    n_samples: int = 8
    """Samples per prompt."""
    eval_interval: int = 5
    """Evaluate every this many steps (and at step 0)."""
    n_eval: int = 200
    """Held-out problems per evaluation."""
    eval_samples: int = 8
    """Samples per held-out problem (8 or more: pass@8 is reported)."""
    max_new_tokens: int = 8
    lr: float = 1e-4
    use_ray: bool = False
    """Trainer and rollout as Ray actors (as `v4rl train`); False: in this process (the rollout still over HTTP),
    less start-up per run on a small machine."""

    def __post_init__(self) -> None:
        if min(self.steps, self.seeds, self.prompts_per_step, self.n_samples, self.eval_interval, self.n_eval) < 1:
            raise ValueError("bench learning: steps, seeds, prompts_per_step, n_samples, eval_interval and n_eval "
                             "must all be 1 or more")
        if self.eval_samples < 8:
            raise ValueError(f"bench learning: eval_samples={self.eval_samples}; give 8 or more (pass@8 is reported)")


def parse_arms(arms: str | list[str] | None) -> list[str]:
    """The arms to run, in ALL_ARMS' order; a comma list or None (the issue's seven, ARMS). An unknown name is one
    line naming the known."""
    if arms is None:
        return list(ARMS)
    names = [a.strip() for a in (arms.split(",") if isinstance(arms, str) else arms) if a.strip()]
    unknown = [a for a in names if a not in ALL_ARMS]
    if unknown or not names:
        raise ValueError(f"--arms: unknown arm(s) {unknown or names}; choose from {', '.join(ALL_ARMS)}")
    return [a for a in ALL_ARMS if a in names]


def run_config(arm: str, seed: int, settings: LearningSettings, base: str | None = None):
    """The TrainRunConfig of one arm and seed (only the rollout weights and the correction differ between arms)."""
    from engines.train.run import TrainRunConfig

    spec = ALL_ARMS[arm]
    default = TrainRunConfig()
    loop = dataclasses.replace(default.loop, seed=seed, prompts_per_step=settings.prompts_per_step,
                               n_samples=settings.n_samples, eval_interval=settings.eval_interval,
                               eval_samples=settings.eval_samples, max_new_tokens=settings.max_new_tokens)
    return TrainRunConfig(base=base or default.base, steps=settings.steps, save_interval=settings.steps,
                          n_eval=settings.n_eval, lr=settings.lr, loop=loop, use_ray=settings.use_ray,
                          rollout_weights=spec.rollout_weights, quantization_aware=spec.trainer_sees_fp8,
                          rollout_correction=spec.correction,
                          mismatch_action="alert")


def _mean_se(values: list[float]) -> tuple[float, float | None]:
    mean = sum(values) / len(values)
    return mean, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None)


def summarize(arm: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One arm over its seeds: pass@k per evaluated step (mean, se across seeds) and the per-step numbers."""
    steps = sorted(set.intersection(*({e["step"] for e in r["evals"]} for r in runs)))
    evals = []
    for step in steps:
        row: dict[str, Any] = {"step": step}
        for k in ("pass@1", "pass@8"):
            row[k], row[f"{k}_se"] = _mean_se([next(e[k] for e in r["evals"] if e["step"] == step) for r in runs])
        evals.append(row)
    per_step: dict[str, float | None] = {}
    for name, key in STEP_METRICS.items():
        values = [row[key] for r in runs for row in r["metrics"] if key in row]
        per_step[name] = sum(values) / len(values) if values else None
    spec = ALL_ARMS[arm]
    return {"arm": arm, "rollout_weights": spec.rollout_weights, "trainer_sees_fp8": spec.trainer_sees_fp8,
            "correction": spec.correction.to_dict(), "seeds": len(runs),
            "evals": evals, **per_step}


RUN_RESULT = "bench-run.json"
"""A finished run's result inside its run directory; a run directory without it is an unfinished run."""


def _run_one(arm: str, seed: int, settings: LearningSettings, run_dir: Path, base: str | None) -> dict[str, Any]:
    """One arm and seed: reused from run_dir/bench-run.json when that run finished with these settings, else run
    from scratch (an unfinished run's directory is removed: resuming it would change its data order)."""
    from engines.train.run import run_training

    done, same_run = run_dir / RUN_RESULT, {**dataclasses.asdict(settings), "seeds": None}  # a seed's run is the
    if done.exists():                                                                     # same whatever the count
        kept = json.loads(done.read_text())
        if kept.get("settings") == same_run and kept.get("base") == base:
            return kept["run"]
        raise ValueError(f"{done}: finished with other settings or base than this run's; give another --work-dir "
                         "or remove that directory")
    if run_dir.exists():
        shutil.rmtree(run_dir)
    started = time.monotonic()
    summary = run_training(run_dir, run_config(arm, seed, settings, base), log=lambda m: None)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    run = {"seed": seed, "evals": summary["evals"], "metrics": rows, "wall_seconds": time.monotonic() - started}
    tmp = done.with_name(f".{RUN_RESULT}.tmp")
    tmp.write_text(json.dumps({"settings": same_run, "base": base, "run": run}))
    os.replace(tmp, done)
    return run


BASELINE = "bf16-tis"
GAP_FROM_STEP = 5
"""The learning gap is averaged over the evaluations from this step on (step 0 is the shared base)."""


def gap_to_baseline(runs: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> dict[str, Any]:
    """Held-out pass@1 of an arm minus BF16 rollout's, paired by seed (a seed's arms share data and evaluation):
    per seed the mean difference over the evaluations from GAP_FROM_STEP on, and at the last one; then mean and
    standard error across the seeds both arms ran."""
    def by_step(run):
        return {e["step"]: e["pass@1"] for e in run["evals"]}

    base = {r["seed"]: by_step(r) for r in baseline}
    pairs = [(by_step(r), base[r["seed"]]) for r in runs if r["seed"] in base]
    if not pairs:
        return {"mean": None, "se": None, "last": None, "last_se": None, "seeds": 0}
    steps = sorted(set.intersection(*(set(a) & set(b) for a, b in pairs)))
    later = [s for s in steps if s >= GAP_FROM_STEP]
    mean, se = _mean_se([sum(a[s] - b[s] for s in later) / len(later) for a, b in pairs]) if later else (None, None)
    last, last_se = _mean_se([a[steps[-1]] - b[steps[-1]] for a, b in pairs])
    return {"mean": mean, "se": se, "last": last, "last_se": last_se, "from_step": GAP_FROM_STEP,
            "last_step": steps[-1], "seeds": len(pairs)}


def main(json_out: Path, *, steps: int | None = None, arms: str | list[str] | None = None, seeds: int | None = None,
         prompts_per_step: int | None = None, n_eval: int | None = None, settings: LearningSettings | None = None,
         work_dir: Path | None = None, base: str | None = None, log=print) -> dict[str, Any]:
    """Run every arm x seed, write OUT (JSON) and its PNG; `work_dir` keeps the runs and their results, and the
    runs that finished there are reused (default: a temp dir, nothing kept)."""
    from bench.learning_plot import learning_table, plot_learning

    settings = settings or LearningSettings()
    given = {"steps": steps, "seeds": seeds, "prompts_per_step": prompts_per_step, "n_eval": n_eval}
    settings = dataclasses.replace(settings, **{k: v for k, v in given.items() if v})
    names, json_out = parse_arms(arms), Path(json_out)
    machine = machine_info()
    results, runs_of = [], {}
    with tempfile.TemporaryDirectory(prefix="v4rl-bench-learning-") as tmp:
        work = Path(work_dir) if work_dir else Path(tmp)
        for arm in names:
            runs = []
            for seed in range(settings.seeds):
                runs.append(_run_one(arm, seed, settings, work / arm / f"seed-{seed}", base))
                last = runs[-1]["evals"][-1]
                log(f"{arm} seed {seed}: pass@1 {last['pass@1']:.3f} at step {last['step']} "
                    f"({runs[-1]['wall_seconds']:.0f} s)")
            results.append(summarize(arm, runs))
            runs_of[arm] = runs
    if BASELINE in runs_of:
        base_seconds = next(r["step_seconds"] for r in results if r["arm"] == BASELINE)
        for row in results:
            row["gap_pass@1_vs_bf16"] = gap_to_baseline(runs_of[row["arm"]], runs_of[BASELINE])
            row["step_seconds_vs_bf16"] = row["step_seconds"] / base_seconds if base_seconds else None
    result = {"settings": dataclasses.asdict(settings), "arms": results, "machine": machine,
              "load_avg_1m_at_end": load_average()}
    json_out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = json_out.with_name(f".{json_out.name}.tmp")
    tmp_out.write_text(json.dumps(result, indent=2))
    os.replace(tmp_out, json_out)
    result["plot"] = str(plot_learning(result, json_out.with_suffix(".png")))
    log(learning_table(result))
    return result
