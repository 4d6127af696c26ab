"""A file-level stand-in for `ray job submit` / `ray job stop` that behaves as Miles' train.py does, and the
rl-pipeline with its cluster-only steps replaced, for tests of the cluster path on CPU.

The stand-in (`install_stand_in` puts it on PATH as `ray`) follows Miles main 31f1ca961's train.py at the file
level: it starts at the tracker's iteration + 1 (0 without one), evaluates before training at its first rollout
unless --skip-eval-before-train and every --eval-interval rollouts (`should_run_periodic_action`: rollout r when
(r + 1) % interval == 0), saves every --save-interval rollouts and at the last one, with the data cursor
(tests/test_miles_readback.py `save_rollout`), `--num-rollout 0` evaluates once; it prints Miles' own log lines
(the same helpers). It is one process per submission, the `ray job submit` client and the job at once, so
`ray job stop raysubmit_<pid>` kills that process (what stopping a Ray job does to its driver).

Knobs (environment): STAND_IN_CALLS (JSONL of submissions, stops, ends, deaths), STAND_IN_ROLLOUT_S (seconds per
rollout, so evaluations land while the job runs), STAND_IN_DIE_AFTER=r (exit 7 after training r, before its
save; with STAND_IN_DIE_ONCE=<marker file> only the first job dies), STAND_IN_HANG_AT=r (print nothing more from
rollout r: a stalled collective), STAND_IN_SKIP_KEY=k (the load prints Megatron's `k from model not in state
dict, will skip`).

`replace_cluster_only_steps(module)`: preflight, convert, verify and align of flows/rl_pipeline.py replaced by
tasks of the same names that only record their call: those steps need Miles' sources, a 284B checkpoint or the
cluster's engines and are tested on their own (tests/test_miles_job.py, tests/conformance/, tests/test_align.py);
what these tests check is the training task, its evaluate subflows, retries and cancel.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

STAND_IN = r'''
import json, os, signal, sys, time
sys.path.insert(0, {repo!r})

def record(entry):
    with open(os.environ["STAND_IN_CALLS"], "a") as calls:
        calls.write(json.dumps(entry) + "\n")

if sys.argv[1:3] == ["job", "stop"]:  # ray job stop <id>: Ray stops the job's driver
    job = sys.argv[-1]
    record({{"stop": job, "time": time.time()}})
    try:
        os.kill(int(job.rsplit("_", 1)[1]), signal.SIGKILL)
    except ProcessLookupError:
        pass
    sys.exit(0)
if sys.argv[1:3] == ["job", "logs"]:  # the client streamed everything (it is the job): nothing more to read
    sys.exit(0)

print("Job 'raysubmit_%d' submitted successfully" % os.getpid(), flush=True)  # before the slow imports, as Ray
from engines.miles.jobs import flag_values
from tests.test_miles_readback import eval_line, rollout_side_perf, save_rollout, trainer_lines

argv = sys.argv[sys.argv.index("--") + 3:]  # after `-- python3 <miles>/train.py`
one = lambda flag, default=None: (flag_values(argv, flag) or [default])[0]
n, load, save = int(one("--num-rollout")), one("--load"), one("--save")
tracker = os.path.join(load, "latest_checkpointed_iteration.txt") if load else None
start = int(open(tracker).read()) + 1 if tracker and os.path.exists(tracker) else 0
record({{"submit": sys.argv[1:sys.argv.index("--")], "argv": argv, "pid": os.getpid(), "start": start,
         "time": time.time()}})
evals = int(one("--eval-interval", 0))
pause = float(os.environ.get("STAND_IN_ROLLOUT_S", "0"))
def accuracy(step):  # pass@1 of the weights after `step` rollouts
    return [1] * (1 + step // 8) + [0] * (7 - step // 8)
if os.environ.get("STAND_IN_SKIP_KEY"):
    print("%s from model not in state dict, will skip" % os.environ["STAND_IN_SKIP_KEY"], flush=True)
if n == 0:
    loaded = int(one("--ref-ckpt-step", -1)) + 1
    print(eval_line(0, {{"aime": accuracy(loaded) * 3}}, group=8), flush=True)
    sys.exit(0)
if evals and flag_values(argv, "--skip-eval-before-train") is None:
    print(eval_line(start, {{"aime": accuracy(start) * 3}}, group=8), flush=True)
for r in range(start, n):
    if os.environ.get("STAND_IN_HANG_AT") == str(r):
        time.sleep(3600)
    time.sleep(pause)
    for line in [rollout_side_perf(r, 0.01 * r), *trainer_lines(r, 0.01 * r, 0.005)]:
        print(line, flush=True)
    marker = os.environ.get("STAND_IN_DIE_ONCE")
    if os.environ.get("STAND_IN_DIE_AFTER") == str(r) and not (marker and os.path.exists(marker)):
        if marker:
            open(marker, "w").close()
        record({{"died": r, "pid": os.getpid(), "time": time.time()}})
        sys.exit(7)  # killed after training r, before its save
    if r == n - 1 or (r + 1) % int(one("--save-interval")) == 0:
        save_rollout(__import__("pathlib").Path(save), r)
    if evals and (r + 1) % evals == 0:
        print(eval_line(r, {{"aime": accuracy(r + 1) * 3}}, group=8), flush=True)
record({{"ended": os.getpid(), "time": time.time()}})
'''


def install_stand_in(bin_dir: Path, calls: Path) -> dict[str, str]:
    """Write the stand-in as `bin_dir/ray`; returns the environment that puts it first on PATH."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    ray = bin_dir / "ray"
    ray.write_text(f"#!{sys.executable}\n" + STAND_IN.format(repo=str(REPO)))
    ray.chmod(ray.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "STAND_IN_CALLS": str(calls)}


def read_calls(calls: Path) -> list[dict]:
    return [json.loads(x) for x in calls.read_text().splitlines()] if calls.exists() else []


def write_eval_dataset(data_dir: Path) -> None:
    """The preset's AIME file where the job reads it (three problems)."""
    data = data_dir / "aime-2024"
    data.mkdir(parents=True, exist_ok=True)
    (data / "aime-2024.jsonl").write_text("".join(json.dumps({"prompt": f"p{i}", "label": str(i)}) + "\n"
                                                  for i in range(3)))


def cluster_params(tmp_path: Path, **overrides):
    """PipelineParams of the seed's preset pointed at the stand-in's world under tmp_path."""
    from flows.params import PipelineParams

    write_eval_dataset(tmp_path / "data")
    base = dict(run_key="cluster-run", runs_root=str(tmp_path / "runs"), steps=30, eval_interval=10,
                ray_address="http://10.0.0.1:8265", master_addr="10.0.0.1", socket_ifname="eth0", ib_hca="rdma0",
                miles_dir=str(tmp_path / "miles"), data_dir=str(tmp_path / "data"))
    return PipelineParams.preset_defaults("dsv4-flash-mi355x", **{**base, **overrides})


def replace_cluster_only_steps(module) -> dict:
    """Replace preflight/convert/verify/align in `module` (flows.rl_pipeline); returns the originals."""
    from prefect import task

    @task(name="preflight")
    def preflight(*args, **kwargs) -> dict:
        return {"replaced": "preflight (tests/test_miles_job.py, tests/conformance/ check it)"}

    @task(name="convert")
    def convert(src: str, dst: str, megatron_names: str = "plugin") -> dict:
        Path(dst).mkdir(parents=True, exist_ok=True)
        return {"dst": dst}

    @task(name="verify")
    def verify(*args, **kwargs) -> dict:
        return {"replaced": "verify"}

    @task(name="align")
    def align(*args, **kwargs) -> dict:
        return {"passed": True, "token_abs_diff": {"mean": 0.0, "p99": 0.0}, "first_divergence": None}

    replaced = {"preflight": preflight, "convert": convert, "verify": verify, "align": align}
    originals = {name: getattr(module, name) for name in replaced}
    for name, fn in replaced.items():
        setattr(module, name, fn)
    return originals
