"""A local Ray head with logical GPUs, owned by one rehearsal: started as a child (`ray start --head --block`, in
its own process group) so that stopping the rehearsal stops exactly this Ray session (its gcs, raylet and
workers) and nothing else on the machine, never a machine-wide `ray stop`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from engines.train.cluster import LOCAL_RAY_ENV

START_TIMEOUT_S = 120.0


class RaySession:
    def __init__(self, temp_dir: Path, *, port: int, num_gpus: int, num_cpus: int, env: dict[str, str],
                 log: Path) -> None:
        self.address = f"127.0.0.1:{port}"
        ray = Path(sys.executable).with_name("ray")
        cmd = [str(ray), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
               "--num-gpus", str(num_gpus), "--num-cpus", str(num_cpus), "--temp-dir", str(temp_dir),
               "--include-dashboard", "false", "--disable-usage-stats"]
        self._log = log.open("w")
        # The head gets the local cluster's settings, as Miles' driver does (run.py _stage_env), token auth disabled
        # among them: Ray 2.60's `ray.init()` leaves a ~/.ray/auth_token, from which a `ray start` turns token auth
        # on, and then no driver of ours could connect ("InvalidAuthToken").
        self.process = subprocess.Popen(cmd, env={**os.environ, **env, **LOCAL_RAY_ENV}, stdout=self._log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_ready(log)
        except BaseException:  # it did not come up, or the rehearsal was interrupted (Ctrl-C): nothing stays up
            self.stop()
            raise

    def _wait_ready(self, log: Path) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if "Ray runtime started" in log.read_text(errors="replace"):
                return
            if self.process.poll() is not None:
                tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
                raise RuntimeError(f"`ray start` exited with {self.process.returncode}: {tail[0]}")
            time.sleep(0.5)
        raise TimeoutError(f"Ray did not start within {START_TIMEOUT_S:.0f}s (log: {log})")

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
