"""Screenshots of the Prefect UI taken by headless Chromium: the report artifact and the run graph of a
`v4rl demo` run. This is a documented script, not a pytest test, because it needs Debian's `chromium` package
and a few minutes. tests/test_prefect_ui_screenshot.py runs it on single pages.

    apt-get update && apt-get install -y chromium
    .venv/bin/python tests/prefect_ui_screenshot.py     # docs/prefect-ui-report.png, docs/prefect-ui-run-graph.png
    .venv/bin/python tests/prefect_ui_screenshot.py --port 4300 --page /runs --out /tmp/runs.png   # one page, no demo
    .venv/bin/python tests/prefect_ui_screenshot.py --server http://127.0.0.1:4200 --page /runs --out /tmp/runs.png

Without `--server` it starts a Prefect server with its UI on 127.0.0.1:`--port` (default: a free port), using a
temporary PREFECT_HOME. With no `--page` it then runs `v4rl demo --steps N` against that server, finds the run's
`demo-report` artifact and its flow run, shoots both pages, and stops the server.

Why the server gets PREFECT_SERVER_API_PORT: `prefect server start --port P` serves on P, but the UI asks
`/ui-settings` which API to call, and that answer comes from settings, not from `--port`: PREFECT_UI_API_URL,
else PREFECT_API_URL, else http://PREFECT_SERVER_API_HOST:PREFECT_SERVER_API_PORT/api, whose port defaults to
4200 (prefect/settings/models/root.py). Without the setting, the page reads "Can't connect to Server API at
http://127.0.0.1:4200/api".

A page that shows an error fails the script with one line that names the page and the error. Each shot is
checked twice before it is taken: `/ui-settings` `api_url` must be the server being shot, and the DOM that
Chromium renders (`--dump-dom`) must hold the page's expected text and none of the UI's error texts. Chromium
runs with background networking, sync and component updates off, so nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.prefect_server import QUIET_ENV, free_port, stop_process, wait_for  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--virtual-time-budget=15000"]
# What the Prefect UI (v1 and v2 bundles of 3.9.1) shows when a page did not load: the API is unreachable,
# a request failed, or the route does not exist.
ERROR_TEXTS = ("Can't connect to Server API", "Something went wrong", "Page Not Found", "Page not found")


class PageError(RuntimeError):
    """A page that must not be shot: an error page, the wrong API, or a page without its expected content."""


def chromium_binary() -> str | None:
    """Debian's `chromium` (or a `chromium-browser` / `google-chrome` on PATH); None when there is none."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def check_ui_settings(base: str) -> None:
    """The UI of `base` must call `base`'s own API; otherwise every page it renders is an error page."""
    with urllib.request.urlopen(f"{base}/ui-settings", timeout=30) as resp:
        api_url = json.load(resp)["api_url"]
    if api_url.rstrip("/") != f"{base}/api":
        raise PageError(f"{base}/ui-settings tells the UI to call {api_url}, not {base}/api: start the server with "
                        f"PREFECT_SERVER_API_PORT (and PREFECT_SERVER_API_HOST) matching --port/--host, or with "
                        f"PREFECT_UI_API_URL={base}/api")


def page_text(chromium: str, url: str, profile: Path, window: str) -> str:
    """The visible text of `url` once the UI has rendered it (Chromium's DOM, scripts and styles removed)."""
    proc = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--window-size={window}", f"--user-data-dir={profile}",
                           "--dump-dom", url], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise PageError(f"chromium --dump-dom {url} exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    dom = re.sub(r"<(script|style)\b.*?</\1>", " ", proc.stdout, flags=re.S | re.I)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", dom))).strip()


def check_page(url: str, text: str, expect: list[str]) -> None:
    """Raises PageError when the rendered `text` of `url` shows an error or lacks any of `expect`."""
    errors = [e for e in ERROR_TEXTS if e in text]
    if errors:
        raise PageError(f"{url} shows an error page ({errors[0]!r}): {text[:300]}")
    missing = [e for e in expect if e not in text]
    if missing:
        raise PageError(f"{url} does not show {missing} (the page did not render its content): {text[:300]}")


def shoot(chromium: str, base: str, path: str, out: Path, expect: list[str], profile: Path,
          window: str = "1400,2200") -> None:
    """Screenshot of `base + path` into `out`, only after the page proved to show `expect` and no error."""
    url = base + path
    check_ui_settings(base)
    check_page(url, page_text(chromium, url, profile, window), expect)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.stem}.tmp.png")  # chromium writes PNGs only; renamed when complete
    proc = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--window-size={window}", f"--user-data-dir={profile}",
                           f"--screenshot={tmp}", url], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 or not tmp.is_file() or tmp.stat().st_size == 0:
        tmp.unlink(missing_ok=True)
        raise PageError(f"chromium --screenshot {url} exited {proc.returncode} without a PNG: "
                        f"{proc.stderr.strip()[-500:]}")
    os.replace(tmp, out)
    print(f"wrote {out} ({url})")


def start_server(port: int, home: Path, log: Path) -> subprocess.Popen:
    """`prefect server start` with its UI on 127.0.0.1:port, told that its API is on that port (see above)."""
    env = {**os.environ, **QUIET_ENV, "PREFECT_HOME": str(home), "PREFECT_SERVER_API_HOST": "127.0.0.1",
           "PREFECT_SERVER_API_PORT": str(port)}
    for name in ("PREFECT_API_URL", "PREFECT_UI_API_URL", "PREFECT_SERVER_UI_API_URL"):
        env.pop(name, None)  # these would win over the port (and may name another server)
    with open(log, "w") as sink:
        return subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                 "--port", str(port)], env=env, stdout=sink, stderr=subprocess.STDOUT)


def demo_pages(base: str, home: Path, steps: int) -> tuple[str, str, str]:
    """Runs `v4rl demo` against `base`; returns the demo-report artifact id, its flow run id and name."""
    # INFO, unlike the tests' quiet WARNING: the run page shows the run's logs under its graph
    env = {**os.environ, **QUIET_ENV, "PREFECT_HOME": str(home), "PREFECT_API_URL": f"{base}/api",
           "PREFECT_LOGGING_LEVEL": "INFO"}
    subprocess.run([sys.executable, "-m", "v4rl.cli", "demo", "--workdir", str(home.parent / "runs"), "--steps",
                    str(steps)], env=env, check=True, cwd=REPO, timeout=3600)
    query = ("import json\nfrom prefect import get_client\nwith get_client(sync_client=True) as c:\n"
             "    a = next(a for a in c.read_artifacts() if a.key == 'demo-report')\n"
             "    print(json.dumps([str(a.id), str(a.flow_run_id), c.read_flow_run(a.flow_run_id).name]))")
    out = subprocess.run([sys.executable, "-c", query], env=env, check=True, capture_output=True, text=True).stdout
    artifact_id, flow_run_id, flow_run_name = json.loads(out.strip().splitlines()[-1])
    return artifact_id, flow_run_id, flow_run_name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "prefect-ui-report.png",
                        help="PNG of the report artifact (of --page when given)")
    parser.add_argument("--graph-out", type=Path, default=REPO / "docs" / "prefect-ui-run-graph.png",
                        help="PNG of the demo run's page with its run graph")
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps of the demo run")
    parser.add_argument("--port", type=int, default=0, help="port of the server this script starts (0: a free one)")
    parser.add_argument("--server", default="", help="shoot this running server (http://127.0.0.1:PORT) instead")
    parser.add_argument("--page", default="", help="shoot only this path (e.g. /runs), no demo run")
    parser.add_argument("--expect", action="append", default=[], help="text --page must show (repeatable)")
    args = parser.parse_args(argv)
    chromium = chromium_binary()
    if chromium is None:
        print("no chromium on PATH: apt-get update && apt-get install -y chromium", file=sys.stderr)
        return 2
    if args.server and not args.page:
        print("--server needs --page: the demo run goes to a server this script starts", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="v4rl-ui-") as tmp:
        tmp_path = Path(tmp)
        server = None
        try:
            if args.server:
                base = args.server.rstrip("/")
            else:
                port = args.port or free_port()
                base = f"http://127.0.0.1:{port}"
                server = start_server(port, tmp_path / "home", tmp_path / "server.log")
                try:
                    wait_for(f"{base}/api/health", timeout=300, proc=server)
                except (RuntimeError, TimeoutError) as exc:
                    log = (tmp_path / "server.log").read_text(errors="replace")[-1500:]
                    raise PageError(f"the Prefect server on port {port} did not start ({exc}); its log:\n{log}") \
                        from None
            if args.page:
                shoot(chromium, base, args.page, args.out, args.expect, tmp_path / "chromium", window="1400,1000")
                return 0
            artifact_id, flow_run_id, flow_run_name = demo_pages(base, tmp_path / "home", args.steps)
            shoot(chromium, base, f"/artifacts/artifact/{artifact_id}", args.out, ["demo-report", "rl-pipeline"],
                  tmp_path / "chromium")
            shoot(chromium, base, f"/runs/flow-run/{flow_run_id}", args.graph_out, [flow_run_name, "Completed"],
                  tmp_path / "chromium", window="1400,1000")
            return 0
        except PageError as exc:
            print(f"prefect_ui_screenshot: {exc}", file=sys.stderr)
            return 1
        except subprocess.CalledProcessError as exc:
            cmd = " ".join(map(str, exc.cmd))[:200]
            print(f"prefect_ui_screenshot: `{cmd}` exited {exc.returncode}: {(exc.stderr or '(output above)')[-800:]}",
                  file=sys.stderr)
            return 1
        finally:
            if server is not None:
                stop_process(server)


if __name__ == "__main__":
    sys.exit(main())
