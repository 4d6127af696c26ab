"""Ray for a run: a loopback-only local cluster by default (or `RAY_ADDRESS` to join one), a placement group
that holds the rollout worker and the trainer, and actors named per run so that a retried task reattaches
to live ones (or recreates dead ones). Every remote call goes through `call()`, which has a timeout.

    with ray_session() as info:
        actors = RunActors.create(run_key, base_dir=..., ...)
        url = call(actors.rollout.url, timeout=60)
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

LOCAL_RAY_ENV = {
    # One machine, everything on 127.0.0.1 (without this Ray binds and dials the machine's external address).
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "OMP_WAIT_POLICY": "PASSIVE",
}
DEFAULT_CALL_TIMEOUT_S = 600.0
log = logging.getLogger(__name__)


class RemoteCallTimeout(TimeoutError):
    pass


class _NoThreadSigtermWarning(logging.Filter):
    """Drops ray.init's "SIGTERM handler is not set ... not the main thread" warning. The rl-pipeline starts Ray
    from its training thread on purpose; SIGTERM reaches the flow's main thread, which stops the training through
    engines/runs/stopping.py (actors killed, `ray.shutdown` here), so Ray's own handler is not needed."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


_NO_THREAD_SIGTERM_WARNING = _NoThreadSigtermWarning()


@contextlib.contextmanager
def ray_session(num_cpus: int | None = None) -> Iterator[dict[str, Any]]:
    """Connect to RAY_ADDRESS if set, else start a loopback-only local cluster; shut down what we started."""
    address = os.environ.get("RAY_ADDRESS")
    if not address:  # before `import ray`: ray_constants reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER at import
        os.environ.update({k: os.environ.get(k, v) for k, v in LOCAL_RAY_ENV.items()})
    import ray

    if ray.is_initialized():
        yield {"address": "existing", "started": False}
        return
    logging.getLogger("ray._private.worker").addFilter(_NO_THREAD_SIGTERM_WARNING)  # adding it again is a no-op
    if address:
        with _keep_sigterm_handler():
            ray.init(address=address, namespace="v4rl", log_to_driver=True)
        started = False
    else:
        # The local raylet, and every worker it starts, inherits this process's environment: LOCAL_RAY_ENV (set
        # above) and the repo on PYTHONPATH reach the actors without a runtime_env, which starts each worker
        # through Ray's setup_worker (a second interpreter start: 0.7 CPU-s and 0.6 s more per actor, measured).
        os.environ["PYTHONPATH"] = _pythonpath()
        with _keep_sigterm_handler():
            ray.init(num_cpus=num_cpus or os.cpu_count(), namespace="v4rl", include_dashboard=False,
                     _node_ip_address="127.0.0.1", log_to_driver=True)
        started = True
    try:
        yield {"address": address or "local", "started": started}
    finally:
        if started:
            ray.shutdown()


@contextlib.contextmanager
def _keep_sigterm_handler() -> Iterator[None]:
    """A SIGTERM handler the caller set in Python (`v4rl train`: stop as on Ctrl-C, engines/runs/stopping.py) is
    put back after ray.init, which replaces it with its driver's: a C++ stack dump, then abort (exit 134)."""
    previous = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    try:
        yield
    finally:
        if callable(previous):
            signal.signal(signal.SIGTERM, previous)


def _pythonpath() -> str:
    """PYTHONPATH with the repo root first (once, however often a run starts a local cluster)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
    return os.pathsep.join([root, *rest])


def call(method, *args, timeout: float = DEFAULT_CALL_TIMEOUT_S, what: str | None = None, **kwargs):
    """`ray.get(actor.method.remote(...), timeout=...)` with an error that names the call when it times out."""
    import ray
    from ray.exceptions import GetTimeoutError

    ref = method.remote(*args, **kwargs)
    try:
        return ray.get(ref, timeout=timeout)
    except GetTimeoutError as exc:
        ray.cancel(ref, force=True)
        raise RemoteCallTimeout(f"{what or method} did not finish within {timeout:.0f}s; the actor may be hung "
                                "(see its log above); the task can be retried and resumes from the last checkpoint") from exc


@dataclass
class RunActors:
    trainer: Any
    rollout: Any
    placement_group: Any

    @classmethod
    def create(cls, run_key: str, *, trainer_args: dict, rollout_args: dict, trainer_cpus: float = 1.0,
               rollout_cpus: float = 1.0, timeout: float = 300.0) -> "RunActors":
        """Named actors `v4rl-<run_key>-{trainer,rollout}` in one placement group; reattach when alive."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from engines.train.actors import RolloutWorker, TrainerWorker

        names = {"trainer": f"v4rl-{run_key}-trainer", "rollout": f"v4rl-{run_key}-rollout"}
        existing = {k: _live_actor(n) for k, n in names.items()}
        if all(existing.values()):
            return cls(existing["trainer"], existing["rollout"], None)
        for actor in existing.values():  # a half-alive pair is recreated whole: state must match
            if actor is not None:
                ray.kill(actor)
        pg = placement_group([{"CPU": rollout_cpus}, {"CPU": trainer_cpus}], strategy="PACK",
                             name=f"v4rl-{run_key}")
        if not pg.wait(timeout_seconds=int(timeout)):
            raise RemoteCallTimeout(f"placement group for run {run_key} (rollout {rollout_cpus} CPU + trainer "
                                    f"{trainer_cpus} CPU) was not scheduled within {timeout:.0f}s; "
                                    "the cluster lacks the resources")
        rollout = ray.remote(started_by_call(RolloutWorker)).options(
            name=names["rollout"], num_cpus=rollout_cpus, max_concurrency=4, lifetime="detached",
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
        ).remote()
        trainer = ray.remote(started_by_call(TrainerWorker)).options(
            name=names["trainer"], num_cpus=trainer_cpus, lifetime="detached",
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=1),
        ).remote()
        try:
            call(rollout.start, timeout=timeout, what="starting the rollout worker", **rollout_args)
            call(trainer.start, timeout=timeout, what="starting the trainer", **trainer_args)
        except BaseException:  # nothing half-started stays behind, detached, for a later run to reattach to
            for actor in (trainer, rollout):
                ray.kill(actor)
            remove_placement_group(pg)
            raise
        return cls(trainer, rollout, pg)

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            call(self.rollout.stop, timeout=60, what="stopping the rollout worker")
        except Exception as exc:  # a dead or hung worker is killed below either way; say why it did not stop
            log.warning("rollout worker did not stop cleanly (%s); killing it", exc)
        for actor in (self.trainer, self.rollout):
            ray.kill(actor)
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)


def started_by_call(worker: type) -> type:
    """`worker` as an actor class whose constructor runs in its first call, `start(**kwargs)`, instead of at
    creation. A constructor that raises (a damaged checkpoint, a bad setting) then fails that call like any method:
    the driver gets the exception itself (RayTaskError carrying, say, the CheckpointError) and reports it in one
    line. Raised at creation, it killed the actor: the driver got an ActorDiedError holding only the text of the
    remote traceback, and the pair's other, detached actor stayed alive."""

    class Started(worker):
        def __init__(self) -> None:  # the real constructor waits for start()
            self._started = False

        def start(self, **kwargs: Any) -> int:
            worker.__init__(self, **kwargs)
            self._started = True
            return os.getpid()

        def ping(self) -> int:  # a live actor whose start never ran is not reattached (_live_actor recreates it)
            if not self._started:
                raise RuntimeError(f"{worker.__name__} was created but never started")
            return worker.ping(self)

    Started.__name__ = Started.__qualname__ = worker.__name__
    return Started


def _live_actor(name: str):
    import ray

    try:
        actor = ray.get_actor(name)
    except ValueError:
        return None
    try:
        ray.get(actor.ping.remote(), timeout=30)
    except Exception as exc:  # a dead or unreachable actor is recreated rather than reattached
        log.warning("actor %s did not answer (%s); recreating it", name, exc)
        ray.kill(actor)
        return None
    return actor
