"""engines/train/cluster.py `ray_session` started from a worker thread, as the rl-pipeline's training task does:
a loopback-only local Ray comes up, shuts down with the session, and prints no warning that does not apply.

    .venv/bin/python -m pytest tests/test_ray_session.py -q
"""

from __future__ import annotations

import threading


def test_ray_session_from_a_worker_thread_starts_stops_and_prints_no_sigterm_warning(capfd):
    import ray

    from engines.train.cluster import ray_session

    seen: dict = {}

    def train_thread() -> None:
        try:
            with ray_session(num_cpus=1) as info:
                seen["info"], seen["up"] = info, ray.is_initialized()
                seen["nodes"] = [n["NodeManagerAddress"] for n in ray.nodes()]
        except BaseException as exc:  # reported by the assertion below
            seen["error"] = exc

    thread = threading.Thread(target=train_thread)
    thread.start()
    thread.join(timeout=180)
    assert not thread.is_alive() and "error" not in seen, seen
    assert seen["info"] == {"address": "local", "started": True} and seen["up"] and not ray.is_initialized()
    assert seen["nodes"] == ["127.0.0.1"]
    output = capfd.readouterr()
    assert "SIGTERM handler is not set" not in output.out + output.err


def test_an_actor_whose_constructor_raises_is_one_error_and_no_remote_traceback(tmp_path, capfd):
    """RunActors starts each worker in a call (cluster.started_by_call): a constructor that raises (here the trainer
    on a checkpoint that is not there) fails that call with the library's own exception (it was an ActorDiedError
    holding the remote traceback's text), Ray prints no traceback, and nothing stays behind (the detached rollout
    actor did)."""
    import time

    import pytest
    import ray

    from engines import TINY_BASE
    from engines.rollout.api import EngineConfig
    from engines.train.cluster import RunActors, ray_session
    from engines.train.trainer import TrainerConfig
    from rl.grpo import GRPOConfig
    from v4rl.errors import one_line_error

    missing = tmp_path / "no-such-checkpoint"
    with ray_session(num_cpus=2):
        with pytest.raises(Exception) as failed:
            RunActors.create("init-error", rollout_args={"model_dir": str(TINY_BASE), "engine_config": EngineConfig()},
                             trainer_args={"base_dir": str(missing), "trainer_config": TrainerConfig(),
                                           "grpo_config": GRPOConfig(), "checkpoint_root": str(tmp_path / "ck")})
        time.sleep(2)  # Ray forwards actor output to the driver asynchronously
        left = [a for a in ray.util.list_named_actors(all_namespaces=True) if "init-error" in str(a)]
    from checkpoints.hf import CheckpointError
    from v4rl.errors import root_cause

    assert isinstance(root_cause(failed.value), CheckpointError), repr(failed.value)
    assert str(missing) in one_line_error(failed.value), one_line_error(failed.value)
    output = capfd.readouterr()
    assert "Traceback" not in output.out + output.err, (output.out + output.err)[-3000:]
    assert left == []
