"""Drives one of Miles' own launchers in recording mode and prints what it would have run, as one JSON line.

Miles' recording approach (its tests/fast/utils/command_recorder.py and launch_scripts/py_harness.py): the
command helpers of `miles.utils.external_utils.command_utils` become recorders, `subprocess.run` and
`time.sleep` do nothing, the filesystem outside the checkout looks empty (so no "already converted" skip
depends on this machine), and the launcher's typer `app` is called with a real argv. `ray` is stubbed (the
PR-head launcher calls Ray to copy checkpoints between nodes; that helper is recorded too). Nothing is
executed. Never imported by v4rl; engines/upstream/miles_launcher_compare.py runs it in a subprocess with the Miles
tree and typer 0.25.1 / click 8.2.1 (Miles' Dockerfile.rocm pins) first on sys.path.

Request (JSON file): {"miles_dir", "launcher", "argv", "env", "run_id"}. Answer after the marker line:
{"exit_code", "error", "rejected": [options typer refused], "commands": [...], "submit": {...} | null}.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

MARKER = "=== v4rl launcher recording ==="
# Launcher knobs read from the environment that must not leak in from the machine running the recording
CLEARED_ENV = ("CUDA_VISIBLE_DEVICES", "GITHUB_COMMIT_NAME", "GLOO_SOCKET_IFNAME", "MILES_SCRIPT_EXTERNAL_RAY",
               "MODEL_ARGS_NUM_LAYERS", "NCCL_DEBUG", "NCCL_DEBUG_FILE", "NCCL_NVLS_ENABLE", "NCCL_SOCKET_IFNAME",
               "NO_PROXY", "no_proxy", "RAY_ADDRESS", "ROTARY_SCALING_FACTOR", "SLURM_JOB_NUM_NODES", "WANDB_API_KEY",
               "TP_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_IB_GID_INDEX", "PYTHONPATH")


def _install_recorders(commands: list[str], run_id: str, sandbox: Path) -> None:
    import miles.utils.external_utils.command_utils as U

    def record(cmd, capture_output=False, **kwargs):
        commands.append(cmd if isinstance(cmd, str) else " ".join(cmd))
        return "0" if capture_output else None

    def record_multi(cmd, capture_output=False, num_nodes=None, **kwargs):
        commands.append(f"[multi_node num_nodes={num_nodes}] {cmd}")
        return ["0"]

    for name in dir(U):
        if name.startswith("exec_command"):
            setattr(U, name, record_multi if ("multi" in name or "all_ray" in name) else record)
    U.create_run_id = lambda: run_id

    def fake_run(command, *args, **kwargs):
        commands.append(command if isinstance(command, str) else " ".join(map(str, command)))
        return subprocess.CompletedProcess(args=command, returncode=0, stdout="0", stderr="")

    subprocess.run = fake_run
    time.sleep = lambda seconds: None
    real_exists = Path.exists
    visible = (sandbox, Path(os.environ["V4RL_MILES_TREE"]))

    def exists(self: Path, **kwargs) -> bool:  # only the checkout and the sandbox are visible
        return any(self == root or self.is_relative_to(root) for root in visible) and real_exists(self, **kwargs)

    Path.exists = exists


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _parse_submit(command: str) -> dict | None:
    """The `ray job submit` among the recorded commands: address, runtime env, script and train.py argv."""
    tokens = shlex.split(command)
    if "submit" not in tokens or "--" not in tokens:
        return None
    head, tail = tokens[:tokens.index("--")], tokens[tokens.index("--") + 1:]
    runtime = next((t.split("=", 1)[1] for t in head if t.startswith("--runtime-env-json=")), None)
    address = next((t.split("=", 1)[1] for t in head if t.startswith("--address=")), None)
    argv = tail[2:]
    first_flag = next((i for i, t in enumerate(argv) if t.startswith("--")), len(argv))
    # the PR-head splices `${MODEL_ARGS[@]}` (from a sourced .sh model script) before the flags
    return {"address": address, "env": json.loads(runtime)["env_vars"] if runtime else {},
            "python": tail[0], "script": tail[1], "spliced": argv[:first_flag], "argv": argv[first_flag:]}


def record(request: dict) -> dict:
    import click

    for key in CLEARED_ENV:
        os.environ.pop(key, None)
    os.environ.update(request["env"])
    miles = Path(request["miles_dir"])
    os.environ["V4RL_MILES_TREE"] = str(miles)
    sandbox = Path(request["sandbox"])
    stubs = sys.modules["engine_stubs"]
    sys.meta_path.insert(0, stubs.StubFinder(("ray",)))  # installed here, but the launcher must never reach it
    commands: list[str] = []
    _install_recorders(commands, request["run_id"], sandbox)
    launcher = _load(miles / request["launcher"], "miles_launcher_under_record")
    if hasattr(launcher, "_normalize_torch_dist_checkpoint"):  # PR-head: copies the release dir over Ray actors
        launcher._normalize_torch_dist_checkpoint = lambda path, nodes, **kw: commands.append(
            f"[ray] normalize_torch_dist_checkpoint {path} num_nodes={nodes} {kw}")
    argv, rejected, error, code = list(request["argv"]), [], "", 0
    for _ in range(64):  # click stops at the first unknown option: drop it and go on, to name them all
        commands.clear()
        try:
            launcher.app(argv, standalone_mode=False)
            code = 0
            break
        except click.NoSuchOption as exc:
            rejected.append(exc.option_name)
            i = argv.index(exc.option_name)
            has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            argv = argv[:i] + argv[i + 1 + has_value:]
            code, error = 2, f"No such option: {', '.join(rejected)}"
        except click.ClickException as exc:
            code, error = 2, exc.format_message()
            break
        except Exception as exc:  # the launcher itself refused (NotImplementedError: no preset for N GPUs)
            code, error = 1, f"{type(exc).__name__}: {exc}"
            break
    if rejected:  # typer's exit code for an unknown option, whatever else the launcher then did
        code = 2
    submits = [s for s in map(_parse_submit, commands) if s]
    return {"exit_code": code, "error": error, "rejected": rejected, "commands": commands,
            "submit": submits[-1] if submits else None}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        answer = record(json.load(f))
    print(MARKER)
    print(json.dumps(answer))
