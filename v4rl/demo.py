"""`v4rl demo`: the tiny-cpu rl-pipeline end to end under Prefect.

1. the tiny DeepSeek-V4 base checkpoint (FP8 + FP4 experts): the committed asset that
   `v4rl bootstrap --seed 0` reproduces byte for byte, or a fresh bootstrap with `--fresh`;
2. a local Prefect server on 127.0.0.1 (own PREFECT_HOME under the work dir) unless PREFECT_API_URL is set.
   It runs without its UI and stops when the demo ends, so the demo turns off Prefect's "View at <url>" links
   (PREFECT_UI_URL empty): they would point at a page that is gone. `--ui` serves the UI instead, prints live
   links and keeps the server up until Ctrl-C. To use your own server, start it and point the demo at it:
       .venv/bin/prefect server start --host 127.0.0.1 &            # UI at http://127.0.0.1:4200
       PREFECT_API_URL=http://127.0.0.1:4200/api .venv/bin/v4rl demo
3. the rl-pipeline flow: preflight, HF FP8 -> torch_dist conversion, megatron-core verification, alignment
   gate, GRPO segments on a loopback Ray cluster with evaluations, uploads, the report;
4. held-out pass@k before and after, each with its standard error over the problems (how much of a change is
   noise), where the report and artifacts are, and how to open the run in the Prefect UI.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from engines import TINY_BASE
from engines.presets.runs import SHORT_RUNS
from engines.runs.summary import pass_at_k_lines

ASSET = TINY_BASE
QUIET_ENV = {"DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
             "PREFECT_WORKER_WEBSERVER_HOST": "127.0.0.1", "RAY_USAGE_STATS_ENABLED": "0",
             "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def ui_hint_lines(home: Path) -> list[str]:
    """How to open the finished run in the Prefect UI: each command and the URL on a line of its own, the path
    quoted for the shell where it needs it (a space in the work dir)."""
    return ["", "Open the run in the Prefect UI (Runs -> rl-pipeline, Artifacts):",
            f"  PREFECT_HOME={shlex.quote(str(home))} .venv/bin/prefect server start --host 127.0.0.1",
            "  http://127.0.0.1:4200",
            "or run `v4rl demo --ui`, which keeps its server and UI up at the end"]


def print_unwrapped(console: Console, lines: list[str]) -> None:
    """Lines as they are: rich would wrap a long command or URL at the terminal width into pieces that do not
    work pasted (the terminal itself wraps them, and a copy of a wrapped line is still one line)."""
    for line in lines:
        console.print(line, soft_wrap=True, markup=False, highlight=False)


class DemoRefused(ValueError):
    """The demo cannot start as asked (a bad option, an unreachable PREFECT_API_URL, a busy work dir): one line that
    names the option or variable and the fix; nothing was started."""


DEMO_RUN = SHORT_RUNS["demo"]
"""The demo's run: the tiny-cpu preset with fewer steps, prompts and held-out problems (engines/presets/runs.py)."""
INTERRUPTED = 130
"""Exit status after Ctrl-C, as a shell reports a process ended by SIGINT."""


def run_demo(workdir: Path, *, seed: int = 0, fresh: bool = False, steps: int = DEMO_RUN["steps"],
             ui: bool = False) -> int:
    from engines.runs.run_lock import RunDirBusy, hold_run_dir

    console = Console()
    workdir = workdir.resolve()
    os.environ.update({k: os.environ.get(k, v) for k, v in QUIET_ENV.items()})
    # Everything the options can get wrong, before a checkpoint is bootstrapped or a server started
    _demo_params(workdir, ASSET, seed, steps)
    api = os.environ.get("PREFECT_API_URL")
    if api:
        _check_prefect_api(api)
    try:
        with hold_run_dir(workdir, log=console.print):
            return _run(workdir, seed=seed, fresh=fresh, steps=steps, ui=ui, console=console)
    except RunDirBusy as exc:
        raise DemoRefused(f"--workdir {exc}") from None


def _run(workdir: Path, *, seed: int, fresh: bool, steps: int, ui: bool, console: Console) -> int:
    base = _base_checkpoint(workdir, seed, fresh, console)
    params = _demo_params(workdir, base, seed, steps)
    server = home = None
    if not os.environ.get("PREFECT_API_URL"):
        server, home = _start_prefect(workdir / "prefect-home", console, ui=ui)
    try:
        from flows.rl_pipeline import rl_pipeline

        console.print(f"[bold]rl-pipeline[/] {steps} GRPO steps on tiny-cpu (run dir {params.run_dir})")
        try:
            result = rl_pipeline(params)
        except KeyboardInterrupt:  # Prefect marked the flow run Crashed and the training stopped on the way here
            _say_interrupted(console, params.run_dir, home)
            return INTERRUPTED
        summary = result["summary"]
        # soft_wrap: a path or a verdict is one line however narrow the terminal (rich would cut it at the width)
        console.print(f"\n[bold green]done[/]: report {params.run_dir / 'report.md'}, artifacts {params.store}",
                      soft_wrap=True)
        for line in pass_at_k_lines(params.run_dir):
            console.print(f"  {line}", soft_wrap=True)
        if "logprob_abs_diff_mean" in summary:
            console.print(f"  train/rollout |Δlogprob| mean {summary['logprob_abs_diff_mean']:.4f}")
        if server is not None and ui:
            url = os.environ["PREFECT_UI_URL"]
            print_unwrapped(console, ["", "Prefect UI (Runs -> rl-pipeline, Artifacts; up until you press Ctrl-C):",
                                      f"  {url}"])
            _serve_until_interrupted(server)
        elif server is not None:
            print_unwrapped(console, ui_hint_lines(home))
        return 0
    finally:
        if server is not None:
            _flush_prefect_workers()  # while the server still answers; at exit they would find it gone
            server.terminate()
            server.wait(timeout=30)


def _demo_params(workdir: Path, base: Path, seed: int, steps: int):
    """The demo's rl-pipeline parameters; a value they refuse is a DemoRefused naming the demo's option."""
    from pydantic import ValidationError

    from flows.params import PipelineParams

    try:
        # the demo's override of the tiny-cpu preset, evaluated halfway and at the end whatever --steps says
        return PipelineParams.preset_defaults("tiny-cpu", **{**DEMO_RUN, "steps": steps}, run_key="demo",
                                              runs_root=str(workdir), hf_checkpoint=str(base),
                                              eval_interval=max(1, steps // 2), seed=seed)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = str(error["loc"][0]) if error["loc"] else ""
        option = {"steps": "--steps", "seed": "--seed", "runs_root": "--workdir"}.get(field, field)
        message = error["msg"].removeprefix("Value error, ")
        raise DemoRefused(f"{option} {error.get('input')!r}: {message}" if option else message) from None


def _check_prefect_api(api: str) -> None:
    """PREFECT_API_URL must answer, or the flow fails after minutes with a long client traceback."""
    import urllib.request

    try:
        with urllib.request.urlopen(api.rstrip("/") + "/health", timeout=5):
            return
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise DemoRefused(f"PREFECT_API_URL={api}: no Prefect server answers there ({reason}); start it "
                          "(.venv/bin/prefect server start --host 127.0.0.1) or unset PREFECT_API_URL, and the demo "
                          "starts its own") from None


def _say_interrupted(console: Console, run_dir: Path, home: Path | None) -> None:
    from engines.runs.kept import kept_after_interrupt

    where = f"the demo's Prefect server (PREFECT_HOME={home})" if home else os.environ.get("PREFECT_API_URL")
    console.print(f"\n[yellow]interrupted[/]: the rl-pipeline flow run is marked Crashed in {where}; "
                  f"{kept_after_interrupt(run_dir)}", soft_wrap=True)  # one line: paths paste whole


def _serve_until_interrupted(server: subprocess.Popen) -> None:
    try:
        server.wait()
    except KeyboardInterrupt:
        pass


def _flush_prefect_workers() -> None:
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)
    EventsWorker.drain_all(timeout=10)


def _base_checkpoint(workdir: Path, seed: int, fresh: bool, console: Console) -> Path:
    if not fresh and seed == 0 and (ASSET / "bootstrap.json").exists():
        console.print(f"[bold]base checkpoint[/]: {ASSET} (committed; `v4rl bootstrap --out DIR --seed 0` rebuilds "
                      "it byte for byte; `v4rl demo --fresh` does that here)")
        return ASSET
    from engines.train.bootstrap import BootstrapConfig, bootstrap

    base = workdir / "base"
    if (base / "bootstrap.json").exists() and not fresh:
        return base
    console.print(f"[bold]base checkpoint[/]: bootstrapping the tiny model into {base}")
    bootstrap(base, BootstrapConfig(seed=seed), log=console.print)
    return base


def client_env(port: int, home: Path, *, ui: bool) -> dict[str, str]:
    """What the demo's own Prefect client needs for a server on 127.0.0.1:`port`. Without its UI (the server also
    stops with the demo) PREFECT_UI_URL is empty, which turns off Prefect's "View at <url>" links: they would
    point at a page that does not load."""
    return {"PREFECT_API_URL": f"http://127.0.0.1:{port}/api", "PREFECT_HOME": str(home),
            "PREFECT_UI_URL": f"http://127.0.0.1:{port}" if ui else ""}


def _start_prefect(home: Path, console: Console, *, ui: bool = False):
    import socket
    import time
    import urllib.request

    home.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    api = f"http://127.0.0.1:{port}/api"
    # With --port alone the UI still calls the API on 4200 (its /ui-settings api_url): tell it the real port
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_API_PORT": str(port), "PREFECT_UI_API_URL": api}
    log = open(home / "server.log", "a")  # noqa: SIM115 - owned by the server process
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                             str(port)] + ([] if ui else ["--no-ui"]), env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # Ctrl-C reaches the demo only: the server records the end
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the Prefect server exited with {proc.returncode}; see {home / 'server.log'}")
        try:
            with urllib.request.urlopen(api + "/health", timeout=2):
                break
        except OSError:
            time.sleep(0.5)
    else:
        proc.terminate()
        raise TimeoutError(f"the Prefect server on {api} did not answer within 120 s; see {home / 'server.log'}")
    os.environ.update(client_env(port, home, ui=ui))
    console.print(f"[bold]Prefect[/]: local server {api} (PREFECT_HOME={home}, pid {proc.pid})")
    return proc, home
