"""`v4rl bench e2e --json OUT [--steps N]`: `v4rl train` against TRL's GRPOTrainer, end to end, in one run.

Both sides start from the same base (engines/tiny_base), train on the same prompts and labels in the same
order (v4rl's step schedule over the synthetic task), with the same prompts x samples per step, max new tokens,
temperature, constant AdamW learning rate and betas, gradient clip, clip range, loss aggregation (token-mean
unless E2ESettings.loss_aggregation says sample-mean) and no KL term, on CPU (bench/e2e_settings.py; what differs
and why: bench/e2e_trl.py DIFFERENCES, also in the JSON).

  v4rl   engines.train.run.run_training, exactly what `v4rl train` runs: rollout server and trainer as Ray
         actors, rollout over HTTP, FP8 weight sync every step; in-run evaluation off.
  TRL    trl.GRPOTrainer in a child process (python -m bench.e2e_trl): transformers `generate` for rollouts, one
         optimizer step per GRPO step.

The sides alternate step by step (v4rl step k, TRL step k, v4rl step k+1, ...), each idle while the other
works, so a shared machine's load hits both alike; each side times its own step (v4rl: perf/step_time =
rollout + train + weight sync; TRL: on_step_begin to on_step_end = generation + reward + train + AdamW).
seconds_per_step is each side's median, speedup the median over steps of TRL's step time over v4rl's.
Both sides' weights are saved at step 0, every eval_interval steps and the last step, and all are evaluated
afterwards by the same evaluator (bench/e2e_snapshots.py: v4rl's held-out evaluation, 200 problems x 8
samples); pass@1 / pass@8 are plotted against each side's cumulative training seconds (start-up and
evaluation excluded) in OUT's folder as <OUT stem>.png.

    v4rl bench e2e --json runs/bench/e2e.json            # default 20 steps
    v4rl bench e2e --json runs/bench/e2e.json --steps 50
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# libgomp's default spin-wait makes a torch process on a loaded CPU machine ~10x slower; the TRL child and
# the Ray actors inherit the setting. It only takes effect if torch is not imported yet.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from bench import load_average, machine_info  # noqa: E402
from bench.e2e_settings import E2ESettings, v4rl_config  # noqa: E402

SPEED_GOAL = 3.0
"""v4rl's steps per second over TRL's."""
NOISE_SIGMAS = 2.0
"""Learning counts as no worse while v4rl's pass@1 is at most this many standard errors of the difference below
TRL's at every evaluated step after 0."""
STEP_TIMEOUT_S = 3600.0


class TRLSideFailed(RuntimeError):
    """The TRL child process failed; the message holds its traceback."""


def main(json_out: Path, *, steps: int | None = None, settings: E2ESettings | None = None,
         work_dir: Path | None = None, seeds: int = 1, arms: str | None = None) -> dict[str, Any]:
    """Run both sides for each of `seeds` seeds (settings.seed, +1, ...) and, per seed, every extra arm of
    bench/e2e_arms.py named in `arms`; write the JSON and the plot. `work_dir` keeps the runs and weight snapshots
    there (default: a temporary directory, removed at the end)."""
    from bench.e2e_arms import parse_arms
    from bench.e2e_trl import require_trl

    trl_version = require_trl()
    arm_names = parse_arms(arms)
    settings = settings or E2ESettings()
    if steps is not None:
        settings = E2ESettings(**{**settings.to_dict(), "steps": steps})
    json_out = Path(json_out)
    if work_dir and Path(work_dir).exists() and any(Path(work_dir).iterdir()):
        raise ValueError(f"work_dir {work_dir} is not empty; `v4rl train` would resume the run found there. "
                         "Pass an empty or new directory")
    machine = machine_info()
    with tempfile.TemporaryDirectory(prefix="v4rl-bench-e2e-") as tmp:
        work = Path(work_dir) if work_dir else Path(tmp)
        per_seed = []
        for offset in range(seeds):
            seeded = E2ESettings(**{**settings.to_dict(), "seed": settings.seed + offset})
            per_seed.append(_run_seed(seeded, work / f"seed-{seeded.seed}", arm_names, machine, trl_version))
    machine["load_avg_1m_at_end"] = load_average()
    result = _over_seeds(per_seed, settings, machine, trl_version)
    from bench.e2e_plot import plot_pass_at_k_vs_seconds

    result["plot"] = str(plot_pass_at_k_vs_seconds(result, json_out.with_suffix(".png")))
    json_out.parent.mkdir(parents=True, exist_ok=True)
    partial = json_out.with_name(f".{json_out.name}.partial")
    partial.write_text(json.dumps(result, indent=1) + "\n")
    partial.replace(json_out)
    _print_summary(result, json_out)
    return result


def _run_seed(settings: E2ESettings, work: Path, arms: list[str], machine: dict, trl_version: str) -> dict[str, Any]:
    """One seed: `v4rl train` (the default arm) alternating step by step with TRL, then each extra arm alone, then
    one evaluator over every snapshot."""
    from bench.e2e_snapshots import cross_format_evals, evaluate_snapshots

    with TRLSide(settings, work / "trl") as trl:
        v4rl = _run_v4rl(settings, work / "v4rl", trl)
        trl_log = trl.finish()
    extra, failed = {}, {}
    for arm in arms[1:]:  # an arm that fails (out of memory, say) is reported; the others' results are kept
        try:
            extra[arm] = _run_v4rl(settings, work / arm, None, arm=arm)
        except Exception as exc:
            from v4rl.errors import one_line_error

            failed[arm] = one_line_error(exc)
            print(f"[{arm}] failed: {failed[arm]}")
    evals = evaluate_snapshots(settings, {"v4rl": v4rl["snapshots"], "trl": trl.snapshots,
                                          **{arm: run["snapshots"] for arm, run in extra.items()}})
    cross = cross_format_evals(settings, work / "v4rl", trl.snapshots[settings.steps], work / "cross-format")
    result = _result(settings, machine, v4rl, trl, trl_log, {side: evals[side] for side in ("v4rl", "trl")},
                     trl_version)
    result["cross_format_last_step"] = cross
    result["arms"] = {arm: {"error": error} for arm, error in failed.items()}
    for arm, run in extra.items():
        seconds = [r["perf/step_time"] for r in run["rows"]]
        elapsed = _cumulative(seconds)
        for e in evals[arm]:
            e["train_seconds"] = elapsed[e["step"]]
        result["arms"][arm] = {"seconds_per_step": statistics.median(seconds), "evals": evals[arm],
                               "reward": [r["rollout/raw_reward"] for r in run["rows"]],
                               "learning": _learning([{"v4rl": evals[arm], "trl": evals["trl"]}])}
    return result


# ---------------------------------------------------------------------------------------------- the TRL side
class TRLSide:
    """TRL's trainer in a child process (`python -m bench.e2e_trl`) that takes one GRPO step each time `take_step`
    hands it the turn; the two talk over a socket pair (no port)."""

    def __init__(self, settings: E2ESettings, out_dir: Path) -> None:
        self.settings, self.out_dir = settings, Path(out_dir)
        self.step_s: list[float] = []
        self.phases: list[dict[str, float]] = []
        self.setup_s = 0.0

    def __enter__(self) -> "TRLSide":
        from multiprocessing.connection import Connection

        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.e2e_trl", "--fd", str(theirs.fileno()), "--out", str(self.out_dir),
             "--settings", json.dumps(self.settings.to_dict())], pass_fds=[theirs.fileno()])
        theirs.close()
        self.conn = Connection(ours.detach())
        try:
            self.setup_s = self._receive("ready")[1]
        except BaseException:
            self.__exit__()
            raise
        return self

    def take_step(self, step: int) -> None:
        self.conn.send("go")
        _, done, seconds, phases = self._receive("step")
        if done != step:
            raise TRLSideFailed(f"TRL reported step {done} when the bench expected step {step}")
        self.step_s.append(seconds)
        self.phases.append(phases)

    def finish(self) -> list[dict[str, Any]]:
        """TRL's log history once its last step is done (the child then exits)."""
        log = self._receive("done")[1]
        self.process.wait(timeout=120)
        return log

    @property
    def snapshots(self) -> dict[int, Path]:
        from bench.e2e_snapshots import snapshot_dir

        return {step: snapshot_dir(self.out_dir / "snapshots" / "trl", step) for step in self.settings.eval_steps()}

    def _receive(self, kind: str) -> tuple:
        deadline = time.monotonic() + STEP_TIMEOUT_S
        try:
            while not self.conn.poll(1.0):
                if self.process.poll() is not None:
                    raise EOFError
                if time.monotonic() > deadline:
                    raise TRLSideFailed(f"the TRL side (pid {self.process.pid}) sent no {kind!r} within "
                                        f"{STEP_TIMEOUT_S:.0f}s")
            message = self.conn.recv()
        except EOFError:
            raise TRLSideFailed(f"the TRL side (pid {self.process.pid}) exited with code {self.process.wait(30)} "
                                f"while the bench waited for {kind!r}; its output is above") from None
        if message[0] == "error":
            raise TRLSideFailed(f"the TRL side failed:\n{message[1]}")
        if message[0] != kind:
            raise TRLSideFailed(f"the TRL side sent {message[0]!r} when the bench expected {kind!r}")
        return message

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            self.process.terminate()  # this bench's own child, by its pid
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
        self.conn.close()


# ---------------------------------------------------------------------------------------------- the v4rl side
def _run_v4rl(settings: E2ESettings, run_dir: Path, trl: TRLSide | None, arm: str = "v4rl") -> dict[str, Any]:
    """`v4rl train` with the shared settings, changed as `arm` says (bench/e2e_arms.py); after each of its steps the
    TRL side, if given, takes the same step."""
    from bench.e2e_arms import arm_config
    from bench.e2e_snapshots import copy_snapshot, save_rollout_start, snapshot_dir
    from engines.train.run import run_training

    snapshots_root = run_dir.parent / "snapshots" / run_dir.name
    save_rollout_start(snapshots_root, settings.base)
    wanted = set(settings.eval_steps())
    rows: list[dict[str, float]] = []
    turn = {"since": time.perf_counter()}

    def after_step(step: int, metrics: dict) -> None:
        rows.append({"step": step, "wall_s": time.perf_counter() - turn["since"], "load_1m": load_average(), **metrics})
        if step in wanted:
            copy_snapshot(run_dir / "weights" / "current", snapshots_root, step)
        if trl is not None:
            trl.take_step(step)
        turn["since"] = time.perf_counter()

    run_training(run_dir, arm_config(arm, v4rl_config(settings)), on_step=after_step,
                 log=lambda line: print(f"[{arm}] {line}"))
    # the first turn began when run_training was called: Ray, the actors and the rollout server start in it
    startup_s = rows[0]["wall_s"] - rows[0]["perf/step_time"]
    return {"rows": rows, "startup_s": startup_s,
            "snapshots": {step: snapshot_dir(snapshots_root, step) for step in sorted(wanted)}}


# ---------------------------------------------------------------------------------------------- results
def _result(settings: E2ESettings, machine: dict, v4rl: dict, trl: TRLSide, trl_log: list[dict],
            evals: dict[str, list[dict]], trl_version: str) -> dict[str, Any]:
    from bench.e2e_trl import DIFFERENCES

    rows = v4rl["rows"]
    ours_s = [r["perf/step_time"] for r in rows]
    pairs = [{"step": r["step"], "v4rl_s": o, "trl_s": t, "ratio": t / o, "load_1m": r["load_1m"]}
             for r, o, t in zip(rows, ours_s, trl.step_s)]
    trl_rewards = [e["reward"] for e in trl_log if "reward" in e]
    elapsed = {"v4rl": _cumulative(ours_s), "trl": _cumulative(trl.step_s)}
    for side, side_evals in evals.items():
        for e in side_evals:
            e["train_seconds"] = elapsed[side][e["step"]]
    learning = _learning([evals])
    speedup = statistics.median(p["ratio"] for p in pairs)
    phases = _phases(rows, trl)
    return {
        "steps": settings.steps,
        "seconds_per_step": {"v4rl": statistics.median(ours_s), "trl": statistics.median(trl.step_s)},
        "speedup": speedup,
        "trl_version": trl_version,
        "settings": settings.to_dict(),
        "differences": DIFFERENCES,
        "pairs": pairs,
        "phases_median_s": phases,
        "phase_speedup": {name: phases["trl"][name] / phases["v4rl"][name] for name in ("rollout", "train")},
        "startup_s": {"v4rl": v4rl["startup_s"], "trl": trl.setup_s},
        "v4rl_turn_wall_s_median": statistics.median(r["wall_s"] for r in rows[1:]) if len(rows) > 1 else None,
        "reward": {"v4rl": [r["rollout/raw_reward"] for r in rows], "trl": trl_rewards},
        "evals": evals,
        "learning": learning,
        "machine": machine,
        "goals": {"steps_per_second_vs_trl": {"goal": f">= {SPEED_GOAL}x", "value": speedup, "met": speedup >= SPEED_GOAL},
                  "learning_per_step_no_worse": {"goal": f"held-out pass@1 at equal steps >= TRL's - {NOISE_SIGMAS:g} "
                                                         "standard errors of the difference",
                                                 "met": learning["no_worse"]}},
        "note": "seconds per step: each side's own step clock, sides alternating step by step in one run; "
                "speedup = median over steps of TRL seconds / v4rl seconds; evaluation: the same evaluator on "
                "each side's weights at the same steps; train_seconds = cumulative step seconds",
    }


def _phases(rows: list[dict], trl: TRLSide) -> dict[str, dict[str, float]]:
    """Median seconds per phase of a step. rollout = generation + grading + advantages on both sides (v4rl: its
    perf/rollout_time, over HTTP; TRL: _generate_and_score_completions), train = forward + backward + AdamW
    (v4rl: perf/train_time, a Ray call; TRL: the rest of its step)."""
    median = statistics.median
    return {
        "v4rl": {"rollout": median(r["perf/rollout_time"] for r in rows),
                 "train": median(r["perf/train_time"] for r in rows),
                 "weight_sync": median(r["perf/update_weights_time"] for r in rows),
                 # how the trainer computed (engines/train/trainer.py grpo_step): a slower path shows here
                 "train_threads": median(r["perf/train_threads"] for r in rows),
                 "train_tokens_per_s": median(r["perf/train_tokens_per_s"] for r in rows),
                 "train_forwarded_per_token": median(r["perf/train_forwarded_tokens"] / r["perf/train_tokens"]
                                                     for r in rows)},
        "trl": {"rollout": median(p["rollout_s"] for p in trl.phases),
                "generate": median(p["generate_s"] for p in trl.phases),
                "train": median(s - p["rollout_s"] for s, p in zip(trl.step_s, trl.phases))}}


def _cumulative(seconds: list[float]) -> list[float]:
    """[0, s1, s1 + s2, ...]: training seconds elapsed after each step (index = step)."""
    out = [0.0]
    for s in seconds:
        out.append(out[-1] + s)
    return out


def _learning(per_seed: list[dict[str, list[dict]]]) -> dict[str, Any]:
    """pass@1 of both sides ({"v4rl": evals, "trl": evals} per seed) at each evaluated step, averaged over seeds,
    the difference and its standard error: the larger of the evaluation's sampling noise alone (each pass@1's
    binomial standard error, combined) and the spread of the per-seed differences (which adds the training's own
    randomness, estimated from few seeds); with one seed the sampling noise alone."""
    n = len(per_seed)
    trl_steps = [{e["step"]: e for e in evals["trl"]} for evals in per_seed]
    points = []
    for i, ours in enumerate(per_seed[0]["v4rl"]):
        step = ours["step"]
        if any(step not in by_step for by_step in trl_steps):
            continue
        pairs = [(evals["v4rl"][i], by_step[step]) for evals, by_step in zip(per_seed, trl_steps)]
        diffs = [o["pass@1"] - t["pass@1"] for o, t in pairs]
        sampling = math.sqrt(sum(o["pass@1_se"] ** 2 + t["pass@1_se"] ** 2 for o, t in pairs)) / n
        seeds_se = statistics.stdev(diffs) / math.sqrt(n) if n > 1 else None
        noise = max(sampling, seeds_se or 0.0)
        diff = statistics.fmean(diffs)
        points.append({"step": step, "v4rl": statistics.fmean(o["pass@1"] for o, _ in pairs),
                       "trl": statistics.fmean(t["pass@1"] for _, t in pairs), "diff": diff, "diff_se": noise,
                       "diff_se_sampling": sampling, "diff_se_seeds": seeds_se, "diff_per_seed": diffs,
                       "no_worse": diff >= -NOISE_SIGMAS * noise})
    trained = [p for p in points if p["step"] > 0]
    return {"seeds": n, "pass@1": points, "no_worse": bool(trained) and all(p["no_worse"] for p in trained)}


def _mean_evals(per_seed_evals: list[list[dict]]) -> list[dict[str, Any]]:
    """One side's evaluations averaged over seeds, step by step; pass@1_se is the standard error of that mean from
    the evaluations' sampling noise."""
    n = len(per_seed_evals)
    out = []
    for points in zip(*per_seed_evals):
        mean = {key: statistics.fmean(p[key] for p in points)
                for key in ("pass@1", "pass@8", "train_seconds", "n_problems") if key in points[0]}
        mean["pass@1_se"] = math.sqrt(sum(p["pass@1_se"] ** 2 for p in points)) / n
        out.append({"step": points[0]["step"], **mean})
    return out


def _over_seeds(per_seed: list[dict[str, Any]], settings: E2ESettings, machine: dict,
                trl_version: str) -> dict[str, Any]:
    """The bench's result over every seed: speed from all step pairs, learning averaged over seeds (per arm too),
    each seed's own result under per_seed."""
    first = per_seed[0]
    pairs = [{"seed": r["settings"]["seed"], **p} for r in per_seed for p in r["pairs"]]
    speedup = statistics.median(p["ratio"] for p in pairs)
    learning = _learning([r["evals"] for r in per_seed])
    median_of = lambda get: statistics.median(get(r) for r in per_seed)  # noqa: E731
    phases = {side: {name: median_of(lambda r: r["phases_median_s"][side][name]) for name in first["phases_median_s"][side]}
              for side in first["phases_median_s"]}
    arms = {}
    for arm in first["arms"]:
        ran = [r for r in per_seed if "error" not in r["arms"][arm]]
        errors = [r["arms"][arm]["error"] for r in per_seed if "error" in r["arms"][arm]]
        arms[arm] = {"errors": errors} if not ran else {
            "seeds": len(ran), "errors": errors,
            "seconds_per_step": statistics.median(r["arms"][arm]["seconds_per_step"] for r in ran),
            "evals": _mean_evals([r["arms"][arm]["evals"] for r in ran]),
            "learning": _learning([{"v4rl": r["arms"][arm]["evals"], "trl": r["evals"]["trl"]} for r in ran])}
    return {
        **{key: first[key] for key in ("steps", "trl_version", "differences")},
        "settings": {**settings.to_dict(), "seeds": [r["settings"]["seed"] for r in per_seed]},
        "seconds_per_step": {"v4rl": statistics.median(p["v4rl_s"] for p in pairs),
                             "trl": statistics.median(p["trl_s"] for p in pairs)},
        "speedup": speedup,
        "pairs": pairs,
        "phases_median_s": phases,
        "phase_speedup": {name: phases["trl"][name] / phases["v4rl"][name] for name in ("rollout", "train")},
        "evals": {side: _mean_evals([r["evals"][side] for r in per_seed]) for side in ("v4rl", "trl")},
        "reward": {side: [statistics.fmean(values) for values in zip(*(r["reward"][side] for r in per_seed))]
                   for side in ("v4rl", "trl")},
        "learning": learning,
        "arms": arms,
        "cross_format_last_step": [r["cross_format_last_step"] for r in per_seed],
        "per_seed": per_seed,
        "machine": machine,
        "goals": {"steps_per_second_vs_trl": {"goal": f">= {SPEED_GOAL}x", "value": speedup, "met": speedup >= SPEED_GOAL},
                  "learning_per_step_no_worse": {"goal": f"held-out pass@1 at equal steps, averaged over seeds, >= "
                                                         f"TRL's - {NOISE_SIGMAS:g} standard errors of the difference",
                                                 "met": learning["no_worse"]}},
        "note": first["note"] + "; over seeds: speedup = median over every seed's pairs, pass@1 = mean over seeds",
    }


def _print_summary(r: dict[str, Any], json_out: Path) -> None:
    s, p = r["seconds_per_step"], r["phases_median_s"]
    print(f"e2e GRPO ({r['settings']['prompts_per_step']} prompts x {r['settings']['n_samples']} samples, "
          f"{r['steps']} steps each, seeds {r['settings']['seeds']}, TRL {r['trl_version']}):")
    v = p["v4rl"]
    print(f"  v4rl {s['v4rl']:.2f} s/step (rollout {v['rollout']:.2f}, train {v['train']:.2f}, "
          f"weight sync {v['weight_sync']:.2f}); trainer {v['train_tokens_per_s']:.0f} tok/s on "
          f"{v['train_threads']:.0f} threads, {v['train_forwarded_per_token']:.2f} forwarded per token")
    print(f"  TRL  {s['trl']:.2f} s/step (rollout {p['trl']['rollout']:.2f} of which generate "
          f"{p['trl']['generate']:.2f}, train {p['trl']['train']:.2f})")
    print(f"  speedup {r['speedup']:.2f}x (median of pairs; goal >= {SPEED_GOAL:g}x: "
          f"{'met' if r['goals']['steps_per_second_vs_trl']['met'] else 'NOT met'})")
    for point in r["learning"]["pass@1"]:
        print(f"  step {point['step']:4d}: pass@1 v4rl {point['v4rl']:.3f}, TRL {point['trl']:.3f} "
              f"(diff {point['diff']:+.3f} +- {point['diff_se']:.3f})")
    for arm, result in r["arms"].items():
        if "learning" not in result:
            print(f"  arm {arm}: failed on every seed: {result['errors'][0]}")
            continue
        worst = min(result["learning"]["pass@1"], key=lambda point: point["diff"])
        print(f"  arm {arm}: {result['seconds_per_step']:.2f} s/step; pass@1 vs TRL at step {worst['step']} (its "
              f"largest gap) {worst['diff']:+.3f} +- {worst['diff_se']:.3f}; no worse: "
              f"{'yes' if result['learning']['no_worse'] else 'NO'}")
    for c in r["cross_format_last_step"]:
        print(f"  step {c['step']:4d}: TRL's weights as FP8 pass@1 {c['trl_as_fp8']['pass@1']:.3f}, v4rl's fp32 "
              f"master {c['v4rl_master_fp32']['pass@1']:.3f}")
    print(f"  learning per step no worse: {'yes' if r['learning']['no_worse'] else 'NO'}; plot {r['plot']}")
    print(f"wrote {json_out}")
