"""`v4rl demo`: the tiny-cpu rl-pipeline end to end under Prefect.

1. the tiny DeepSeek-V4 base checkpoint (FP8 + FP4 experts): the committed asset that
   `v4rl bootstrap --seed 0` reproduces byte for byte, or a fresh bootstrap with `--fresh`;
2. a local Prefect server on 127.0.0.1 (own PREFECT_HOME under the work dir) unless PREFECT_API_URL is set;
3. the rl-pipeline flow: preflight, HF FP8 -> torch_dist conversion, megatron-core verification, alignment
   gate, GRPO segments on a loopback Ray cluster with evaluations, uploads, the report;
4. where the report and artifacts are, and how to open the run in the Prefect UI.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rich.console import Console

ASSET = Path(__file__).resolve().parent.parent / "tests" / "assets" / "tiny-base"
QUIET_ENV = {"DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
             "PREFECT_WORKER_WEBSERVER_HOST": "127.0.0.1", "RAY_USAGE_STATS_ENABLED": "0",
             "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def run_demo(workdir: Path, *, seed: int = 0, fresh: bool = False, steps: int = 10) -> int:
    console = Console()
    workdir = workdir.resolve()
    os.environ.update({k: os.environ.get(k, v) for k, v in QUIET_ENV.items()})
    base = _base_checkpoint(workdir, seed, fresh, console)
    server = None
    if not os.environ.get("PREFECT_API_URL"):
        server, home = _start_prefect(workdir / "prefect-home", console)
    try:
        from flows.params import PipelineParams
        from flows.rl_pipeline import rl_pipeline

        params = PipelineParams.preset_defaults("tiny-cpu", run_key="demo", runs_root=str(workdir),
                                                hf_checkpoint=str(base), steps=steps, eval_interval=max(1, steps // 2),
                                                prompts_per_step=32, n_eval=64, seed=seed)
        console.print(f"[bold]rl-pipeline[/] {steps} GRPO steps on tiny-cpu (run dir {params.run_dir})")
        result = rl_pipeline(params)
        summary = result["summary"]
        console.print(f"\n[bold green]done[/]: report {params.run_dir / 'report.md'}, artifacts {params.store}")
        for k in ("pass@1_first", "pass@1_last", "pass@8_first", "pass@8_last", "logprob_abs_diff_mean"):
            if k in summary:
                console.print(f"  {k}: {summary[k]:.3f}")
        if server is not None:
            console.print(f"\nOpen the run in the Prefect UI: PREFECT_HOME={home} .venv/bin/prefect server start "
                          "--host 127.0.0.1  then http://127.0.0.1:4200 (Runs -> rl-pipeline, Artifacts)")
        return 0
    finally:
        if server is not None:
            _flush_prefect_workers()  # while the server still answers; at exit they would find it gone
            server.terminate()
            server.wait(timeout=30)


def _flush_prefect_workers() -> None:
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)
    EventsWorker.drain_all()


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


def _start_prefect(home: Path, console: Console):
    import socket
    import time
    import urllib.request

    home.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PREFECT_HOME": str(home)}
    log = open(home / "server.log", "a")  # noqa: SIM115 - owned by the server process
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                             str(port), "--no-ui"], env=env, stdout=log, stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{port}/api"
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
    os.environ.update({"PREFECT_API_URL": api, "PREFECT_HOME": str(home)})
    console.print(f"[bold]Prefect[/]: local server {api} (PREFECT_HOME={home}, pid {proc.pid})")
    return proc, home
