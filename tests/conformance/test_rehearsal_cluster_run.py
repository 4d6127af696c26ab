"""The cluster path's steps without the flow around them: `train_run` (engines/miles/pipeline.py) drives Miles' own
train.py as ONE `ray job submit` to a local Ray head (engines/upstream/rehearsal/cluster_run.py local_cluster), then
`evaluate_step` rewrites a lost evaluation with Miles' eval-only job on the kept checkpoint (a step the flow calls
only when Miles' own record is missing: tests/conformance/test_cluster_rehearsal.py runs the deployment, kill and
resume included). Slow (two Miles jobs, about 2.5 min on the idle 2 cores); `-m slow`.

    .venv/bin/python -m pytest tests/conformance/test_rehearsal_cluster_run.py -m slow -q
"""

from __future__ import annotations

import json
import time

import pytest


@pytest.mark.slow
def test_train_run_and_evaluate_step_on_a_local_ray_head(miles_tree, sglang_paths, tmp_path):
    from checkpoints.convert import convert_hf_to_torch_dist
    from engines.miles.command import MilesJob
    from engines.miles.pipeline import evaluate_step, train_run
    from engines.miles.runner import MilesRunError
    from engines.upstream.rehearsal.cluster_run import local_cluster

    t0 = time.monotonic()
    work = tmp_path / "work"
    job = MilesJob(run_id="miles", hf_checkpoint=str(work / "hf"), ref_load=str(work / "ref"),
                   save_dir=str(work / "save"), miles_dir="", log_dir=str(work))
    with local_cluster(work, job, run_dir=work / "run", miles_dir=str(miles_tree)) as run:
        convert_hf_to_torch_dist(work / "hf", work / "ref", workers=1, megatron_names="plugin")  # the flow's convert
        summary = train_run(run, 3)
        print(f"the training job in {time.monotonic() - t0:.0f} s")
        record = tmp_path / "work" / "run" / "eval" / "step_000003.json"
        trained_record = json.loads(record.read_text())
        record.unlink()  # a lost record: Miles' eval-only job on the kept checkpoint writes it again
        t1 = time.monotonic()
        again = evaluate_step(run, 3)
        print(f"eval-only job in {time.monotonic() - t1:.0f} s")
    assert record.is_file() and again["step"] == 3 and set(again) >= {"pass@1", "n_problems"}, again
    assert again["n_problems"] == trained_record["n_problems"], (again, trained_record)
    assert summary["resumed_from"] == 0 and summary["last_step"] == 3, summary
    rows = [json.loads(line) for line in (tmp_path / "work" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3] and all("train/grad_norm" in row for row in rows), rows
    assert sorted(p.name for p in (tmp_path / "work" / "run" / "eval").iterdir()) == [
        f"step_{step:06d}.json" for step in range(4)]
    log = (tmp_path / "work" / "miles.log").read_text()
    assert log.count("submitted successfully") == 2  # the training job, the eval-only job
