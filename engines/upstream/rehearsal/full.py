"""Stage full: Miles' own train.py in its normal loop with v4rl's engine as its external SGLang, killed and resumed.

Run 1: v4rl's engine on the tiny checkpoint, a local Ray head, Miles' train.py with `--num-rollout 3`: Miles'
initial broadcast of its actor's weights (`update_weights_from_distributed` over gloo into the engine), its eval
before rollout 0 (pass@k), then per rollout generate -> train -> save (`--save-interval 1`) -> broadcast -> eval.
Once Miles has saved rollout 1 (Megatron's `latest_checkpointed_iteration.txt` reads 1: Miles saves rollout r
as iteration r), the engine holds the
weights trained on it and its eval was logged, the whole run is killed (SIGKILL to Miles' process group, then its
Ray session and the engine), in the middle of rollout 2. The resume: a fresh engine (the HF checkpoint's weights
again, until Miles' first broadcast), a fresh Ray head, the same train.py argv: Miles loads `--load`, continues at
rollout 2 and trains it, each rollout trained once over both runs. After every broadcast the engine's weights
must equal the actor's export (weight_check.py); the resume's first broadcast must send exactly what run 1's last
one sent (the checkpoint holds the weights the engine last had).

    error, seconds, extras = run_full(req, preset, paths, miles, megatron, impl_args, report, log)
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from engines.upstream.rehearsal.job import FULL_ROLLOUTS, Substitution, rehearsal_job
from engines.upstream.rehearsal.metrics import read_metrics
from engines.upstream.rehearsal.submitted import submit_miles
from engines.upstream.rehearsal.weight_check import check_broadcasts, first_differing_tensor

KILL_AFTER_ROLLOUT = 1
"""Run 1 is killed once rollout 1 is saved, broadcast and evaluated; the resume continues at rollout 2."""
RUNS = ("run-1", "resume")
BROADCAST_ROW = Substitution(
    "miles/backends/megatron_utils/update_weight/update_weight_from_distributed/broadcast.py "
    "update_weights_from_distributed", "(as is)", "wrapped (bootstrap): a CPU copy of each tensor before it is sent, "
    "the engine's /weights_checker checksums after each update", "the weight check after every broadcast; what Miles "
    "sends and how are unchanged")
BUCKET_ROW = Substitution(
    "miles/backends/megatron_utils/update_weight/update_weight_from_distributed/mixin.py:124 convert_to_hf",
    "no bucket", "the update unit just gathered as its bucket", "Miles defect: DeepSeek-V4's converter packs the "
    "hyper-connection alphas from the bucket (deepseekv4.py:55, TypeError in the first broadcast); the tensor "
    "update path passes it; worked around from outside (bootstrap), Miles' file unchanged")
EXPERTS_ROW = Substitution(
    "tiny checkpoint's routed experts", "FP4 (the release's storage)", "FP8 blocks (hf-fp8-experts/)",
    "Miles' broadcast quantizes experts to FP8 blocks (quantizer_fp8.py: linear_fc1/fc2), and v4rl's engine refuses "
    "FP8 bytes for FP4-stored experts; so a cluster's SGLang serving FP4 experts gets FP8 ones from this Miles")
FP8_ROW = Substitution(
    "miles/utils/fp8_kernel.py blockwise_cast_to_fp8_triton", "triton kernel", "the kernel's math in torch "
    "(bootstrap)", "no triton on a CPU; Miles quantizes each broadcast weight to the checkpoint's FP8 blocks")
GLOO_ROW = Substitution(
    "weight-update group (miles/utils/distributed_utils.py init_process_group)", "nccl", "gloo; float8 tensors "
    "broadcast as their bytes", "no NCCL on a CPU; v4rl's engine joins with gloo, which has no float8 type")


def run_full(req, preset, paths, miles: Path, megatron: Path, impl_args: list[str], report, log
             ) -> tuple[str | None, float, dict]:
    """Run 1, the kill, the resume; (error or None, seconds, {"weight_checks", "resumed_from", "metrics"})."""
    from engines.upstream.rehearsal import run as r

    work, hf = paths.work, paths.hf_checkpoint
    r._convert_ref(hf, work / "ref", miles, log, force=True)  # the FP8-expert checkpoint's, whatever was there
    save = work / "save"
    shutil.rmtree(save, ignore_errors=True)  # a rerun in the same work dir starts from --ref-load again
    shutil.rmtree(work / "broadcasts", ignore_errors=True)
    t0 = time.monotonic()
    extras: dict = {"weight_checks": [], "resumed_from": None, "logs": []}
    for label in RUNS:
        engine_port = r.free_port(req.engine_port, "--engine-port")
        ray_port = r.free_port(req.ray_port, "--ray-port")
        try:
            job = rehearsal_job(preset, paths, engine_addr=f"127.0.0.1:{engine_port}", stage="full",
                                context_length=r._context_length(hf), layout=req.layout)
        except ValueError as exc:
            raise r.RehearsalError(f"the rehearsal job: {exc}") from None
        argv = job.argv + impl_args
        subs = job.substitutions + r._impl_rows(job.argv, impl_args) + [
            EXPERTS_ROW, r.PLACEMENT_ROW, r.ENGINE_LOGPROB_ROW, BUCKET_ROW, BROADCAST_ROW, GLOO_ROW, FP8_ROW,
            *r.TRAIN_STANDIN_ROWS]
        report.substitutions += [s for s in subs if s not in report.substitutions]
        broadcasts = work / "broadcasts" / label
        env = {**r._stage_env("full", job.env, miles, megatron, ray_port),
               "V4RL_REHEARSAL_BROADCASTS": str(broadcasts),
               "V4RL_REHEARSAL_ENGINE_URL": f"http://127.0.0.1:{engine_port}"}
        log_path = work / f"miles-full-{label}.log"
        extras["logs"].append(log_path)
        if label == "resume":
            iteration = latest_iteration(save)
            log(f"stage full: resume from --load {save} (latest_checkpointed_iteration.txt: {iteration})")
            extras["resumed_from"] = {"latest_checkpointed_iteration": iteration}
        kill_when = _KillPoint(save, broadcasts, log_path) if label == "run-1" else None
        error, killed = _one_run(r, label, miles, argv, env, work, hf, engine_port, ray_port, req.timeout_s,
                                 log_path, kill_when, log, job.ray, submit=req.submit)
        extras["weight_checks"] += [{"run": label, **c} for c in check_broadcasts(broadcasts, hf)]
        error = error or _run_outcome(label, killed, log_path, extras)
        if error:
            return f"stage full ({label}): {error}", round(time.monotonic() - t0, 1), extras
    return None, round(time.monotonic() - t0, 1), extras


def _one_run(r, label, miles, argv, env, work, hf, engine_port, ray_port, timeout, log_path, kill_when, log,
             ray_resources, submit="driver"):
    """Engine, Ray, Miles' train.py (killed at `kill_when`; a child of this process, or a Ray job with `submit`
    ray-job), then everything stopped; (error, killed)."""
    engine = ray = None
    ray_dir = r._ray_temp_dir(work)
    engine_log = work / "engine.log"  # where _run_miles watches for the engine's refusals
    if label == "resume" and engine_log.exists():  # keep run 1's
        engine_log.rename(work / "engine-run-1.log")
    try:
        engine = r._start_engine(hf, engine_port, engine_log)
        log(f"stage full {label}: engine 127.0.0.1:{engine_port}; Ray head 127.0.0.1:{ray_port}")
        jobs_api = submit == "ray-job"
        try:
            ray = r.RaySession(ray_dir, port=ray_port, **ray_resources, env=env, log=work / f"ray-{label}.log",
                               jobs_api=jobs_api, cwd=work if jobs_api else None)
        except (RuntimeError, TimeoutError) as exc:
            return f"ray: {exc}", False
        if jobs_api:
            if kill_when is not None:
                kill_when.read_driver_log_in(ray_dir / "session_latest" / "logs")
            log(f"stage full {label}: `ray job submit` of Miles' train.py to {ray.jobs_address} (normal loop, "
                f"--num-rollout {FULL_ROLLOUTS})")
            error, killed = submit_miles(miles, argv, env, ray=ray, log_path=log_path,
                                         run_dir=work / "run", save_dir=work / "save", timeout=timeout,
                                         engine_log=engine_log, kill_when=kill_when)
        else:
            log(f"stage full {label}: Miles' train.py (normal loop, --num-rollout {FULL_ROLLOUTS})")
            error = r._run_miles(miles, argv, env, work, timeout, log_name=log_path.name, kill_when=kill_when)
            killed = kill_when is not None and kill_when.fired
        if killed:
            log(f"stage full {label}: killed after rollout {KILL_AFTER_ROLLOUT} was saved and broadcast")
        return error, killed
    finally:
        r.stop_session(ray, engine, ray_dir, work)


class _KillPoint:
    """True (and `fired`) once rollout KILL_AFTER_ROLLOUT is saved (Miles saves rollout r as iteration r), its broadcast recorded (the initial one is v1)
    and the eval after it logged (one before rollout 0, one after each rollout)."""

    def __init__(self, save: Path, broadcasts: Path, log_path: Path) -> None:
        self.save, self.log_path, self.fired = save, log_path, False
        self.record = broadcasts / f"broadcast-v{KILL_AFTER_ROLLOUT + 2}.json"
        self.driver_logs: Path | None = None

    def read_driver_log_in(self, logs: Path) -> None:
        """Read the evals from the Ray job driver's own log in `logs` (Ray's session logs/job-driver-*.log, written
        as the driver prints): the streamed copy `ray job submit` writes lags it by seconds under load, in which
        Miles may already train the next rollout."""
        self.driver_logs = logs

    def _evals(self) -> int:
        if self.driver_logs is None:
            return len(read_metrics(self.log_path).evals)
        return max((len(read_metrics(log).evals) for log in self.driver_logs.glob("job-driver-*.log")), default=0)

    def __call__(self) -> bool:
        self.fired = self.fired or ((latest_iteration(self.save) or -1) >= KILL_AFTER_ROLLOUT
                                    and self.record.is_file() and self._evals() >= KILL_AFTER_ROLLOUT + 2)
        return self.fired


def _run_outcome(label: str, killed: bool, log_path: Path, extras: dict) -> str | None:
    """What a run must have done: run 1 killed at its point after training rollouts 0 and 1; the resume trained
    exactly the remaining rollouts; every broadcast checked equal; the resume's first export is run 1's last."""
    from engines.upstream.rehearsal.run import TRAIN_METRICS

    metrics = read_metrics(log_path)
    want = list(range(KILL_AFTER_ROLLOUT + 1)) if label == "run-1" else \
        list(range(KILL_AFTER_ROLLOUT + 1, FULL_ROLLOUTS))
    if label == "run-1" and not killed:
        return f"Miles' train.py ended before the kill point (rollout {KILL_AFTER_ROLLOUT} saved, broadcast and " \
               f"evaluated; see {log_path})"
    if metrics.trained != want:
        return f"Miles trained rollouts {metrics.trained}, expected {want} (see {log_path})"
    for rollout in map(str, want):
        missing = [n for n in TRAIN_METRICS if n not in metrics.rollouts.get(rollout, {})]
        if missing:
            return f"Miles logged no {missing[0]} for rollout {rollout} (see {log_path})"
    checks = [c for c in extras["weight_checks"] if c["run"] == label]
    if len(checks) != len(want) + 1:  # the initial broadcast, then one after each rollout trained
        return f"{len(checks)} broadcasts recorded, expected {len(want) + 1} (the initial one and one per rollout)"
    bad = next((c for c in checks if not c["ok"]), None)
    if bad:
        return f"after broadcast v{bad['version']} the engine's {bad['first_differing']} differs from the actor's " \
               "export (v4rl's engine loaded cold from that export)"
    if label == "resume":
        return _check_resume(extras, log_path.parent / "broadcasts", metrics, want)
    return None


def _check_resume(extras: dict, broadcasts: Path, metrics, want: list[int]) -> str | None:
    resumed = extras["resumed_from"]
    resumed["rollout_id"] = metrics.trained[0]
    if resumed["latest_checkpointed_iteration"] != want[0] - 1:
        return f"latest_checkpointed_iteration.txt read {resumed['latest_checkpointed_iteration']} before the " \
               f"resume, expected {want[0] - 1} (Miles saves rollout r as iteration r)"
    last = broadcasts / "run-1" / f"broadcast-v{KILL_AFTER_ROLLOUT + 2}.json"  # its parts, one per PP stage
    first = broadcasts / "resume" / "broadcast-v1.json"
    moved = first_differing_tensor(broadcasts / "run-1" / "broadcast-v1.json", last)
    same = first_differing_tensor(last, first)
    resumed["export_equals_last_before_kill"] = same is None
    resumed["training_moved_the_export"] = moved is not None
    if same is not None:
        return f"the resumed actor's first broadcast differs from run 1's last in {same}: --load did not give " \
               "back the weights the engine had before the kill"
    return None


def latest_iteration(save: Path) -> int | None:
    """Megatron's latest_checkpointed_iteration.txt under --save (None before the first save)."""
    path = save / "latest_checkpointed_iteration.txt"
    try:
        return int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
