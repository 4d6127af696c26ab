"""A non-editable install ships what the library reads at run time: the tiny base checkpoint the embedded
default starts from (engines.TINY_BASE), the C sources and headers the fused kernels build from, the sample data.

Builds the wheel once (pip, no dependencies, no network: setuptools comes from the venv) and reads its file list.

    .venv/bin/python -m pytest tests/test_packaging.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from engines import TINY_BASE

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory) -> set[str]:
    out = tmp_path_factory.mktemp("wheel")
    build = tmp_path_factory.mktemp("build")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", str(REPO), "--no-deps", "--no-build-isolation",
                           "-w", str(out)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TMPDIR": str(build)}, cwd=build)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = out.glob("v4rl-*.whl")
    return set(zipfile.ZipFile(wheel).namelist())


def test_the_wheel_ships_the_tiny_base_checkpoint(wheel_files):
    committed = sorted(p.name for p in TINY_BASE.iterdir() if p.is_file())
    assert "model-00001-of-00001.safetensors" in committed and "config.json" in committed
    missing = [name for name in committed if f"engines/tiny_base/{name}" not in wheel_files]
    assert not missing, f"engines/tiny_base files a non-editable install would lack: {missing}"


def test_the_wheel_ships_the_kernel_sources(wheel_files):
    sources = sorted(str(p.relative_to(REPO)) for p in (REPO / "engines" / "model").glob("*.[ch]"))
    assert any(s.endswith(".h") for s in sources)
    missing = [s for s in sources if s not in wheel_files]
    assert not missing, f"kernel sources a non-editable install would lack: {missing}"


def test_the_wheel_ships_the_sample_data(wheel_files):
    """rl/sample_math.jsonl, the rows in the tiny base's wording that `v4rl train --train-data` learns on."""
    from rl.datasets import SAMPLE_DATA

    assert f"rl/{SAMPLE_DATA.name}" in wheel_files
