"""A new user's Ctrl-C, second run and full disk (issue 25, items 7-10), through the real `v4rl` command in a child
process (own session; SIGINT sent to its whole process group, as a terminal does):

- Ctrl-C during `v4rl train`: exit 130 within seconds, one line saying which checkpoint was kept and where the same
  command resumes, and the rerun does resume there;
- a second `v4rl train` on a run directory in use is refused in seconds, naming the PID and command holding it; a
  lock left by a killed process is taken over with a note;
- Ctrl-C during `v4rl demo`: it ends within seconds, its flow run is Crashed (not Running) in the demo's own
  database, its Prefect server is gone, and it says what was kept;
- a full disk at checkpoint time, inside the Ray trainer actor: one line, the cause's message, no Ray dump;
- SIGTERM (what `timeout`, systemd, Slurm and Kubernetes send) to `v4rl train` on Ray, to the command and then its
  whole process group as `timeout` does: ends as Ctrl-C does (exit 143), no process of its tree left;
- `--lr 10`: the diverged step in one line (step, non-finite value, the flag), not Ray's traceback.

A minute or two each on a loaded 2-core machine (the demo test: its conversion and alignment come first).

    .venv/bin/python -m pytest tests/test_interrupt_and_lock.py -q
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engines.runs.checkpointing import latest_step
from engines.runs.run_lock import LOCK_NAME, RunDirBusy, hold_run_dir
from tests.planted import PLANT_DIR, PLANT_ENV

pytestmark = pytest.mark.faults

ROOT = Path(__file__).resolve().parents[1]
TINY_TRAIN = ["--prompts-per-step", "4", "--n-samples", "2", "--n-eval", "4", "--eval-interval", "2",
              "--save-interval", "2"]


class _Command:
    """`v4rl ARGS` in a child process of its own session, its output in a file."""

    def __init__(self, tmp_path: Path, name: str, *args: str, env: dict | None = None) -> None:
        """`env`: the child's whole environment (default: this process's)."""
        self.log = tmp_path / f"{name}.log"
        environ = {**(os.environ if env is None else env), "PYTHONPATH": str(ROOT), "COLUMNS": "400"}
        with open(self.log, "w") as out:
            # a terminal's Ctrl-C finds SIGINT at its default; a suite started in the background of a
            # non-interactive shell (nohup ... &) inherits it ignored, and Python keeps an ignored SIGINT ignored
            self.proc = subprocess.Popen([sys.executable, "-m", "v4rl.cli", *args], cwd=ROOT, env=environ,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_sigint_at_default)

    def output(self) -> str:
        return self.log.read_text()

    def wait_for(self, text: str | re.Pattern, timeout: float = 600.0) -> None:
        """Until the output holds `text` (a string, or a compiled pattern to search for)."""
        found = text.search if isinstance(text, re.Pattern) else lambda out: text in out
        deadline = time.monotonic() + timeout
        while not found(self.output()):
            assert self.proc.poll() is None, f"exited ({self.proc.returncode}) before {text!r}:\n{self.output()}"
            assert time.monotonic() < deadline, f"no {text!r} within {timeout:.0f}s:\n{self.output()}"
            time.sleep(0.2)

    def ctrl_c(self, within: float) -> float:
        """SIGINT to the whole process group; the seconds it took to exit (fails past `within`)."""
        start = time.monotonic()
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(within)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"still running {within:.0f}s after one Ctrl-C:\n{self.output()}") from None
        return time.monotonic() - start

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _session_processes(sid: int) -> list[str]:
    """Live (non-zombie) processes of session `sid`: a child started with start_new_session and all it started."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(f"{stat.parent.name} {(stat.parent / 'cmdline').read_bytes()[:120]!r}")
    return found


def _sigint_at_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _run(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "400", **(env or {})}
    return subprocess.run([sys.executable, "-m", "v4rl.cli", *args], cwd=ROOT, env=environ, capture_output=True,
                          text=True, timeout=timeout)


def test_ctrl_c_during_train_says_what_was_kept_a_second_run_is_refused_and_the_rerun_resumes(tmp_path, tiny_base):
    out = tmp_path / "run"
    first = _Command(tmp_path, "first", "train", "--out", str(out), "--steps", "60", "--no-ray", *TINY_TRAIN)
    try:
        first.wait_for("step 3:")
        started = time.monotonic()
        second = _run("train", "--out", str(out), "--steps", "60", "--no-ray", *TINY_TRAIN, timeout=120)
        assert time.monotonic() - started < 30, "the second run was not refused at once"
        assert second.returncode == 1 and "Traceback" not in second.stderr, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and f"is in use by PID {first.proc.pid} (" in lines[0], lines
        assert "v4rl.cli train" in lines[0], lines
        assert "step 1:" not in second.stdout  # nothing trained
        took = first.ctrl_c(within=60)
    finally:
        first.kill()
    text = first.output()
    assert first.proc.returncode == 130 and "Traceback" not in text, text
    kept = re.search(r"interrupted: kept: checkpoint step (\d+) in \S+, .*?; a rerun of the same command "
                     r"resumes at step (\d+)", text)
    assert kept, text
    assert int(kept[1]) == latest_step(out / "checkpoints") and int(kept[2]) == int(kept[1]) + 1, text
    assert took < 30, took

    rerun = _run("train", "--out", str(out), "--steps", str(int(kept[1]) + 1), "--no-ray", *TINY_TRAIN)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert f"resuming at step {int(kept[2])}" in rerun.stdout, rerun.stdout
    assert "took over the lock" not in rerun.stdout  # the interrupted run released it
    rows = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(1, int(kept[2]) + 1))


HOLDER = textwrap.dedent("""
    import sys, time
    from engines.runs.run_lock import hold_run_dir
    with hold_run_dir(sys.argv[1]):
        print("held", flush=True)
        time.sleep(600)
""")


def test_a_live_holder_is_named_and_a_dead_ones_lock_is_taken_over_with_a_note(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirBusy, match=rf"is in use by PID {holder.pid} \(.*-c .*, since "):
            with hold_run_dir(run_dir):
                pass
    finally:
        holder.kill()  # SIGKILL: the kernel drops its flock, the file still names it
        holder.wait()
    notes: list[str] = []
    with hold_run_dir(run_dir, log=notes.append):
        with hold_run_dir(run_dir, log=notes.append):  # re-entrant within a process (flow + its training task)
            pass
        assert json.loads((run_dir / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert len(notes) == 1 and f"took over the lock left by PID {holder.pid}" in notes[0], notes
    assert (run_dir / LOCK_NAME).read_text() == ""  # released cleanly: the next holder gets no note


def test_ctrl_c_during_the_demo_ends_it_in_seconds_with_the_flow_run_crashed(tmp_path):
    workdir = tmp_path / "demo"
    # No PREFECT_* of this session (the shared test server sets PREFECT_LOGGING_LEVEL=WARNING, which would hide
    # the flow's step lines): the demo as a user starts it, with its own server and home
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    demo = _Command(tmp_path, "demo", "demo", "--workdir", str(workdir), "--steps", "40", env=env)
    try:
        # The training is under way once step 0's evaluation is published (its upload task finished; the flow is
        # back to waiting on the training, which is in step 1): Ctrl-C then, not after step 1 is logged, which is
        # 1024 more rollouts and a GRPO step later (~9 s of both cores) and ends the same way.
        demo.wait_for(re.compile(r"Task run 'upload-artifacts-\w+' - Finished in state Completed"))
        server_pid = int(re.search(r"pid (\d+)\)", demo.output())[1])
        took = demo.ctrl_c(within=90)
    finally:
        demo.kill()
    text = demo.output()
    assert demo.proc.returncode == 130 and "Traceback" not in text, text
    assert took < 45, took
    assert "interrupted: the rl-pipeline flow run is marked Crashed" in text and "kept: " in text, text
    db = sqlite3.connect(workdir / "prefect-home" / "prefect.db")
    states = db.execute("SELECT state_type FROM flow_run JOIN flow ON flow.id = flow_run.flow_id "
                        "WHERE flow.name = 'rl-pipeline'").fetchall()
    assert states == [("CRASHED",)], states
    assert not Path(f"/proc/{server_pid}").exists() or \
        Path(f"/proc/{server_pid}/stat").read_text().split()[2] == "Z", "the demo's Prefect server is still up"


def test_a_full_disk_inside_the_ray_trainer_is_one_line(tmp_path, tiny_base):
    """The checkpoint save of step 2 fails in the trainer actor (a full disk planted there by tests/planted.py): the
    user gets CheckpointWriteError's own message on one line, without Ray's traceback or colour codes."""
    result = _run("train", "--out", str(tmp_path / "run"), "--steps", "2", *TINY_TRAIN,
                  env={PLANT_ENV: "full_disk:2", "PYTHONPATH": os.pathsep.join([str(ROOT), str(PLANT_DIR)])})
    lines = [x for x in result.stderr.splitlines() if x.startswith("error: ")]
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert "writing the training checkpoint of step 2" in lines[0] and "free space on" in lines[0], lines
    assert "Traceback" not in result.stderr and "\x1b[" not in result.stderr, result.stderr


def test_sigterm_during_train_on_ray_ends_it_as_ctrl_c_does_and_leaves_no_process(tmp_path, tiny_base):
    """`timeout` sends SIGTERM to the command, then to its process group, which holds the local Ray cluster's GCS
    and raylet (the actors have groups of their own). Before: Ray's signal handler dumped a stack, exit 134."""
    out = tmp_path / "run"
    run = _Command(tmp_path, "train", "train", "--out", str(out), "--steps", "60", *TINY_TRAIN)
    try:
        run.wait_for("step 3:")
        assert "eval step 0: pass@1 " in run.output(), run.output()  # printed as it landed, not only at the end
        start = time.monotonic()
        os.kill(run.proc.pid, signal.SIGTERM)
        os.killpg(run.proc.pid, signal.SIGTERM)
        run.proc.wait(90)
        took = time.monotonic() - start
    finally:
        run.kill()
    text = run.output()
    assert run.proc.returncode == 143 and "Traceback" not in text and "SIGTERM received" not in text, text
    kept = re.search(r"terminated \(SIGTERM\): kept: checkpoint step (\d+) in \S+, .*?; a rerun of the same command "
                     r"resumes at step (\d+)", text)
    assert kept and int(kept[1]) == latest_step(out / "checkpoints"), text
    assert f"report: {out / 'report.md'}" in text and (out / "report.md").exists(), text
    assert f"checkpoints: {out / 'checkpoints'} (latest: step {kept[1]})" in text, text
    assert took < 60, took
    deadline = time.monotonic() + 30
    while _session_processes(run.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _session_processes(run.proc.pid), _session_processes(run.proc.pid)


def test_a_diverging_lr_is_one_line_naming_the_step_the_value_and_the_flag(tmp_path, tiny_base):
    """--lr 10 on the tiny model: step 1 trains, its update makes step 2's gradient NaN, which the trainer actor
    raises as FloatingPointError through Ray. Before: a 148-line Ray traceback."""
    result = _run("train", "--out", str(tmp_path / "run"), "--steps", "3", "--lr", "10", *TINY_TRAIN,
                  "--eval-interval", "0")
    errors = [x for x in result.stderr.splitlines() if x.startswith("error: ")]
    assert result.returncode == 1 and len(errors) == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "\x1b[" not in result.stderr, result.stderr
    assert re.search(r"non-finite grad norm (nan|inf) at step \d", errors[0]) and "--lr is 10 here" in errors[0], errors
