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
