"""One rehearsal: v4rl's engine on the tiny checkpoint, a local Ray head, Miles' own train.py; then its metrics.

    report = rehearse(RehearsalRequest(stage="rollout"))      # ~2-4 min on 2 cores
    report.stages["rollout"]["ok"], report.rollouts, report.evals

Every process it starts (the engine, Ray, Miles' driver) is stopped in `finally`, by PID or by its own process
group; every wait has a timeout. A failure is one line in `RehearsalError`: Miles' own error line where it printed
one (engine_sources.engine_error), else the stage and what timed out.
"""

from __future__ import annotations

import dataclasses
import json
import os
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
from engines.upstream.stubs import GPU_ONLY_ROOTS
from engines.rehearsal.job import DEVICE, RehearsalPaths, Substitution, rehearsal_job
from engines.rehearsal.metrics import read_metrics
from engines.rehearsal.ray_session import RAY_ENV, RaySession
from engines.rehearsal.tiny_model import make_tiny_checkpoint
from engines.train.miles.generation import MilesGenerationError, detect_generation, dsv4_impl_args

BOOTSTRAP = Path(__file__).with_name("bootstrap")
STUB_ROOTS = (*GPU_ONLY_ROOTS, "sglang.srt.entrypoints.openai.encoding_dsv4", "sglang.srt.model_loader.parameter_mapper",
              "mooncake")
"""GPU-only imports, plus modules of Miles' own SGLang branch upstream 0.5.23 lacks and Mooncake (Miles' P2P
transfer engine): Miles imports them at module level, a rehearsal never calls them."""
WORKAROUNDS = ("placement",)
"""Miles defects the bootstrap works around (bootstrap/sitecustomize.py), each listed in the substitution table."""
TRAIN_DATA = Path(__file__).resolve().parents[2] / "rl" / "sample_math.jsonl"
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


@dataclass
class RehearsalReport:
    generation: int
    miles_dir: str
    stages: dict[str, dict] = field(default_factory=dict)
    rollouts: dict[str, dict] = field(default_factory=dict)
    evals: list[dict] = field(default_factory=list)
    substitutions: list[Substitution] = field(default_factory=list)
    work_dir: str = ""

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
        megatron = src.megatron_tree(req.megatron_dir, src.MILES_GENERATIONS[gen][1])
    except (src.EngineSourceMissing, MilesGenerationError) as exc:
        raise RehearsalError(str(exc)) from None
    if not (miles / "train.py").is_file():
        raise RehearsalError(f"{miles} has no train.py: not a Miles checkout; point --miles-dir at its repository root")
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


def write_data(work: Path) -> tuple[Path, Path]:
    """Miles' data format (one JSON object a line, `prompt` and `label`): 16 train and 4 eval prompts."""
    lines = TRAIN_DATA.read_text().splitlines()
    train, evals = work / "data" / "train.jsonl", work / "data" / "eval.jsonl"
    train.parent.mkdir(parents=True, exist_ok=True)
    train.write_text("\n".join(lines[:16]) + "\n")
    evals.write_text("\n".join(lines[16:20]) + "\n")
    return train, evals


def rehearse(req: RehearsalRequest, *, preset=None, log=print) -> RehearsalReport:
    if req.stage != "rollout":
        raise RehearsalError(f"--stage {req.stage}: only `rollout` is built so far (issue 28 stages train and full "
                             "are not); use --stage rollout")
    from engines.presets.runs import SEED_RUN

    preset = preset or SEED_RUN
    miles, megatron, gen = resolve_trees(req)
    engine_port = free_port(req.engine_port, "--engine-port")
    ray_port = free_port(req.ray_port, "--ray-port")
    work = Path(req.work_dir or tempfile.mkdtemp(prefix="v4rl-rehearse-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    report = RehearsalReport(generation=gen, miles_dir=str(miles), work_dir=str(work))
    hf = work / "hf"
    if not (hf / "config.json").is_file():
        log(f"tiny checkpoint -> {hf}")
        make_tiny_checkpoint(hf)
    train, evals = write_data(work)
    preset = dataclasses.replace(preset, miles=dataclasses.replace(preset.miles, generation=gen))
    try:
        job = rehearsal_job(preset, RehearsalPaths(hf, train, evals, work), engine_addr=f"127.0.0.1:{engine_port}",
                            stage=req.stage, context_length=_context_length(hf))
    except ValueError as exc:  # the cluster preset's job cannot be built for the tiny model (a layout rule's line)
        raise RehearsalError(f"the rehearsal job: {exc}") from None
    argv = job.argv + dsv4_impl_args(detect_generation(miles))
    report.substitutions = job.substitutions + [Substitution(
        "miles/ray/placement_group.py _get_placement_group_layout", "(0, 0) bundles with --rollout-external "
        "--debug-rollout-only", "the idle actor's logical GPUs", "Miles defect: actor_factory.py then indexes bundle "
        "0 (IndexError) before any rollout; worked around from outside (bootstrap), Miles' file unchanged")]
    sglang = src.sglang_paths()
    paths = [BOOTSTRAP, miles, megatron, *sglang, src.REPO]
    env = {**job.env, **RAY_ENV, "PYTHONPATH": os.pathsep.join(map(str, paths)),
           "V4RL_ENGINE_STUBS": str(Path(src.__file__).with_name("stubs.py")),
           "V4RL_STUB_ROOTS": json.dumps(list(STUB_ROOTS)), "V4RL_REHEARSAL_DEVICE": json.dumps(DEVICE),
           "V4RL_REHEARSAL_WORKAROUNDS": ",".join(WORKAROUNDS),
           "V4RL_REHEARSAL_DEVICE_PATCH": str(src.REPO / "engines/train/miles/probes/model_probe.py"), "MILES_HOST_IP": "127.0.0.1",
           "V4RL_REHEARSAL_DRIVER": str((miles / "train.py").resolve()),
           "RAY_ADDRESS": f"127.0.0.1:{ray_port}", "PYTHONUNBUFFERED": "1"}
    engine = ray = None
    ray_dir = _ray_temp_dir(work)
    t0 = time.monotonic()
    try:
        engine = _start_engine(hf, engine_port, work / "engine.log")
        log(f"engine: v4rl serve-rollout on 127.0.0.1:{engine_port}; Ray head 127.0.0.1:{ray_port}")
        try:
            ray = RaySession(ray_dir, port=ray_port, num_gpus=2, num_cpus=4, env=env, log=work / "ray.log")
        except (RuntimeError, TimeoutError) as exc:
            raise RehearsalError(f"ray: {exc}") from None
        log(f"Miles {miles.name} (generation {gen}): train.py {' '.join(argv[-6:])} ...")
        error = _run_miles(miles, argv, env, work, req.timeout_s)
    finally:
        if ray is not None:
            ray.stop()
        if engine is not None:
            _stop(engine)
        if not ray_dir.is_relative_to(work):
            shutil.rmtree(ray_dir, ignore_errors=True)
    seconds = round(time.monotonic() - t0, 1)
    metrics = read_metrics(work / "miles.log")
    report.rollouts, report.evals = metrics.rollouts, metrics.evals
    if error is None and not metrics.rollouts:
        error = "Miles exited without logging a rollout (see miles.log)"
    report.stages[req.stage] = {"ok": error is None, "seconds": seconds, "error": error}
    return report


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


def _start_engine(hf: Path, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "v4rl.cli", "serve-rollout", "--model", str(hf), "--port", str(port)]
    out = log.open("w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(src.REPO)})
    deadline = time.monotonic() + ENGINE_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RehearsalError(f"engine: `v4rl serve-rollout` exited with {proc.returncode}: "
                                 f"{src.engine_error(log.read_text(errors='replace'))}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(1)
    _stop(proc)
    raise RehearsalError(f"engine: `v4rl serve-rollout` did not answer /health within {ENGINE_START_S:.0f}s ({log})")


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
        return next((line[len(REFUSAL_PREFIX):] for line in lines if line.startswith(REFUSAL_PREFIX)), None)


def _run_miles(miles: Path, argv: list[str], env: dict, work: Path, timeout: float) -> str | None:
    """Miles' train.py, unmodified, as a child in its own process group; its error line, or None on success. A
    request the engine refuses stops it at once with the engine's own message (engine.log in `work`)."""
    log, engine_log = work / "miles.log", work / "engine.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, str(miles / "train.py"), *argv], cwd=work, stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True)
        deadline, watch = time.monotonic() + timeout, _RefusalWatch(engine_log)
        while (code := proc.poll()) is None:
            refusal = watch.first()
            if refusal:  # Miles retries a refused request for a minute: stop now and say why
                _stop(proc)
                return f"v4rl's engine refused Miles' request: {refusal} (engine log: {engine_log})"
            if time.monotonic() > deadline:
                _stop(proc)
                return f"Miles' train.py did not finish within {timeout:.0f}s (log: {log})"
            time.sleep(0.5)
    if code != 0:
        return f"Miles' train.py exited with {code}: {src.engine_error(log.read_text(errors='replace'))}"
    return None


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
