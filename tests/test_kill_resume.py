"""Kill tests (issue 5): the driver process, the rollout server and the trainer actor, each SIGKILLed in the
middle of a step of a real run in a child process; a new `run_training` call resumes from the last
checkpoint, ends at the same step count with one continuous metric series, and with the same metric values
and fp32 master weights (torch.equal) as a run that never died.

Determinism: seeds are fixed, and every trainer runs torch on one thread. Ray gives each 1-CPU actor
OMP_NUM_THREADS=1, so the in-process runs here (the reference, the driver-kill child and in-process
resumes) pin one thread too; at 2 threads the float reductions differ from the actors' in the last bits
(measured: train/grad_norm 1.27660573 vs 1.27660584 at step 1) and the weights part after a few steps.

    .venv/bin/python -m pytest tests/test_kill_resume.py -q
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch

from engines.runs.checkpointing import latest_step, load_training_checkpoint
from engines.train.run import TrainRunConfig, run_training
from rl.loop import LoopConfig

pytestmark = pytest.mark.faults

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4
MARK = "V4RL_KILL_TEST_MARK"

# The child: a run of `_config` (imported from this file, so both sides share one config) that, on Ray,
# writes the pids of its trainer and rollout actors to PID_FILE once step 2 is logged and checkpointed.
DRIVER = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from test_kill_resume import _config
    from engines.train.run import _safe_key, run_training

    import torch
    torch.set_num_threads(1)  # as the Ray actors and the in-process runs of the test (see its docstring)
    run_dir, base, use_ray, pid_file = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]

    def on_step(step, metrics):
        if step == 2 and use_ray:
            import ray
            key = _safe_key(Path(run_dir).name)
            pids = {{role: ray.get(ray.get_actor(f"v4rl-{{key}}-{{role}}").ping.remote(), timeout=60)
                    for role in ("trainer", "rollout")}}
            Path(pid_file + ".tmp").write_text(json.dumps(pids))
            os.replace(pid_file + ".tmp", pid_file)

    run_training(run_dir, _config(base, use_ray=use_ray), on_step=on_step, log=lambda m: print(m, flush=True))
""")


def _config(base, **kw) -> TrainRunConfig:
    """tests/test_train_run.py's small config (4 prompts x 4 samples, 6 new tokens, a checkpoint every 2 steps)."""
    return TrainRunConfig(base=str(base), steps=STEPS, save_interval=2, n_eval=8, n_train=64, lr=1e-3,
                          loop=LoopConfig(prompts_per_step=4, n_samples=4, eval_interval=2, max_new_tokens=6,
                                          dynamic_sampling=False), **kw)


@contextlib.contextmanager
def _one_thread():
    """torch on one thread in this process, as in a 1-CPU Ray actor (see the module docstring)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _resume(run_dir: Path, base, use_ray: bool) -> dict:
    with _one_thread():
        return run_training(run_dir, _config(base, use_ray=use_ray), log=lambda m: None)


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _master(run_dir: Path, base) -> dict[str, torch.Tensor]:
    from checkpoints.hf import read_config

    cfg, _ = read_config(base)
    return load_training_checkpoint(run_dir / "checkpoints", STEPS, cfg)["master"]


def _marked_pids(mark: str) -> list[int]:
    """Processes (of this user) whose environment carries `mark`: the child and everything it started."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


class _Child:
    """The driver script in a child process (own session), tagged so that whatever it leaves behind is found."""

    def __init__(self, tmp_path: Path, run_dir: Path, base, use_ray: bool) -> None:
        script = tmp_path / "driver.py"
        script.write_text(DRIVER.format(tests=str(ROOT / "tests")))
        self.mark = uuid.uuid4().hex
        self.pid_file = tmp_path / "pids.json"
        self.log = tmp_path / "child.log"
        env = {**os.environ, MARK: self.mark, "PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, str(script), str(run_dir), str(base),
                                          "1" if use_ray else "0", str(self.pid_file)],
                                         cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def wait_for(self, ready, what: str, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"the run exited ({self.proc.returncode}) before {what}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout:.0f}s:\n{self.output()}")
            time.sleep(0.05)

    def output(self) -> str:
        return self.log.read_text()[-4000:]

    def leftovers(self, grace_s: float = 20.0) -> list[int]:
        """Tagged processes still alive `grace_s` after the child exited (Ray's shutdown is not instant)."""
        deadline = time.monotonic() + grace_s
        while (pids := _marked_pids(self.mark)) and time.monotonic() < deadline:
            time.sleep(0.25)
        return pids

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in _marked_pids(self.mark):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _has_step(run_dir: Path, step: int):
    path = run_dir / "metrics.jsonl"

    def ready() -> bool:
        if not path.exists():
            return False
        try:
            return any(r["step"] == step for r in _rows(run_dir))
        except json.JSONDecodeError:  # a row being written right now
            return False
    return ready


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime (fields 14 and 15 of proc(5))


def _busy(pid: int, min_ticks: int = 3):
    """ready() for `_Child.wait_for`: true once `pid` burned >= min_ticks of CPU (1/100 s) since the last poll
    100 ms ago or more, i.e. it is computing rather than idling in Ray's event loop."""
    state = {"t": time.monotonic(), "ticks": _cpu_ticks(pid)}

    def ready() -> bool:
        if time.monotonic() - state["t"] < 0.1:
            return False
        ticks = _cpu_ticks(pid)
        busy = ticks - state["ticks"] >= min_ticks
        state.update(t=time.monotonic(), ticks=ticks)
        return busy
    return ready


def _assert_resumed_like(reference: Path, resumed: Path, summary: dict, base) -> None:
    assert summary["resumed_from"] == 2 and summary["last_step"] == STEPS
    rows, ref_rows = _rows(resumed), _rows(reference)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # continuous, no duplicate step rows
    assert latest_step(resumed / "checkpoints") == STEPS
    # Same metric values as the uninterrupted run (timings aside).
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith("perf/")}  # noqa: E731
    assert [strip(r) for r in rows] == [strip(r) for r in ref_rows]
    a, b = _master(reference, base), _master(resumed, base)
    assert a.keys() == b.keys()
    differing = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differing, f"final master weights differ from the uninterrupted run's: {differing[:5]}"


@pytest.fixture(scope="module")
def reference_run(tiny_base, tmp_path_factory) -> Path:
    """One uninterrupted run in this process (the reference for every kill below)."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    _resume(run_dir, tiny_base, use_ray=False)
    assert [r["step"] for r in _rows(run_dir)] == list(range(1, STEPS + 1))
    return run_dir


def test_driver_killed_mid_step_resumes(tiny_base, reference_run, tmp_path):
    """SIGKILL the driver (trainer and rollout in its process) once step 3 is logged: it dies inside step 4
    with step 3 logged but never checkpointed; the resumed run drops that row and redoes steps 3-4."""
    run_dir = tmp_path / "run"
    child = _Child(tmp_path, run_dir, tiny_base, use_ray=False)
    try:
        child.wait_for(_has_step(run_dir, 3), "a metrics row for step 3")
        os.kill(child.proc.pid, signal.SIGKILL)
        assert child.proc.wait(timeout=30) == -signal.SIGKILL
        assert latest_step(run_dir / "checkpoints") == 2
        assert [r["step"] for r in _rows(run_dir)][-1] == 3
        assert not child.leftovers(grace_s=5.0)
    finally:
        child.cleanup()
    summary = _resume(run_dir, tiny_base, use_ray=False)
    _assert_resumed_like(reference_run, run_dir, summary, tiny_base)


def _kill_actor_mid_step(role: str, tiny_base, reference_run, tmp_path) -> None:
    run_dir = tmp_path / "run"
    child = _Child(tmp_path, run_dir, tiny_base, use_ray=True)
    try:
        # The pid file is written at the end of step 2 (after its checkpoint). The actor's next busy spell is
        # its part of step 3 (the rollout: generate; the trainer: the GRPO step), and the kill lands in it,
        # or in step 4 when step 3's spell ended between two polls (a tiny rollout takes ~0.1 s): then step 3
        # is logged but, like step 4, never checkpointed, and the resumed run redoes both.
        child.wait_for(child.pid_file.exists, "the actors' pids (after step 2)")
        pid = json.loads(child.pid_file.read_text())[role]
        child.wait_for(_busy(pid), f"the {role} at work in step 3")
        os.kill(pid, signal.SIGKILL)
        code = child.proc.wait(timeout=300)
        out = child.output()
        assert code != 0, f"the run went on after its {role} died:\n{out}"
        assert latest_step(run_dir / "checkpoints") == 2
        assert [r["step"] for r in _rows(run_dir)] in ([1, 2], [1, 2, 3]), out
        # The rollout dies mid-request (RemoteProtocolError) or between requests (connection refused).
        expected = r"engines\.rollout\.sglang\.SGLang\w*Error" if role == "rollout" else r"ActorDiedError"
        assert re.search(expected, out), out
        leaked = child.leftovers()
        assert not leaked, f"processes of the dead run still alive: {leaked}"
    finally:
        child.cleanup()
    summary = _resume(run_dir, tiny_base, use_ray=True)
    _assert_resumed_like(reference_run, run_dir, summary, tiny_base)


def test_rollout_server_killed_mid_step_resumes(tiny_base, reference_run, tmp_path):
    """SIGKILL the rollout actor (the process serving HTTP) during step 3: the driver's next request fails
    with a connection error, the run exits non-zero and takes its Ray cluster down; a new run resumes."""
    _kill_actor_mid_step("rollout", tiny_base, reference_run, tmp_path)


def test_trainer_actor_killed_mid_step_resumes(tiny_base, reference_run, tmp_path):
    """SIGKILL the trainer actor during step 3: the driver's next remote call fails (the actor died), the
    run exits non-zero and takes its Ray cluster down; a new run resumes from the step-2 checkpoint."""
    _kill_actor_mid_step("trainer", tiny_base, reference_run, tmp_path)
