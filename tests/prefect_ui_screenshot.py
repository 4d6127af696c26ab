"""Screenshot of the rl-pipeline report artifact in the Prefect UI, taken by headless Chromium (a documented
script, not a pytest test: it needs Debian's `chromium` package and a few minutes).

    apt-get install -y chromium
    .venv/bin/python tests/prefect_ui_screenshot.py --out docs/prefect-ui-report.png

It starts a Prefect server with its UI on 127.0.0.1 (temporary PREFECT_HOME), runs `v4rl demo --steps 4`
against it, finds the run's `demo-report` artifact, renders its page with headless Chromium (background
networking off, so nothing leaves the machine), and stops the server.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.prefect_server import QUIET_ENV, free_port, wait_for  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1400,2200", "--virtual-time-budget=15000"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "prefect-ui-report.png")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="v4rl-ui-") as tmp:
        port = free_port()
        env = {**os.environ, **QUIET_ENV, "PREFECT_HOME": f"{tmp}/home"}
        env.pop("PREFECT_API_URL", None)
        server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                   "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            api = f"http://127.0.0.1:{port}/api"
            wait_for(api + "/health", timeout=120, proc=server)
            env["PREFECT_API_URL"] = api
            subprocess.run([sys.executable, "-m", "v4rl.cli", "demo", "--workdir", f"{tmp}/runs", "--steps",
                            str(args.steps)], env=env, check=True, cwd=REPO, timeout=3600)
            artifact_id = subprocess.run(
                [sys.executable, "-c", "from prefect import get_client\nwith get_client(sync_client=True) as c:\n"
                 "    print(next(a.id for a in c.read_artifacts() if a.key == 'demo-report'))"],
                env=env, check=True, capture_output=True, text=True).stdout.strip()
            args.out.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(["chromium", *CHROMIUM_FLAGS, f"--user-data-dir={tmp}/chromium",
                            f"--screenshot={args.out}", f"http://127.0.0.1:{port}/artifacts/artifact/{artifact_id}"],
                           check=True, timeout=120, capture_output=True)
        finally:
            server.terminate()
            server.wait(timeout=30)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
