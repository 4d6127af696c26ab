"""A stop request (engines/runs/stopping.py, what a cancelled rl-pipeline flow run sends its training task) ends
an embedded training run (in this process, and on Ray: its trainer and rollout actors killed at once): it raises
TrainingStopped within 60 s, no actor process is left, and a later run of the same directory resumes from the
last checkpoint with each step recorded once. A real local Ray cluster on 127.0.0.1; a few minutes on a loaded
2-core machine.

    .venv/bin/python -m pytest tests/test_train_stop.py -q
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from engines.train.run import _safe_key, run_training
from engines.runs.stopping import StopRequest, TrainingStopped
from tests.test_kill_resume import STEPS, _config

pytestmark = pytest.mark.faults


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("use_ray", [False, True], ids=["in-process", "ray-actors"])
def test_stop_kills_the_trainer_workers_and_a_later_run_resumes(tiny_base, tmp_path, use_ray):
    run_dir, stop, outcome, pids = tmp_path / "run", StopRequest(), [], {}

    def on_step(step: int, metrics: dict) -> None:
        if step == 2 and not use_ray:
            pids["driver"] = -1  # the workers live in this process: only the stop itself is checked
        if step == 2 and use_ray and not pids:
            import ray

            key = _safe_key(run_dir.name)
            pids.update({role: ray.get(ray.get_actor(f"v4rl-{key}-{role}").ping.remote(), timeout=60)
                         for role in ("trainer", "rollout")})

    def training() -> None:
        try:
            outcome.append(run_training(run_dir, _config(tiny_base, use_ray=use_ray), on_step=on_step,
                                        log=lambda m: None, stop=stop))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    thread = threading.Thread(target=training, daemon=True)
    thread.start()
    deadline = time.monotonic() + 900
    while not pids:
        assert thread.is_alive() and time.monotonic() < deadline, outcome
        time.sleep(0.2)
    stopped_at = time.monotonic()
    stop.request("the flow run was cancelled")
    thread.join(60)
    assert not thread.is_alive(), "the training did not stop within 60 s"
    assert isinstance(outcome[0], TrainingStopped) and "cancelled" in str(outcome[0]), outcome
    actors = [pid for pid in pids.values() if pid > 0]
    while any(_alive(pid) for pid in actors) and time.monotonic() - stopped_at < 60:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in actors), pids

    resumed = run_training(run_dir, _config(tiny_base, use_ray=False), log=lambda m: None)
    assert resumed["resumed_from"] >= 2 and resumed["last_step"] == STEPS
    rows = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(1, STEPS + 1))
