"""One rehearsal: v4rl's engine on the tiny checkpoint, a local Ray head, Miles' own train.py; then its metrics.

    report = rehearse(RehearsalRequest(stage="rollout"))      # ~2-4 min on 2 cores
    report.stages["rollout"]["ok"], report.rollouts, report.evals

Every process it starts (the engine, Ray, Miles' driver) is stopped in `finally`, by PID or by its own process
group, Ctrl-C included (it then logs where the work dir is kept and re-raises); every wait has a timeout. A
failure is one line in `RehearsalError`: Miles' own error line where it printed one (engine_sources.engine_error),
else the stage and what timed out.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from engines.upstream import sources as src
from engines.miles.pins import MILES_GENERATIONS
from engines.upstream.stubs import GPU_ONLY_ROOTS
from engines.upstream.rehearsal.job import DEVICE, ROLLOUT_SIZES, RehearsalPaths, Substitution, rehearsal_job, \
    rehearsal_layout
from engines.upstream.rehearsal.metrics import read_metrics
from engines.upstream.rehearsal.ray_session import RaySession
from engines.train.cluster import LOCAL_RAY_ENV
from engines.upstream.rehearsal.logprob_noise import LogprobNoise, logprob_diff_problem, measure_logprob_noise
from engines.upstream.rehearsal.tiny_model import make_tiny_checkpoint
from engines.miles.generation import MilesGenerationError, detect_generation, dsv4_impl_args
from engines.upstream.megatron_fit import megatron_misfit

BOOTSTRAP = Path(__file__).with_name("bootstrap")
STUB_ROOTS = (*GPU_ONLY_ROOTS, "sglang.srt.entrypoints.openai.encoding_dsv4", "sglang.srt.model_loader.parameter_mapper",
              "mooncake")
"""GPU-only imports, plus modules of Miles' own SGLang branch upstream 0.5.23 lacks and Mooncake (Miles' P2P
transfer engine): Miles imports them at module level, a rehearsal never calls them."""
WORKAROUNDS = ("placement", "dashboard", "broadcast_bucket")
"""Miles defects the bootstrap works around (bootstrap/sitecustomize.py), each listed in the substitution table."""
TRAIN_DATA = src.REPO / "rl" / "sample_math.jsonl"
ENGINE_START_S, MILES_TIMEOUT_S = 180.0, 900.0


class RehearsalError(RuntimeError):
    """The rehearsal could not run or Miles failed; the message is one line naming the stage and the cause."""


@dataclass(frozen=True)
class RehearsalRequest:
    stage: str = "rollout"
    miles_dir: str | None = None
    megatron_dir: str | None = None
    work_dir: str | None = None
    engine_port: int = 0
    ray_port: int = 0
    timeout_s: float = MILES_TIMEOUT_S
    """Seconds each stage's train.py may run."""
    rollout_data: str | None = None
    """Stage train: a directory of Miles' rollout dumps (rollout_<id>.pt) instead of running stage rollout first."""
    dsv4_impl: str | None = None
    """Generation 2: --dsv4-impl miles|megatron (default: the parser's first choice); generation 1 has only miles."""
    submit: str = "driver"
    """Stage full: how Miles' train.py runs. driver: as a child of this process (RAY_ADDRESS the local head);
    ray-job: `ray job submit` to the head's Jobs API through the cluster path's submitter (ClusterRun.submit),
    Miles' metrics recorded into <work>/run as the cluster run records them (submitted.py)."""
    layout: str = "1"
    """The Megatron actor's layout on Ray logical GPUs (engines/upstream/rehearsal/job.py LAYOUTS): 1 = one GPU, TP/PP/EP 1;
    pp2-ep2 = 4 GPUs, PP 2 x DP 2 and EP 2 (2 of the tiny model's 4 layers per stage, 2 of its 4 experts per rank)."""


@dataclass
class RehearsalReport:
    generation: int
    miles_dir: str
    stages: dict[str, dict] = field(default_factory=dict)
    rollouts: dict[str, dict] = field(default_factory=dict)
    evals: list[dict] = field(default_factory=list)
    substitutions: list[Substitution] = field(default_factory=list)
    work_dir: str = ""
    weight_checks: list[dict] = field(default_factory=list)
    """Stage full: one per broadcast, {"run", "version", "tensors_sent", "ok", "first_differing"} (weight_check.py)."""
    resumed_from: dict | None = None
    """Stage full: {"latest_checkpointed_iteration", "rollout_id", "export_equals_last_before_kill", ...}."""
    logprob_bound: dict | None = None
    """Stages train and full: the noise measured on the tiny model and the bounds on Miles' |Δlogprob| derived from
    it ({"bf16_noise", "fp8_requant_noise", "raw_vs_processed", "tokens", "temperature", "factor", "bound",
    "broadcast_bound"}, logprob_noise.py)."""

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["substitutions"] = [s.to_json() for s in self.substitutions]
        return out


def resolve_trees(req: RehearsalRequest) -> tuple[Path, Path, int]:
    """Miles and Megatron-LM: the given directories, else the vendored pins (generation 1), else $V4RL_*_DIR."""
    try:
        if req.miles_dir:
            gen = detect_generation(req.miles_dir).generation
            miles = src.miles_tree(req.miles_dir)
        else:
            miles = src.miles_tree()
            gen = detect_generation(miles).generation
        megatron = src.megatron_tree(req.megatron_dir, MILES_GENERATIONS[gen][1])
    except (src.EngineSourceMissing, MilesGenerationError) as exc:
        raise RehearsalError(str(exc)) from None
    if not (miles / "train.py").is_file():
        raise RehearsalError(f"{miles} has no train.py: not a Miles checkout; point --miles-dir at its repository root")
    misfit = megatron_misfit(miles, megatron)
    if misfit:
        pin = MILES_GENERATIONS[gen][1]
        raise RehearsalError(f"the Megatron-LM does not fit this Miles (generation {gen}): {misfit}; point "
                             f"--megatron-dir (or ${pin.env}) at the Megatron-LM this Miles pins (generation {gen} "
                             f"was built with {pin.repo} at {pin.short})")
    return miles, megatron, gen


def free_port(port: int, what: str) -> int:
    """`port` if it can be bound on 127.0.0.1 (0: any free one); a port in use is one line naming the flag."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise RehearsalError(f"port {port} on 127.0.0.1 is in use ({what}); pick another or stop what holds it") \
                from None
        return s.getsockname()[1]


def _require_memory(layout: str, needed_gib: float) -> None:
    """One line, before anything starts, when this machine has less memory available than the layout needs."""
    import psutil

    available = psutil.virtual_memory().available / 2**30
    if available < needed_gib:
        other = "" if layout == "1" else ", or use --layout 1"
        raise RehearsalError(f"--layout {layout}: a rehearsal needs about {needed_gib:g} GiB at its peak (stage full, "
                             f"docs/rehearsal.md) and this machine has {available:.1f} GiB available; free memory"
                             f"{other}")


def rehearsal_prompts() -> list[str]:
    """The prompts of the rehearsal's first rollout (--rollout-batch-size of them, Miles' prompt order)."""
    rows = TRAIN_DATA.read_text().splitlines()[:ROLLOUT_SIZES["rollout_batch_size"]]
    return [json.loads(row)["prompt"] for row in rows]


def write_data(work: Path) -> tuple[Path, Path]:
    """Miles' data format (one JSON object a line, `prompt` and `label`): 16 train and 4 eval prompts."""
    lines = TRAIN_DATA.read_text().splitlines()
    train, evals = work / "data" / "train.jsonl", work / "data" / "eval.jsonl"
    train.parent.mkdir(parents=True, exist_ok=True)
    train.write_text("\n".join(lines[:16]) + "\n")
    evals.write_text("\n".join(lines[16:20]) + "\n")
    return train, evals


def rehearse(req: RehearsalRequest, *, preset=None, log=print) -> RehearsalReport:
    """Run `req.stage`: rollout; train (after a rollout stage unless `req.rollout_data` holds Miles' dumps)."""
    if req.stage not in STAGES:
        raise RehearsalError(f"--stage {req.stage}: not a stage; use one of {', '.join(STAGES)}")
    from engines.presets.runs import SEED_RUN

    preset = preset or SEED_RUN
    try:
        layout = rehearsal_layout(req.layout)
    except ValueError as exc:
        raise RehearsalError(str(exc)) from None
    if req.submit not in SUBMIT_MODES:
        raise RehearsalError(f"--submit {req.submit}: use one of {', '.join(SUBMIT_MODES)}")
    _require_memory(req.layout, layout.memory_gib)
    miles, megatron, gen = resolve_trees(req)
    given_data = _check_rollout_data(req.rollout_data, ROLLOUT_SIZES["num_rollout"]) if req.rollout_data else None
    impl_args = _impl_args(miles, req.dsv4_impl)
    work = Path(req.work_dir or tempfile.mkdtemp(prefix="v4rl-rehearse-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    report = RehearsalReport(generation=gen, miles_dir=str(miles), work_dir=str(work))
    try:
        return _run_stages(req, preset, miles, megatron, gen, given_data, impl_args, work, report, log)
    except KeyboardInterrupt:  # every process a stage started was stopped on the way out (their `finally`)
        log(f"interrupted: every process this rehearsal started is stopped; its logs and what it wrote are kept in "
            f"{work}")
        raise


def _run_stages(req, preset, miles, megatron, gen, given_data, impl_args, work, report, log) -> RehearsalReport:
    """The checkpoint, data and noise in `work`, then each stage of `req.stage` (rehearse's body)."""
    hf = work / "hf"
    if not (hf / "config.json").is_file():
        log(f"tiny checkpoint -> {hf}")
        make_tiny_checkpoint(hf)
    train, evals = write_data(work)
    preset = dataclasses.replace(preset, miles=dataclasses.replace(preset.miles, generation=gen))
    stages = [req.stage] if req.stage != "train" else (["train"] if given_data else ["rollout", "train"])
    paths = RehearsalPaths(hf, train, evals, work, rollout_data=given_data)
    if req.stage == "full":  # Miles' broadcast sends FP8 experts: the engine serves FP8 experts (full.py)
        hf_full = work / "hf-fp8-experts"
        if not (hf_full / "config.json").is_file():
            make_tiny_checkpoint(hf_full, expert_dtype="fp8")
        paths = RehearsalPaths(hf_full, train, evals, work)
        noise = _measure_noise(hf_full, preset, report, log)
        return _full(req, preset, paths, miles, megatron, impl_args, report, noise, log)
    noise = _measure_noise(hf, preset, report, log) if req.stage == "train" else None
    for stage in stages:
        if stage == "train" and not report.stages.get("rollout", {"ok": True})["ok"]:
            report.stages["train"] = {"ok": False, "seconds": 0.0, "error": "not run: stage rollout failed"}
            break
        error, seconds = _run_stage(stage, req, preset, paths, miles, megatron, impl_args, report, log)
        log_path = work / MILES_LOGS[stage]
        metrics = read_metrics(log_path)
        for rollout, values in metrics.rollouts.items():
            report.rollouts.setdefault(rollout, {}).update(values)
        report.evals += metrics.evals
        if error is None and stage == "rollout" and not metrics.rollouts:
            error = f"Miles exited without logging a rollout (see {log_path})"
        if error is None and stage == "train":
            error = _missing_train_metrics(metrics, ROLLOUT_SIZES["num_rollout"], log_path) or \
                logprob_diff_problem(metrics.rollouts, noise, str(log_path))
        report.stages[stage] = {"ok": error is None, "seconds": seconds, "error": error}
    return report


def _measure_noise(hf: Path, preset, report: RehearsalReport, log) -> LogprobNoise:
    """The tiny model's logprob noise at the job's temperature (bf16; FP8 re-quantization as Miles broadcasts) and
    the |Δlogprob| bounds from it, logged and kept in the report (under a minute on 2 cores)."""
    noise = measure_logprob_noise(hf, rehearsal_prompts(), temperature=preset.data.temperature,
                                  samples_per_prompt=ROLLOUT_SIZES["n_samples_per_prompt"],
                                  max_new_tokens=ROLLOUT_SIZES["rollout_max_response_len"])
    report.logprob_bound = noise.to_json()
    log(f"logprob noise over {noise.tokens} tokens at T {noise.temperature:g}: bf16 {noise.bf16_noise:.4f}, FP8 "
        f"re-quantization {noise.fp8_requant_noise:.4f} (raw vs processed {noise.raw_vs_processed:.4f}); bounds "
        f"{noise.bound:.4f} (stage train), {noise.broadcast_bound:.4f} (after a broadcast)")
    return noise


def _full(req, preset, paths, miles, megatron, impl_args, report, noise, log) -> RehearsalReport:
    from engines.upstream.rehearsal.full import run_full

    error, seconds, extras = run_full(req, preset, paths, miles, megatron, impl_args, report, log)
    for path in extras["logs"]:
        metrics = read_metrics(path)
        for rollout, values in metrics.rollouts.items():
            report.rollouts.setdefault(rollout, {}).update(values)
        report.evals += metrics.evals
    report.weight_checks, report.resumed_from = extras["weight_checks"], extras["resumed_from"]
    if error is None:
        error = logprob_diff_problem(report.rollouts, noise, " and ".join(map(str, extras["logs"])), broadcast=True)
    report.stages["full"] = {"ok": error is None, "seconds": seconds, "error": error}
    return report


STAGES = ("rollout", "train", "full")
SUBMIT_MODES = ("driver", "ray-job")
"""RehearsalRequest.submit: train.py as this process's child, or submitted to the head's Jobs API."""
MILES_LOGS = {"rollout": "miles.log", "train": "miles-train.log"}
"""Miles' driver log of each stage, under the work dir."""
TRAIN_METRICS = ("train/loss", "train/grad_norm", "train/train_rollout_logprob_abs_diff", "train/tis",
                 "train/tis_clipfrac")
"""Miles' own train metrics a train stage must log for every rollout (names as Miles logs them)."""


def _run_stage(stage: str, req: RehearsalRequest, preset, paths: RehearsalPaths, miles: Path, megatron: Path,
               impl_args: list[str], report: RehearsalReport, log) -> tuple[str | None, float]:
    """One stage: its job, its own Ray head (and v4rl's engine for rollout), Miles' train.py; (error, seconds)."""
    work, hf = paths.work, paths.hf_checkpoint
    engine_port = free_port(req.engine_port, "--engine-port")
    ray_port = free_port(req.ray_port, "--ray-port")
    if stage == "train":
        _convert_ref(hf, work / "ref", miles, log)
    try:
        job = rehearsal_job(preset, paths, engine_addr=f"127.0.0.1:{engine_port}", stage=stage,
                            context_length=_context_length(hf), layout=req.layout)
    except ValueError as exc:  # the cluster preset's job cannot be built for the tiny model (a layout rule's line)
        raise RehearsalError(f"the rehearsal job: {exc}") from None
    argv = job.argv + impl_args
    subs = job.substitutions + _impl_rows(job.argv, impl_args)
    if stage == "rollout":
        subs += [PLACEMENT_ROW, ENGINE_LOGPROB_ROW]
        subs.append(Substitution(
            "miles/ray/rollout/debug_data.py save_dashboard_columns", "parquet mirror for Miles' dashboard (polars)",
            "skipped (Miles' own no-polars path)", "the polars beside SGLang 0.5.23 lacks its compiled runtime; "
            "the rollout_<id>.pt dump stage train reads is unchanged"))
    else:
        subs += TRAIN_STANDIN_ROWS
    report.substitutions += [s for s in subs if s not in report.substitutions]
    env = _stage_env(stage, job.env, miles, megatron, ray_port)
    engine = ray = None
    ray_dir = _ray_temp_dir(work)
    t0 = time.monotonic()
    try:
        if stage == "rollout":
            engine = _start_engine(hf, engine_port, work / "engine.log")
            log(f"engine: v4rl serve-rollout on 127.0.0.1:{engine_port}; Ray head 127.0.0.1:{ray_port}")
        try:
            ray = RaySession(ray_dir, port=ray_port, **job.ray, env=env, log=work / f"ray-{stage}.log")
        except (RuntimeError, TimeoutError) as exc:
            raise RehearsalError(f"stage {stage}: ray: {exc}") from None
        log(f"stage {stage}: Miles {miles.name} (generation {report.generation}): train.py {' '.join(argv[-6:])} ...")
        error = _run_miles(miles, argv, env, work, req.timeout_s, log_name=MILES_LOGS[stage])
    finally:
        stop_session(ray, engine, ray_dir, work)
    return (f"stage {stage}: {error}" if error else None), round(time.monotonic() - t0, 1)


def stop_session(ray: RaySession | None, engine: subprocess.Popen | None, ray_dir: Path, work: Path) -> None:
    """Stop what a stage started (its Ray head, then v4rl's engine) and remove a Ray temp dir kept outside `work`."""
    if ray is not None:
        ray.stop()
    if engine is not None:
        _stop(engine)
    if not ray_dir.is_relative_to(work):
        shutil.rmtree(ray_dir, ignore_errors=True)


def _stage_env(stage: str, job_env: dict, miles: Path, megatron: Path, ray_port: int) -> dict[str, str]:
    """The environment of every process of a stage: the bootstrap first on PYTHONPATH (the CPU stand-ins), then
    (stage train) the TE stand-in package and the GPU kernels' math for Megatron's forward and backward."""
    from engines.upstream.miles_model_check import NUMERIC_STANDINS, STANDINS, MODEL_STUB_ROOTS, \
        tile_kernels_mhc_reference

    model = [STANDINS] if stage in ("train", "full") else []
    paths = [BOOTSTRAP, *model, miles, megatron, *src.sglang_paths(), src.REPO]
    env = {**job_env, **LOCAL_RAY_ENV, "PYTHONPATH": os.pathsep.join(map(str, paths)),
           "V4RL_ENGINE_STUBS": str(Path(src.__file__).with_name("stubs.py")),
           "V4RL_STUB_ROOTS": json.dumps(list(STUB_ROOTS) + (list(MODEL_STUB_ROOTS) if model else [])),
           "V4RL_REHEARSAL_DEVICE": json.dumps(DEVICE),
           "V4RL_REHEARSAL_WORKAROUNDS": ",".join(WORKAROUNDS),
           "V4RL_REHEARSAL_DEVICE_PATCH": str(src.REPO / "engines/upstream/probes/model_probe.py"),
           "MILES_HOST_IP": "127.0.0.1", "V4RL_REHEARSAL_DRIVER": str((miles / "train.py").resolve()),
           "RAY_ADDRESS": f"127.0.0.1:{ray_port}", "PYTHONUNBUFFERED": "1"}
    if model:
        env["V4RL_REHEARSAL_KERNELS"] = str(NUMERIC_STANDINS)
        try:
            env["V4RL_TILE_KERNELS_MHC"] = str(tile_kernels_mhc_reference())
        except src.EngineSourceMissing as exc:
            raise RehearsalError(f"stage {stage}: {exc}") from None
    return env


PLACEMENT_ROW = Substitution(
    "miles/ray/placement_group.py _get_placement_group_layout", "no rollout bundle with --rollout-external",
    "the actor's logical GPUs, shared", "Miles defect: server_group.py:91 (and, with --debug-rollout-only, "
    "actor_factory.py:89) then index a bundle that does not exist (IndexError) before any rollout; worked around "
    "from outside (bootstrap), Miles' file unchanged")
TRAIN_STANDIN_ROWS = [
    Substitution("transformer_engine", "TE (ROCm build)", "probes/standins/transformer_engine: torch ops, TE's "
                 "parameter names", "no TE on a CPU; plain torch ops, so autograd gives the backward"),
    Substitution("tile_kernels mHC, fast_hadamard_transform, torch.mm(out_dtype)", "GPU kernels",
                 "probes/numeric_standins.py: TileKernels' own torch references, Sylvester-Hadamard matmul, fp32 mm",
                 "the kernels' math in differentiable torch ops: the backward is autograd through them"),
    Substitution("tilelang sparse attention with sinks, lightning indexer", "Miles' tilelang kernels, forward and "
                 "backward", "probes/numeric_standins.py: sparse_mqa_fwd/bwd_interface, batched_indexer_fwd/bwd, "
                 "bound as Miles imports its kernel modules", "no tilelang on a CPU; Miles' own autograd Functions "
                 "call them (--dsv4-impl miles, generation 1); each backward is the gradient of its forward "
                 "(tests/test_numeric_standins.py gradchecks)"),
    Substitution("transformer_engine.pytorch.optimizers.FusedAdam", "TE's fused kernel (multi_tensor_adam)",
                 "probes/standins/.../optimizers.py: the kernel's Adam update in torch, TE's state layout",
                 "no TE kernel on a CPU; Megatron's torch-AdamW fallback cannot resume (distrib_optimizer.py:889 "
                 "reads a step torch's AdamW has before its first step), TE's path is the cluster's"),
]


def _impl_args(miles: Path, impl: str | None) -> list[str]:
    try:
        return dsv4_impl_args(detect_generation(miles), impl)
    except MilesGenerationError as exc:
        raise RehearsalError(str(exc)) from None


def _impl_rows(argv: list[str], impl_args: list[str]) -> list[Substitution]:
    """A row for a --dsv4-impl / --dsa-kernel-backend that differs from the job's (argparse: the last wins)."""
    from engines.miles.command import parse_flags

    job, given = parse_flags(argv), parse_flags(impl_args)
    return [Substitution(flag, " ".join(job.get(flag) or ["(absent)"]), " ".join(value),
                         "the model implementation this rehearsal runs (--dsv4-impl megatron runs Megatron's own "
                         "PyTorch attention: --dsa-kernel-backend none, no cuDNN kernels on a CPU)")
            for flag, value in given.items() if job.get(flag) != value]


def _convert_ref(hf: Path, ref: Path, miles: Path, log, *, force: bool = False) -> None:
    """v4rl's torch_dist conversion of the tiny checkpoint under the names this Miles' model asks for, as
    `v4rl convert --miles-dir` writes it (a no-op when up to date)."""
    from checkpoints.convert import convert_hf_to_torch_dist
    from engines.miles.generation import megatron_names_for

    names, why = megatron_names_for(miles)
    result = convert_hf_to_torch_dist(hf, ref, workers=1, megatron_names=names, force=force)
    if not result.skipped:
        log(f"--ref-load: v4rl convert {hf} -> {ref} ({names} names: {why})")


def _check_rollout_data(path: str, num_rollout: int) -> Path:
    """--rollout-data: a directory of Miles' `rollout_<id>.pt` dumps, one per rollout the train stage trains."""
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise RehearsalError(f"--rollout-data {path}: no such directory; give the rollout-data/ folder a "
                             "`--stage rollout` run wrote (its work dir), or drop --rollout-data to run it first")
    missing = [f"rollout_{i}.pt" for i in range(num_rollout) if not (root / f"rollout_{i}.pt").is_file()]
    if missing:
        raise RehearsalError(f"--rollout-data {path}: lacks Miles' dump {missing[0]} (--num-rollout "
                             f"{num_rollout}); rerun `v4rl rehearse --stage rollout` or drop --rollout-data")
    return root


def _missing_train_metrics(metrics, num_rollout: int, log: Path) -> str | None:
    """None when Miles logged every TRAIN_METRICS name, finite, for each rollout; else what is missing."""
    import math

    for rollout in map(str, range(num_rollout)):
        values = metrics.rollouts.get(rollout, {})
        for name in TRAIN_METRICS:
            if name not in values:
                return f"stage train: Miles logged no {name} for rollout {rollout} (see {log})"
            if not math.isfinite(values[name]):
                return f"stage train: Miles logged {name} = {values[name]} for rollout {rollout} (see {log})"
    return None


RAY_SOCKET_TAIL = len("/session_2026-12-02_17-57-36_298885_4194304/sockets/plasma_store")
UNIX_SOCKET_MAX = 107


def _ray_temp_dir(work: Path) -> Path:
    """work/ray, unless Ray's socket paths under it would pass the AF_UNIX limit (107 bytes; pytest's tmp_path
    does): then a short, new directory under /tmp."""
    ray_dir = work / "ray"
    if len(str(ray_dir)) + RAY_SOCKET_TAIL <= UNIX_SOCKET_MAX:
        return ray_dir
    return Path(tempfile.mkdtemp(prefix="v4rl-ray-", dir="/tmp"))


def _context_length(hf: Path) -> int:
    return int(json.loads((hf / "config.json").read_text())["max_position_embeddings"])


ENGINE_LOGPROB_ROW = Substitution(
    "rollout logprobs (meta_info.output_token_logprobs)", "SGLang's default: log_softmax(logits / T)",
    "the same: serve-rollout --no-return-original-logprob", "Miles' loss recomputes log_softmax(logits / "
    "--rollout-temperature); v4rl's engine returns RAW logprobs unless told (its own trainer's convention): at T 0.8 "
    "that alone made Miles log |Δlogprob| 0.10 on the tiny model (docs/rehearsal.md, the bound)")


def _start_engine(hf: Path, port: int, log: Path) -> subprocess.Popen:
    """`v4rl serve-rollout` answering as Miles' SGLang does on the cluster (ENGINE_LOGPROB_ROW)."""
    cmd = [sys.executable, "-m", "v4rl.cli", "serve-rollout", "--model", str(hf), "--port", str(port),
           "--no-return-original-logprob"]
    out = log.open("w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(src.REPO)})
    deadline = time.monotonic() + ENGINE_START_S
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RehearsalError(f"engine: `v4rl serve-rollout` exited with {proc.returncode}: "
                                     f"{src.engine_error(log.read_text(errors='replace'))}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    return proc
            except OSError:
                time.sleep(1)
        raise RehearsalError(f"engine: `v4rl serve-rollout` did not answer /health within {ENGINE_START_S:.0f}s "
                             f"({log})")
    except BaseException:  # not up in time, exited, or Ctrl-C while it starts: nothing of it stays up
        _stop(proc)
        raise


TOLERATED_REFUSALS = ("POST /destroy_weights_update_group",)
"""Refusals Miles expects and ignores: before its first broadcast it destroys a group the engine does not have yet
(miles/backends/sglang_utils/sglang_engine.py destroy_weights_update_group catches the error: "the engine is just
created and does not have the group"), which v4rl's engine, as SGLang, answers with a 400."""


class _RefusalWatch:
    """The engine's first refused request, from `v4rl serve-rollout`'s log (its REFUSAL_PREFIX lines), reading
    only what the log gained since the last look."""

    def __init__(self, engine_log: Path) -> None:
        self.engine_log, self.offset, self.partial = engine_log, 0, ""

    def first(self) -> str | None:
        from engines.rollout.server import REFUSAL_PREFIX

        if not self.engine_log.exists():
            return None
        with self.engine_log.open("r", errors="replace") as f:
            f.seek(self.offset)
            text = self.partial + f.read()
            self.offset = f.tell()
        lines = text.split("\n")
        self.partial = lines.pop()  # a line still being written
        return next((line[len(REFUSAL_PREFIX):] for line in lines if line.startswith(REFUSAL_PREFIX)
                     and not line[len(REFUSAL_PREFIX):].startswith(TOLERATED_REFUSALS)), None)


def _run_miles(miles: Path, argv: list[str], env: dict, work: Path, timeout: float,
               log_name: str = "miles.log", kill_when=None) -> str | None:
    """Miles' train.py, unmodified, as a child in its own process group; its error line, or None on success. A
    request the engine refuses stops it at once with the engine's own message (engine.log in `work`). Once
    `kill_when()` is true, the driver's process group is killed (SIGKILL, a crash: no handler of Miles runs) and
    None is returned."""
    log, engine_log = work / log_name, work / "engine.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, str(miles / "train.py"), *argv], cwd=work, stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True)
        deadline, watch = time.monotonic() + timeout, _RefusalWatch(engine_log)
        try:
            while (code := proc.poll()) is None:
                refusal = watch.first()
                if refusal:  # Miles retries a refused request for a minute: stop now and say why
                    return f"v4rl's engine refused Miles' request: {refusal} (engine log: {engine_log})"
                if kill_when is not None and kill_when():
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(30)
                    return None
                if time.monotonic() > deadline:
                    return f"Miles' train.py did not finish within {timeout:.0f}s (log: {log})"
                time.sleep(0.5)
        finally:  # refused, timed out, Ctrl-C or an error in a check: Miles' driver (its own session) stops too
            if proc.poll() is None:
                _stop(proc)
    if code != 0:
        text = log.read_text(errors="replace")
        return f"Miles' train.py exited with {code}{_miles_frame(text, miles)}: {src.engine_error(text)}"
    return None


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')


def _miles_frame(text: str, miles: Path) -> str:
    """` at miles/...py:N`: the innermost frame of Miles' (or Megatron's) own code in the log's last traceback."""
    frames = [(m["file"], m["line"]) for m in _FRAME.finditer(text)
              if "/miles" in m["file"] or "/megatron/" in m["file"]]
    if not frames:
        return ""
    file, line = frames[-1]
    for marker in ("/miles_plugins/", "/miles/", "/megatron/"):
        if marker in file:
            file = marker[1:] + file.split(marker, 1)[1]
            break
    return f" at {file}:{line}"


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue
