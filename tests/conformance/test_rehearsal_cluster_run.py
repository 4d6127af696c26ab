"""The cluster path's training step, `train_run` (engines/miles/pipeline.py), driving Miles' own train.py as ONE
`ray job submit` to a local Ray head (engines/upstream/rehearsal/cluster_run.py): a job whose driver is killed
after rollout 1 fails retryably, and the task's retry resumes it from --load, each rollout trained and each
evaluation recorded once; then `evaluate_step` rewrites a lost evaluation with Miles' eval-only job on the kept
checkpoint. Slow (three Miles jobs: 126 s + 37 s on the idle 2 cores); `-m slow`.

    .venv/bin/python -m pytest tests/conformance/test_rehearsal_cluster_run.py -m slow -q
"""

from __future__ import annotations

import json
import threading
import time

import pytest


def _kill_after_rollout_1(run, stop: threading.Event) -> None:
    """SIGKILL the job's driver once rollout 1 is saved and the broadcast after it recorded (not in the middle of a
    broadcast into the engine, which the retry's job then uses as it is); the evaluation after rollout 1 may or may
    not have run, and the retry evaluates first exactly when its record is missing."""
    from pathlib import Path

    from engines.upstream.rehearsal.full import latest_iteration
    from engines.upstream.rehearsal.submitted import kill_job_driver

    save, broadcast = Path(run.job.save_dir), Path(run.job.log_dir) / "broadcasts" / "broadcast-v3.json"
    while not stop.wait(0.2):
        if (latest_iteration(save) or -1) >= 1 and broadcast.is_file() and kill_job_driver(run.adapt.mark):
            return


@pytest.mark.slow
def test_train_run_on_a_local_ray_head_resumes_a_killed_job_once(miles_tree, sglang_paths, tmp_path):
    from engines.miles.pipeline import evaluate_step, train_run
    from engines.miles.runner import MilesRunError
    from engines.presets.runs import SEED_RUN
    from engines.upstream.rehearsal.cluster_run import rehearsal_cluster_run

    t0 = time.monotonic()
    with rehearsal_cluster_run(SEED_RUN, tmp_path / "work", miles_dir=str(miles_tree)) as run:
        stop = threading.Event()
        killer = threading.Thread(target=_kill_after_rollout_1, args=(run, stop), daemon=True)
        killer.start()
        with pytest.raises(MilesRunError) as killed:
            train_run(run, 3, on_line=None)
        stop.set()
        assert killed.value.retryable, str(killed.value)
        summary = train_run(run, 3)  # the Prefect task's retry
        print(f"two jobs in {time.monotonic() - t0:.0f} s")
        record = tmp_path / "work" / "run" / "eval" / "step_000003.json"
        trained_record = json.loads(record.read_text())
        record.unlink()  # a lost record: Miles' eval-only job on the kept checkpoint writes it again
        t1 = time.monotonic()
        again = evaluate_step(run, 3)
        print(f"eval-only job in {time.monotonic() - t1:.0f} s")
    assert record.is_file() and again["step"] == 3 and set(again) >= {"pass@1", "n_problems"}, again
    assert again["n_problems"] == trained_record["n_problems"], (again, trained_record)
    assert summary["resumed_from"] == 2 and summary["last_step"] == 3, summary
    rows = [json.loads(line) for line in (tmp_path / "work" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3] and all("train/grad_norm" in row for row in rows), rows
    assert sorted(p.name for p in (tmp_path / "work" / "run" / "eval").iterdir()) == [
        f"step_{step:06d}.json" for step in range(4)]
    log = (tmp_path / "work" / "miles.log").read_text()
    assert log.count("submitted successfully") == 3  # the killed job, its retry, the eval-only job
