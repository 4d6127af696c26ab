"""A local Ray head with logical GPUs, owned by one rehearsal: started as a child (`ray start --head --block`, in
its own process group) so that stopping the rehearsal stops exactly this Ray session (its gcs, raylet and
workers) and nothing else on the machine, never a machine-wide `ray stop`.

With `jobs_api=True` the head also serves Ray's Jobs API (its dashboard) on 127.0.0.1, at `jobs_address`: what
`ray job submit` talks to on a cluster. Every port of the session is then a free one picked here (the dashboard,
its agent's HTTP and gRPC ports, the metrics export, the runtime-env agent, the Ray client server): Ray's fixed
defaults (52365, 8265, ...) collide with any other Ray on the machine, and its agent then never registers, so a
submit fails with "No available agent to submit job".

    ray = RaySession(work / "ray", port=free_port(0, "ray"), num_gpus=2, num_cpus=4, env=env, log=work / "ray.log",
                     jobs_api=True)
    ray.jobs_address   # http://127.0.0.1:<port>
    ray.stop()"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from engines.train.cluster import LOCAL_RAY_ENV

if TYPE_CHECKING:
    from engines.profiles.site import Site

START_TIMEOUT_S = 120.0
RAY_CLI = Path(sys.executable).with_name("ray")
"""This interpreter's `ray` (the venv's): the one whose Ray the rehearsal's processes import."""
JOBS_API_PORT_FLAGS = ("--dashboard-port", "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
                       "--metrics-export-port", "--runtime-env-agent-port", "--ray-client-server-port")
"""The ports a head with the Jobs API opens besides --port, each given a free one (the first: the Jobs API's)."""


def _free_ports(n: int) -> list[int]:
    """n distinct ports free on 127.0.0.1 now (held together while picked, so none is picked twice)."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class RaySession:
    def __init__(self, temp_dir: Path, *, port: int, num_gpus: int, num_cpus: int, env: dict[str, str],
                 log: Path, jobs_api: bool = False, cwd: Path | None = None) -> None:
        self.address = f"127.0.0.1:{port}"
        self.jobs_address: str | None = None
        """http://127.0.0.1:<port> of the head's Jobs API (jobs_api=True), else None."""
        cmd = [str(RAY_CLI), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
               "--num-gpus", str(num_gpus), "--num-cpus", str(num_cpus), "--temp-dir", str(temp_dir),
               "--disable-usage-stats"]
        if jobs_api:
            ports = _free_ports(len(JOBS_API_PORT_FLAGS))
            cmd += ["--include-dashboard", "true", "--dashboard-host", "127.0.0.1"]
            cmd += [item for flag, free in zip(JOBS_API_PORT_FLAGS, ports) for item in (flag, str(free))]
            self.jobs_address = f"http://127.0.0.1:{ports[0]}"
        else:
            cmd += ["--include-dashboard", "false"]
        self._log = log.open("w")
        # The head gets the local cluster's settings, as Miles' driver does (run.py _stage_env), token auth disabled
        # among them: Ray 2.60's `ray.init()` leaves a ~/.ray/auth_token, from which a `ray start` turns token auth
        # on, and then no driver of ours could connect ("InvalidAuthToken").
        # cwd: where a submitted job's driver runs (Ray's job supervisor starts it in the head's directory)
        self.process = subprocess.Popen(cmd, env={**os.environ, **env, **LOCAL_RAY_ENV}, stdout=self._log,
                                        stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd)
        try:
            self._wait_ready(log)
        except BaseException:  # it did not come up, or the rehearsal was interrupted (Ctrl-C): nothing stays up
            self.stop()
            raise

    def _wait_ready(self, log: Path) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if "Ray runtime started" in log.read_text(errors="replace") and self._jobs_api_ready():
                return
            if self.process.poll() is not None:
                tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
                raise RuntimeError(f"`ray start` exited with {self.process.returncode}: {tail[0]}")
            time.sleep(0.5)
        what = "Ray" if self.jobs_address is None else "Ray with its Jobs API (the dashboard's agent registered)"
        raise TimeoutError(f"{what} did not start within {START_TIMEOUT_S:.0f}s (log: {log})")

    def site(self) -> "Site":
        """The cluster path's Site for this head's Jobs API: this venv's `ray` and interpreter, rendezvous and every
        interface on loopback (what Site.require asks of a GPU profile, satisfied for a machine without a fabric)."""
        from engines.profiles.site import Site

        if self.jobs_address is None:
            raise RuntimeError("this Ray session was started without its Jobs API (jobs_api=True)")
        return Site(ray_address=self.jobs_address, master_addr="127.0.0.1", socket_ifname="lo", ib_hca="none",
                    python=sys.executable, ray_cli=str(RAY_CLI))

    def _jobs_api_ready(self) -> bool:
        """True without a Jobs API; else once the dashboard answers and its agent has registered in the GCS (what
        the Jobs API looks up, for 10 s, before it refuses a submit: "No available agent to submit job")."""
        if self.jobs_address is None:
            return True
        from ray._private.ray_constants import KV_NAMESPACE_DASHBOARD
        from ray._raylet import GcsClient
        from ray.dashboard.consts import DASHBOARD_AGENT_ADDR_NODE_ID_PREFIX

        try:
            with urllib.request.urlopen(f"{self.jobs_address}/api/version", timeout=2):
                pass
            gcs = GcsClient(address=self.address)
            return bool(gcs.internal_kv_keys(DASHBOARD_AGENT_ADDR_NODE_ID_PREFIX.encode(),
                                             namespace=KV_NAMESPACE_DASHBOARD, timeout=5))
        except Exception:  # not up yet (connection refused, a GCS RPC timeout): the wait goes on, bounded
            return False

    def stop(self) -> None:
        """SIGTERM to `ray start --block`, whose own shutdown stops its gcs, raylet and workers (about 2 s; a SIGTERM
        to its whole group left it waiting on them until the SIGKILL, 15 s later), then SIGKILL to whatever of its
        process group is left."""
        self.process.send_signal(signal.SIGTERM)  # a no-op once it has exited and been waited for
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()
