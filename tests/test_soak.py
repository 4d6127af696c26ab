"""Soak: a 300-step tiny-cpu GRPO run (`v4rl train`, Ray actors, rollout over HTTP) watched from outside.

Asserts, over the whole run:
  * every step committed exactly once, the run ends at step 300;
  * train/rollout |Δlogprob| bounded (every step's mean <= 0.09) and not drifting up;
  * no memory growth: the RSS of the driver, the trainer actor and the rollout actor, sampled at every
    committed step, grows by less than max(64 MiB, 10 %) from the fifth of the run after a 10 % warm-up
    to the last fifth;
  * nothing left behind: every process of the run's tree has exited and no new TCP listener remains.

Not in CI (marker `soak`; 7 min 41 s on an idle 2-core machine). Run by hand before a release:

    .venv/bin/python -m pytest tests/test_soak.py -m soak -s

32 prompts x 8 samples per step (the tiny-cpu model and settings otherwise) so 300 steps and 300 weight
updates fit in well under an hour; V4RL_SOAK_STEPS shortens it for a try-out. The samples land in
<tmp>/run/soak.json, printed at the end.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from rl.stats import drift, drifting_up

STEPS = int(os.environ.get("V4RL_SOAK_STEPS", "300"))
MAX_WALL_S = 3 * 3600
DIFF_BOUND = 0.09
GROWTH_ABS_MB, GROWTH_REL = 64.0, 0.10
ROLES = {"trainer": "TrainerWorker", "rollout": "RolloutWorker"}


def _listening_ports() -> set[int]:
    return {c.laddr.port for c in psutil.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}


def _rss_by_role(driver: psutil.Process) -> tuple[dict[str, float], set[int]]:
    """RSS in MiB of the driver and of each actor process; also every pid in the driver's tree."""
    rss: dict[str, float] = {}
    pids = {driver.pid}
    try:
        rss["driver"] = driver.memory_info().rss / 2**20
        tree = driver.children(recursive=True)
    except psutil.NoSuchProcess:
        return rss, pids
    for p in tree:
        try:
            pids.add(p.pid)
            title = " ".join(p.cmdline())
            for role, marker in ROLES.items():
                if marker in title:
                    rss[role] = rss.get(role, 0.0) + p.memory_info().rss / 2**20
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return rss, pids


def _committed_rows(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    return sum(1 for line in metrics.read_text().splitlines() if line.strip())


@pytest.mark.soak
def test_soak_run_stays_bounded(tmp_path):
    out = tmp_path / "run"
    listeners_before = _listening_ports()
    log_path = tmp_path / "train.log"
    cmd = [sys.executable, "-m", "v4rl.cli", "train", "--out", str(out), "--steps", str(STEPS),
           "--prompts-per-step", "32", "--eval-interval", "50", "--n-eval", "64"]
    samples: list[dict] = []
    seen_pids: set[int] = set()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        driver = psutil.Process(proc.pid)
        started = time.monotonic()
        try:
            while proc.poll() is None:
                rows = _committed_rows(out / "metrics.jsonl")
                rss, pids = _rss_by_role(driver)
                seen_pids |= pids
                if rows > (samples[-1]["rows"] if samples else 0) and {"trainer", "rollout"} <= set(rss):
                    samples.append({"rows": rows, "t": time.monotonic() - started, **rss})
                assert time.monotonic() - started < MAX_WALL_S, f"soak exceeded {MAX_WALL_S}s; see {log_path}"
                time.sleep(1.0)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait(30)
    tail = log_path.read_text()[-3000:]
    assert proc.returncode == 0, f"v4rl train exited {proc.returncode}:\n{tail}"

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    diffs = [m["train/train_rollout_logprob_abs_diff"] for m in metrics]
    fit = drift([m["step"] for m in metrics], diffs)
    growth = {}
    fifth = max(1, len(samples) // 5)
    warm = len(samples) // 10  # allocator pools and Ray workers fill up during the first steps
    for role in ("driver", "trainer", "rollout"):
        early = statistics.median(s[role] for s in samples[warm:warm + fifth] if role in s)
        late = statistics.median(s[role] for s in samples[-fifth:] if role in s)
        growth[role] = {"early_mb": early, "late_mb": late, "growth_mb": late - early,
                        "allowed_mb": max(GROWTH_ABS_MB, GROWTH_REL * early)}

    time.sleep(2.0)  # let Ray's own shutdown finish reaping
    leftovers = []
    for pid in seen_pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                leftovers.append(f"{pid} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            continue
    new_listeners = _listening_ports() - listeners_before
    summary = {"steps": STEPS, "wall_s": samples[-1]["t"] if samples else None, "samples": samples,
               "logprob_abs_diff": {"max": max(diffs), "mean": statistics.fmean(diffs), "slope": fit.slope,
                                    "slope_stderr": fit.stderr},
               "rss_growth": growth, "leftover_processes": leftovers, "new_listeners": sorted(new_listeners)}
    (out / "soak.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "samples"}, indent=1))

    assert len(samples) >= STEPS // 2, "too few RSS samples: the watcher missed most steps"
    assert max(diffs) <= DIFF_BOUND, f"a step's mean |Δlogprob| reached {max(diffs):.4f} > {DIFF_BOUND}"
    assert not drifting_up(fit.slope, fit.stderr, min_slope=0.01 / STEPS), f"logprob diff drifts up: {fit}"
    for role, g in growth.items():
        assert g["growth_mb"] < g["allowed_mb"], f"{role} RSS grew {g['growth_mb']:.0f} MiB: {g}"
    assert not leftovers, f"processes left behind: {leftovers}"
    assert not new_listeners, f"TCP listeners left behind on ports {sorted(new_listeners)}"
