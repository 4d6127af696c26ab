"""setup.sh asks for the CPU build of torch by its local version (torch==2.13.0+cpu): from the machine's own wheels
or index when they have it, else from PyTorch's CPU index, never a plain `torch==2.13.0` that a machine whose default
index serves CUDA wheels would answer with gigabytes; V4RL_TORCH_SPEC replaces it for GPU users.

setup.sh runs against a recording stand-in of .venv/bin/python (no pip, no network): the test reads which installs
it asked for. About 1 s.

    .venv/bin/python -m pytest tests/test_setup_script.py -q
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

# A python that has no torch, records every `-m pip` call, and fails the installs named in $FAIL_SPECS.
FAKE_PYTHON = r"""#!/usr/bin/env bash
if [ "$1" = "-c" ]; then exit 1; fi
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  echo "${*:3}" >> "$CALLS"
  for spec in $FAIL_SPECS; do
    if [ "${*: -1}" = "$spec" ] && [[ "$*" != *--index-url* ]]; then exit 1; fi
  done
  exit 0
fi
exit 0
"""


def _run_setup(tmp_path: Path, **env: str) -> list[str]:
    for name in ("setup.sh", "pyproject.toml"):
        shutil.copy(REPO / name, tmp_path / name)
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    calls = tmp_path / "calls.txt"
    done = subprocess.run(["bash", str(tmp_path / "setup.sh")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "CALLS": str(calls), **env})
    assert done.returncode == 0, done.stdout + done.stderr
    return [line for line in calls.read_text().splitlines() if "torch" in line and "-e" not in line.split()]


def test_the_cpu_build_comes_from_the_machine_when_it_has_it(tmp_path):
    assert _run_setup(tmp_path, FAIL_SPECS="") == ["install -q torch==2.13.0+cpu"]


def test_else_from_pytorchs_cpu_index_never_a_plain_torch(tmp_path):
    calls = _run_setup(tmp_path, FAIL_SPECS="torch==2.13.0+cpu")
    assert calls == ["install -q torch==2.13.0+cpu", f"install -q --index-url {CPU_INDEX} torch==2.13.0+cpu"]


@pytest.mark.parametrize("spec", ["torch>=2.9"])
def test_a_gpu_user_brings_their_own_build(tmp_path, spec):
    assert _run_setup(tmp_path, FAIL_SPECS="", V4RL_TORCH_SPEC=spec) == [f"install -q {spec}"]
