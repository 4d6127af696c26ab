"""The `miles` training backend: Miles (Megatron actor + SGLang rollout on Ray) runs the cluster path.

v4rl does not grow its own Megatron trainer (upstream megatron-core has no DeepSeek-V4 attention or
sqrtsoftplus router); it drives the engine the seed ran. This module
  - builds the Miles command line from a run preset: the seed's `scripts/amd/run_deepseek_v4.py train` flags
    (`launcher_argv`, reproduced setting by setting in tests) and the Miles `train.py` arguments they map to
    (`train_args`), with our torch_dist as --ref-load and the FP8 HF directory as --hf-checkpoint;
  - runs it as a job on the existing Ray cluster (RAY_ADDRESS, MILES_SCRIPT_EXTERNAL_RAY=1), streaming its log
    line by line into a callback (the Prefect logger) and a log file, killing it when it prints nothing for
    `idle_timeout_s` (a stalled collective) or runs past `timeout_s`, and stopping the submitted Ray job too;
  - reads its checkpoints (`iter_XXXXXXX/`, `latest_checkpointed_iteration.txt`) to resume through --load and
    to hand to the eval subflow; repairs a tracker a crash left behind, and fails when Miles silently starts
    from rollout 0 after a resume (a known slime/Miles pain);
  - parses its metric lines (`step 12: {'train/pg_loss': ...}`) and maps its metric names to ours (they are the
    same names by design; only eval's `-truncated_ratio` suffix and the step axes differ).
The Miles run itself needs GPUs (tests marked `gpu`); everything else is plain Python, tested on CPU.
"""

from __future__ import annotations

import ast
import math
import os
import queue
import re
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engines.launch import RunPreset, Site
    from engines.profiles import HardwareProfile

TRACKER = "latest_checkpointed_iteration.txt"
_ITER_DIR = re.compile(r"^iter_(\d{7})$")
_RECORD = re.compile(r"(?:^|[\s\]>:-])(?P<kind>perf|rollout|eval|step|multi_turn|passrate|[a-z]+-step) "
                     r"(?P<index>\d+): (?P<body>\{.*\})\s*$")
_RAY_JOB = re.compile(r"Job '(?P<id>[A-Za-z0-9_\-]+)' submitted successfully")
_STEP_KEYS = ("train/step", "rollout/step", "eval/step")


# ----------------------------------------------------------------------------------------------- the job
@dataclass(frozen=True, kw_only=True)
class MilesJob:
    """Where one Miles run reads and writes. Keep `save_dir` across retries: that is what makes them resume."""

    run_id: str
    """--run-id (also the log file name); a retry may use a new one, resume follows save_dir."""
    hf_checkpoint: str
    """FP8 HF directory SGLang serves and Miles reads config/tokenizer from (--hf-checkpoint)."""
    ref_load: str
    """Our torch_dist BF16 directory (convert task output): --ref-load, and the start when save_dir is empty."""
    save_dir: str
    """Miles --save and --load: iter_XXXXXXX/ checkpoints + latest_checkpointed_iteration.txt."""
    miles_dir: str = "/workspace/miles"
    """The Miles checkout the launcher runs from (cwd)."""
    log_dir: str | None = None
    """Where <run_id>.log goes; None = miles_dir (the seed's /workspace/miles/${RUN_ID}.log)."""
    wandb_team: str | None = None
    """--wandb-team inside --extra-args; None leaves W&B to the launcher's defaults."""
    extra_args: tuple[str, ...] = ()
    """More Miles/Megatron/SGLang flags appended to --extra-args (argparse: the last occurrence wins)."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """More KEY=VALUE pairs for --extra-env-vars."""

    @property
    def log_path(self) -> str:
        return f"{self.log_dir or self.miles_dir}/{self.run_id}.log"

    @classmethod
    def placeholder(cls, preset: "RunPreset", profile: "HardwareProfile") -> "MilesJob":
        """A job with ${VAR} paths, for showing a launch plan before the paths exist."""
        return cls(run_id=default_run_id(preset), hf_checkpoint="${HF_CHECKPOINT}", ref_load="${REF_LOAD}",
                   save_dir="${SAVE_DIR}", miles_dir=profile.workspace)


def default_run_id(preset: "RunPreset", now: datetime | None = None) -> str:
    """The seed's run id pattern: dsv4-fp8-4node-2roll-tp1-pp4-ep4-YYYYmmdd_HHMMSS."""
    p = preset.parallel
    stamp = (now or datetime.now()).strftime("%Y%m%d_%H%M%S")
    return f"dsv4-fp8-{preset.nodes}node-{preset.rollout_nodes}roll-tp{p.tp}-pp{p.pp}-ep{p.ep}-{stamp}"


# ------------------------------------------------------------------------------------------ command lines
def megatron_parallel_args(preset: "RunPreset") -> list[str]:
    """The Megatron parallel flags of the actor (what every trainer rank is started with)."""
    p = preset.parallel
    args = ["--tensor-model-parallel-size", str(p.tp)] + (["--sequence-parallel"] if p.sp else [])
    args += ["--pipeline-model-parallel-size", str(p.pp)]
    if p.first_stage_layers is not None:
        args += ["--decoder-first-pipeline-num-layers", str(p.first_stage_layers)]
    if p.last_stage_layers is not None:
        args += ["--decoder-last-pipeline-num-layers", str(p.last_stage_layers)]
    args += ["--context-parallel-size", str(p.cp)] + (["--allgather-cp"] if p.cp > 1 else [])
    return args + ["--expert-model-parallel-size", str(p.ep), "--expert-tensor-parallel-size", str(p.expert_tp)]


def _launcher_extra_args(preset: "RunPreset", job: MilesJob, resume: "Resume | None") -> list[str]:
    extra = (["--wandb-team", job.wandb_team] if job.wandb_team else []) + (["--use-tis"] if preset.use_tis else [])
    extra += ["--ref-load", job.ref_load, "--load", job.save_dir, "--save", job.save_dir]
    if preset.enable_eval:
        extra += ["--eval-interval", str(preset.eval_interval),
                  "--n-samples-per-eval-prompt", str(preset.n_samples_per_eval_prompt)]
    return extra + list(resume.extra_args if resume else ()) + list(job.extra_args)


def launcher_argv(preset: "RunPreset", profile: "HardwareProfile", job: MilesJob,
                  resume: "Resume | None" = None) -> list[str]:
    """The seed's launch command for this preset: `python3 <launcher> train --run-id ... --extra-env-vars ...`.

    Flags in the seed's order; additions: --hf-checkpoint, and inside --extra-args our --ref-load/--load/--save
    and the eval cadence (argparse keeps the last occurrence, so they override the launcher's defaults).
    """
    c, t, r = preset, preset.train, preset.rollout
    argv = [profile.python, profile.miles_launcher, "train", "--run-id", job.run_id, "--mode", c.mode]
    argv += ["--enable-eval"] if c.enable_eval else []
    argv += ["--num-nodes", str(c.nodes), "--actor-num-nodes", str(_actor_nodes(c)),
             "--rollout-num-nodes", str(c.rollout_nodes)]
    if profile.gpus_per_node != 8:
        argv += ["--num-gpus-per-node", str(profile.gpus_per_node)]
    argv += ["--num-rollout", str(c.num_rollout), "--num-steps-per-rollout", str(t.num_steps_per_rollout),
             "--rollout-batch-size", str(t.rollout_batch_size), "--n-samples-per-prompt", str(t.n_samples_per_prompt),
             "--context-length", str(r.context_length), "--rollout-max-response-len", str(t.max_response_len),
             "--max-tokens-per-gpu", str(t.max_tokens_per_gpu),
             "--sglang-max-running-requests", str(r.max_running_requests),
             "--sglang-max-total-tokens", str(r.max_total_tokens)]
    argv += [a for a in megatron_parallel_args(preset) if a not in ("--sequence-parallel", "--allgather-cp")]
    argv += ["--hf-checkpoint", job.hf_checkpoint]
    argv += ["--extra-args", shlex.join(_launcher_extra_args(preset, job, resume))]
    env = {**profile.launcher_env, **job.extra_env}
    return argv + ["--extra-env-vars", " ".join(f"{k}={v}" for k, v in env.items())]


def _actor_nodes(preset: "RunPreset") -> int:
    return preset.nodes - preset.rollout_nodes if preset.rollout_nodes else preset.nodes


def train_args(preset: "RunPreset", profile: "HardwareProfile", job: MilesJob) -> list[str]:
    """The Miles `train.py` arguments the preset's settings map to (reference §1.2), for a launcher-free run."""
    c, t, r = preset, preset.train, preset.rollout
    args = ["--actor-num-nodes", str(_actor_nodes(c)), "--actor-num-gpus-per-node", str(profile.gpus_per_node),
            "--num-gpus-per-node", str(profile.gpus_per_node)]
    args += (["--colocate"] if not c.rollout_nodes
             else ["--rollout-num-gpus", str(c.rollout_nodes * profile.gpus_per_node)])
    args += ["--rollout-num-gpus-per-engine", str(r.engine_tp), "--sglang-tp-size", str(r.engine_tp),
             "--sglang-dp-size", str(r.engine_dp), "--sglang-ep-size", str(r.engine_ep),
             "--sglang-max-running-requests", str(r.max_running_requests),
             "--sglang-max-total-tokens", str(r.max_total_tokens), "--sglang-context-length", str(r.context_length),
             "--sglang-mem-fraction-static", str(r.mem_fraction_static),
             "--num-rollout", str(c.num_rollout), "--rollout-batch-size", str(t.rollout_batch_size),
             "--n-samples-per-prompt", str(t.n_samples_per_prompt),
             "--num-steps-per-rollout", str(t.num_steps_per_rollout),
             "--rollout-max-response-len", str(t.max_response_len),
             "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(t.max_tokens_per_gpu)]
    args += megatron_parallel_args(preset)
    if t.recompute == "full":
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    elif t.recompute == "selective":
        args += ["--recompute-granularity", "selective"]
    if t.optimizer_offload > 0:
        args += ["--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--overlap-cpu-optimizer-d2h-h2d"]
        args += ["--optimizer-offload-fraction", str(t.optimizer_offload)] if t.optimizer_offload < 1 else []
    args += ["--use-tis"] if c.use_tis else []
    if c.enable_eval:
        args += ["--eval-interval", str(c.eval_interval), "--n-samples-per-eval-prompt",
                 str(c.n_samples_per_eval_prompt)]
    return args + ["--hf-checkpoint", job.hf_checkpoint, "--ref-load", job.ref_load, "--load", job.save_dir,
                   "--save", job.save_dir, "--model-name", "deepseekv4"]


def sglang_server_argv(preset: "RunPreset", job: MilesJob, *, base_gpu_id: int = 0) -> list[str]:
    """What one rollout engine amounts to (Miles starts it in-process as a Ray actor; shown for reproduction)."""
    from engines.rollout.launcher import SGLangServerSpec, build_launch_command

    spec = SGLangServerSpec.from_preset(job.hf_checkpoint, preset, python="python3",
                                        extra_args=("--base-gpu-id", str(base_gpu_id)))
    return build_launch_command(spec)


# --------------------------------------------------------------------------------------------- checkpoints
@dataclass(frozen=True)
class MilesCheckpoint:
    """One `iter_XXXXXXX/` directory Miles (Megatron save_checkpoint) wrote."""

    iteration: int
    path: Path
    complete: bool
    """metadata.json present: torch_dist rank 0 writes it last, only when the save finished."""
    has_data_state: bool
    """`rollout/global_dataset_state_dict_<iteration>.pt` exists (Miles' data cursor for that rollout)."""


def list_checkpoints(save_dir: str | Path) -> list[MilesCheckpoint]:
    """Every iter_XXXXXXX directory under save_dir, oldest first (complete or not)."""
    root = Path(save_dir)
    found = []
    for child in root.iterdir() if root.is_dir() else ():
        m = _ITER_DIR.match(child.name)
        if m and child.is_dir():
            it = int(m.group(1))
            found.append(MilesCheckpoint(it, child, (child / "metadata.json").is_file(),
                                         (root / "rollout" / f"global_dataset_state_dict_{it}.pt").is_file()))
    return sorted(found, key=lambda c: c.iteration)


def read_tracker(save_dir: str | Path) -> int | str | None:
    """Contents of latest_checkpointed_iteration.txt: an iteration, "release" (a converted checkpoint), or None."""
    path = Path(save_dir) / TRACKER
    if not path.is_file():
        return None
    text = path.read_text().strip()
    return int(text) if text.isdigit() else text


def write_tracker(save_dir: str | Path, iteration: int) -> None:
    """Point the tracker at `iteration` atomically (what Megatron writes after a finished save)."""
    path = Path(save_dir) / TRACKER
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{iteration}\n")
    os.replace(tmp, path)


@dataclass(frozen=True)
class Resume:
    """Where the next Miles run starts: `iteration` None = fresh from --ref-load."""

    iteration: int | None
    start_rollout_id: int
    """Miles starts at loaded iteration + 1; the run fails if its first rollout has a smaller id."""
    repair_tracker: bool = False
    """The tracker is missing or names an unfinished/absent save; `prepare_resume` rewrites it first."""
    extra_args: tuple[str, ...] = ()
    """Flags appended to --extra-args for this resume (e.g. --no-load-optim after an optimizer change)."""
    notes: tuple[str, ...] = ()
    """What was wrong with the tracker or the data cursor, for the task log."""


def find_resume(save_dir: str | Path) -> Resume:
    """Pick the newest complete checkpoint; say what is wrong with the tracker or the data cursor."""
    done = [c for c in list_checkpoints(save_dir) if c.complete]
    tracker = read_tracker(save_dir)
    if not done:
        notes = (f"tracker says {tracker!r} but no complete iter_* exists; starting from --ref-load",) \
            if isinstance(tracker, int) else ()
        return Resume(None, 0, repair_tracker=isinstance(tracker, int), notes=notes)
    newest = done[-1]
    notes = []
    repair = tracker != newest.iteration
    if repair:
        notes.append(f"tracker says {tracker!r}; newest complete checkpoint is iter_{newest.iteration:07d}")
    if not newest.has_data_state:
        notes.append(f"no rollout/global_dataset_state_dict_{newest.iteration}.pt: the data cursor restarts")
    return Resume(newest.iteration, newest.iteration + 1, repair_tracker=repair, notes=tuple(notes))


def prepare_resume(save_dir: str | Path) -> Resume:
    """find_resume, then repair the tracker so Megatron's --load picks the chosen iteration (or none)."""
    resume = find_resume(save_dir)
    if resume.repair_tracker:
        if resume.iteration is None:
            (Path(save_dir) / TRACKER).unlink(missing_ok=True)
        else:
            write_tracker(save_dir, resume.iteration)
    return resume


# ------------------------------------------------------------------------------------------------ metrics
@dataclass(frozen=True)
class MetricRecord:
    """One metric line of the Miles log, with names mapped to ours."""

    kind: str
    """perf | rollout | step | eval | multi_turn | passrate (the word before the number)."""
    index: int
    """The rollout id (or accumulated train step for `step` lines) the line carries."""
    step: int
    """The record's own step axis (train/step, rollout/step, eval/step) when present, else `index`."""
    metrics: dict[str, float]


def _literal(node: ast.AST) -> Any:
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id in ("nan", "inf"):
        return float(node.id)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_literal(node.operand)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "tensor" and node.args:
        return _literal(node.args[0])
    raise ValueError(f"not a literal: {ast.dump(node)[:60]}")


def to_v4rl_metrics(miles: Mapping[str, Any]) -> dict[str, float]:
    """Miles metric names -> ours: identical by design, except eval's flat suffixes and the step axes."""
    out: dict[str, float] = {}
    for key, value in miles.items():
        if key in _STEP_KEYS or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if key.startswith("eval/") and "/" not in key[5:]:
            name = key[5:]
            for suffix in ("-truncated_ratio", "-none_reward_ratio"):
                if name.endswith(suffix):
                    key = f"eval/{name[:-len(suffix)]}/{suffix[1:]}"
                    break
            else:
                key = f"eval/{name}/reward"
        out[key] = float(value)
    return out


def parse_metric_line(line: str) -> MetricRecord | None:
    """A MetricRecord for `[... ] file.py:N - step 12: {...}` style lines (any prefix), else None."""
    m = _RECORD.search(line.rstrip("\n"))
    if not m:
        return None
    try:
        raw = _literal(ast.parse(m.group("body"), mode="eval").body)
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return None
    if not isinstance(raw, dict):
        return None
    index = int(m.group("index"))
    step = next((int(raw[k]) for k in _STEP_KEYS if isinstance(raw.get(k), (int, float)) and not
                 (isinstance(raw[k], float) and math.isnan(raw[k]))), index)
    return MetricRecord(m.group("kind"), index, step, to_v4rl_metrics(raw))


# ----------------------------------------------------------------------------------------------- the runner
@dataclass
class MilesOutcome:
    """How a Miles run ended."""

    returncode: int | None
    log_path: Path
    records: list[MetricRecord]
    ray_job_id: str | None
    seconds: float
    tail: list[str]

    def last(self, kind: str = "step") -> MetricRecord | None:
        return next((r for r in reversed(self.records) if r.kind == kind), None)


class MilesRunError(RuntimeError):
    """Miles failed (non-zero exit, silent restart); `.outcome` has the log tail and the metrics so far."""

    def __init__(self, message: str, outcome: MilesOutcome) -> None:
        super().__init__(message + "\n--- last log lines ---\n" + "\n".join(outcome.tail[-20:]))
        self.outcome = outcome


class MilesTimeout(MilesRunError):
    """Miles printed nothing for idle_timeout_s (a stalled collective?) or ran past timeout_s; it was killed."""


def stop_ray_job(job_id: str, env: Mapping[str, str] | None = None) -> bool:
    """Best effort `ray job stop <id>` (killing the submitting client does not stop a submitted Ray job)."""
    try:
        done = subprocess.run(["ray", "job", "stop", job_id], env={**os.environ, **(env or {})},
                              capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _terminate(proc: subprocess.Popen, grace_s: float) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_miles(argv: Sequence[str], *, log_path: str | Path, env: Mapping[str, str] | None = None,
              cwd: str | Path | None = None, idle_timeout_s: float = 1800.0, timeout_s: float | None = None,
              on_line: Callable[[str], None] | None = None, on_record: Callable[[MetricRecord], None] | None = None,
              expect_start_rollout: int | None = None, stop_job: Callable[..., bool] = stop_ray_job,
              kill_grace_s: float = 10.0) -> MilesOutcome:
    """Run a Miles command, stream its output, enforce timeouts; return the outcome or raise MilesRunError.

    Each stdout/stderr line is appended to `log_path`, passed to `on_line`, and parsed for metrics
    (`on_record`). No output for `idle_timeout_s`, or a total past `timeout_s`, kills the process group and
    stops the Ray job it submitted (MilesTimeout). A first rollout id below `expect_start_rollout` means the
    resume was ignored: the run is killed (MilesRunError) rather than silently retraining from scratch.
    """
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **(env or {})}
    lines: queue.Queue[str | None] = queue.Queue()
    proc = subprocess.Popen(list(argv), cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1, errors="replace", start_new_session=True)

    def pump() -> None:
        assert proc.stdout is not None
        for text in proc.stdout:
            lines.put(text)
        lines.put(None)

    threading.Thread(target=pump, daemon=True, name="miles-log").start()
    outcome = MilesOutcome(None, log_path, [], None, 0.0, [])
    start = last = time.monotonic()
    failure: tuple[type[MilesRunError], str] | None = None
    first_rollout: int | None = None
    with log_path.open("a", encoding="utf-8") as log:
        while True:
            try:
                text = lines.get(timeout=0.2)
            except queue.Empty:
                text = ""
            now = time.monotonic()
            if text is None:
                break
            if text:
                last, line = now, text.rstrip("\n")
                log.write(line + "\n")
                log.flush()
                outcome.tail = (outcome.tail + [line])[-200:]
                if on_line:
                    on_line(line)
                job = _RAY_JOB.search(line)
                if job:
                    outcome.ray_job_id = job.group("id")
                record = parse_metric_line(line)
                if record:
                    outcome.records.append(record)
                    if on_record:
                        on_record(record)
                    if first_rollout is None and record.kind in ("perf", "rollout"):
                        first_rollout = record.index
                        if expect_start_rollout and first_rollout < expect_start_rollout:
                            failure = (MilesRunError, f"Miles started at rollout {first_rollout}, not at "
                                                      f"{expect_start_rollout}: --load's checkpoint was ignored")
            if failure is None and timeout_s is not None and now - start > timeout_s:
                failure = (MilesTimeout, f"Miles ran past timeout_s={timeout_s:.0f}s; killed")
            if failure is None and now - last > idle_timeout_s:
                failure = (MilesTimeout, f"Miles printed nothing for {idle_timeout_s:.0f}s (a stalled collective? "
                                         "see the flight-recorder dumps at TORCH_NCCL_DEBUG_INFO_TEMP_FILE); killed")
            if failure:
                _terminate(proc, kill_grace_s)
                if outcome.ray_job_id:
                    stop_job(outcome.ray_job_id, env)
                break
    outcome.returncode = proc.wait()
    outcome.seconds = time.monotonic() - start
    if failure:
        raise failure[0](failure[1], outcome)
    if outcome.returncode != 0:
        raise MilesRunError(f"Miles exited with code {outcome.returncode}", outcome)
    return outcome


def run_job(preset_name: str, job: MilesJob, *, site: "Site | None" = None, overrides: Mapping[str, Any] | None = None,
            **run_kwargs: Any) -> MilesOutcome:
    """The cluster training task body: preflight, resume, launch on the existing Ray cluster, stream, check."""
    from engines.launch import Site, preflight_plan, resolve
    from engines.profiles import get_profile

    preflight_plan(preset_name, overrides)  # raises InfeasibleLayout before anything is launched
    preset, _ = resolve(preset_name, overrides)
    profile = get_profile(preset.profile)
    Path(job.save_dir).mkdir(parents=True, exist_ok=True)
    resume = prepare_resume(job.save_dir)
    # unset site values render as ${VAR}: leave those to the inherited environment
    env = {k: v for k, v in (site or Site()).env(profile).items() if not v.startswith("${")}
    return run_miles(launcher_argv(preset, profile, job, resume), log_path=job.log_path, env=env, cwd=job.miles_dir,
                     expect_start_rollout=resume.start_rollout_id or None, **run_kwargs)
