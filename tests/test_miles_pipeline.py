"""The cluster path's pipeline steps (engines/train/miles/pipeline.py) wired end to end on CPU from the flow's
parameters (flows/rl_pipeline.py `_miles`): the real job builder (prepare_job, submit_argv), the derived jobs,
the runner and the recorder, against a stand-in for
`ray job submit` that behaves as Miles' train.py does at the file level (start at the tracker's iteration + 1
or 0 without one, save every --save-interval and at the last rollout with the data cursor, evaluate before
training unless skipped and every --eval-interval, `--num-rollout 0` = evaluate once) and prints Miles' log
lines (tests/test_miles_readback.py). It checks v4rl's side: segments resume without training a step twice,
a killed job is retried from its checkpoint, step 0 is Miles' eval-only job on --ref-load, and the run
directory is the tiny-cpu one. It does not check Miles (tests/conformance/ and the `gpu` test do).
NUM_GPUS = 0; about 50 s (each stand-in job is a Python process).

    .venv/bin/python -m pytest tests/test_miles_pipeline.py -q
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from engines.site import Site
from engines.train.miles import MilesJob, MilesRunError
from engines.train.miles.pipeline import ClusterRun, evaluate_step, train_segment

REPO = Path(__file__).resolve().parent.parent

STAND_IN = r'''
import json, os, sys
sys.path.insert(0, {repo!r})
from engines.train.miles.jobs import flag_values
from tests.test_miles_readback import eval_line, rollout_side_perf, save_rollout, trainer_lines

argv = sys.argv[sys.argv.index("--") + 3:]  # after `-- python3 <miles>/train.py`
with open(os.environ["STAND_IN_CALLS"], "a") as calls:
    calls.write(json.dumps({{"submit": sys.argv[1:sys.argv.index("--")], "argv": argv}}) + "\n")
one = lambda flag, default=None: (flag_values(argv, flag) or [default])[0]
print("Job 'raysubmit_%d' submitted successfully" % os.getpid(), flush=True)
n, load, save = int(one("--num-rollout")), one("--load"), one("--save")
tracker = os.path.join(load, "latest_checkpointed_iteration.txt") if load else None
start = int(open(tracker).read()) + 1 if tracker and os.path.exists(tracker) else 0
evals = int(one("--eval-interval", 0))
def accuracy(step):  # pass@1 of the weights after `step` rollouts
    return [1] * (1 + step // 2) + [0] * (7 - step // 2)
if n == 0:
    loaded = int(one("--ref-ckpt-step", -1)) + 1
    print(eval_line(0, {{"aime": accuracy(loaded) * 3}}, group=8), flush=True)
    sys.exit(0)
if evals and flag_values(argv, "--skip-eval-before-train") is None:
    print(eval_line(start, {{"aime": accuracy(start) * 3}}, group=8), flush=True)
for r in range(start, n):
    for line in [rollout_side_perf(r, 0.1 * r), *trainer_lines(r, 0.1 * r, 0.005)]:
        print(line, flush=True)
    if os.environ.get("STAND_IN_DIE_AFTER") == str(r):
        sys.exit(7)  # killed after training r, before its save
    if r == n - 1 or (r + 1) % int(one("--save-interval")) == 0:
        save_rollout(__import__("pathlib").Path(save), r)
    if evals and (r + 1) % evals == 0:
        print(eval_line(r, {{"aime": accuracy(r + 1) * 3}}, group=8), flush=True)
'''


@pytest.fixture
def cluster(tmp_path, monkeypatch) -> ClusterRun:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ray = bin_dir / "ray"
    ray.write_text(f"#!{sys.executable}\n" + STAND_IN.format(repo=str(REPO)))
    ray.chmod(ray.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("STAND_IN_CALLS", str(tmp_path / "calls.jsonl"))
    data = tmp_path / "data" / "aime-2024"
    data.mkdir(parents=True)
    (data / "aime-2024.jsonl").write_text("".join(json.dumps({"prompt": f"p{i}", "label": str(i)}) + "\n"
                                                  for i in range(3)))
    from flows.params import PipelineParams
    from flows.rl_pipeline import _miles

    params = PipelineParams.preset_defaults(
        "dsv4-flash-mi355x", run_key="cluster-run", runs_root=str(tmp_path / "runs"), steps=4, eval_interval=2,
        ray_address="http://10.0.0.1:8265", master_addr="10.0.0.1", socket_ifname="eth0", ib_hca="rdma0",
        miles_dir=str(tmp_path / "miles"), data_dir=str(tmp_path / "data"))
    return ClusterRun.from_miles(_miles(params))  # what the flow hands its tasks


def _calls(tmp_path: Path) -> list[dict]:
    return [json.loads(x) for x in (tmp_path / "calls.jsonl").read_text().splitlines()]


def test_segments_resume_and_step_zero_is_miles_eval_only_job(cluster, tmp_path, monkeypatch):
    from engines.report import write_report
    from engines.train.miles.jobs import flag_values

    run_dir = Path(cluster.run_dir)
    assert evaluate_step(cluster, 0)["pass@1"] == pytest.approx(1 / 8)
    first = _calls(tmp_path)[0]
    assert first["submit"][:2] == ["job", "submit"] and "--runtime-env-json" in first["submit"]
    assert flag_values(first["argv"], "--num-rollout") == ["0"] and flag_values(first["argv"], "--load") is None
    assert flag_values(first["argv"], "--ref-load") == [str(tmp_path / "runs" / "cluster-run" / "torch_dist")]

    assert train_segment(cluster, 2)["steps"] == [1, 2]
    monkeypatch.setenv("STAND_IN_DIE_AFTER", "2")
    with pytest.raises(MilesRunError, match="exited with code 7"):
        train_segment(cluster, 4)  # killed after training rollout 2; its step was committed, not saved
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    monkeypatch.delenv("STAND_IN_DIE_AFTER")
    retried = train_segment(cluster, 4)  # the task's retry: resumes from iter_0000001
    assert (retried["resumed_from"], retried["steps"], retried["evaluated"]) == (2, [3, 4], [4])
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # each step once
    assert [round(r["rollout/raw_reward"], 1) for r in rows] == [0.0, 0.1, 0.2, 0.3]

    segments = [c["argv"] for c in _calls(tmp_path)[1:]]
    assert [flag_values(a, "--num-rollout") for a in segments] == [["2"], ["4"], ["4"]]
    assert all(flag_values(a, "--skip-eval-before-train") == [] and flag_values(a, "--log-passrate") == []
               for a in segments)
    assert train_segment(cluster, 4)["skipped"]  # a segment already saved is not submitted again
    assert len(_calls(tmp_path)) == 4

    assert evaluate_step(cluster, 4)["pass@1"] == pytest.approx(3 / 8)  # Miles' own record: no job
    assert len(_calls(tmp_path)) == 4
    (run_dir / "eval" / "step_000002.json").unlink()  # lost: Miles' eval-only job on iter_0000001
    assert evaluate_step(cluster, 2)["pass@1"] == pytest.approx(2 / 8)
    last = _calls(tmp_path)[-1]["argv"]
    assert flag_values(last, "--ref-load") == [cluster.job.save_dir] and flag_values(last, "--ref-ckpt-step") == ["1"]
    evals = [json.loads(p.read_text()) for p in sorted((run_dir / "eval").iterdir())]
    assert [(e["step"], e["n_problems"], e["n_samples"]) for e in evals] == [(0, 3, 8), (2, 3, 8), (4, 3, 8)]
    summary = write_report(run_dir, title="cluster")["summary"]
    assert (summary["steps"], summary["pass@1_first"]) == (4, 1 / 8) and summary["pass@1_last"] == pytest.approx(3 / 8)


def test_cluster_steps_refuse_what_they_cannot_do(cluster, tmp_path):
    import dataclasses

    from engines.site import SiteError
    from engines.train.miles import MilesResultsError

    with pytest.raises(MilesResultsError, match="iter_0000005 is not in"):
        evaluate_step(cluster, 6)  # no evaluation, no checkpoint: nothing to evaluate
    no_site = dataclasses.replace(cluster, site=Site())
    with pytest.raises(SiteError, match="ray_address"):
        train_segment(no_site, 2)
    assert not (tmp_path / "calls.jsonl").exists()  # nothing was submitted
