"""The CPU-fit preflight: each CPU step's memory estimated from a checkpoint's config, refused (naming the step,
the estimate and the machine's memory) when it cannot fit, and bounding what the tiny model's steps really use.
NUM_GPUS = 0; about 20 s (one held-out evaluation measured in a subprocess).

    .venv/bin/python -m pytest tests/test_cpu_fit.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engines.layout import dsv4_flash_shape, tiny_cpu_shape, total_params
from engines.layout.cpu_fit import CPU_STEPS, GB, CpuFitError, ModelBytes, check_cpu_fit, machine_memory_bytes, step_memory

REPO = Path(__file__).resolve().parent.parent


def test_flash_fits_convert_and_verify_but_not_cpu_align_on_this_machine():
    memory = 24 * 10 ** 9
    flash = ModelBytes.of(dsv4_flash_shape())
    assert flash.params == total_params(dsv4_flash_shape()) and 280e9 < flash.params < 290e9
    assert 150 * GB < flash.stored < 165 * GB < ModelBytes.of(dsv4_flash_shape(), expert_dtype="fp8").stored
    fits = check_cpu_fit(dsv4_flash_shape(), ("convert", "verify"), memory_bytes=memory, workers=2)
    assert [s.step for s in fits] == ["convert", "verify"] and all(s.bytes < memory for s in fits)
    with pytest.raises(CpuFitError) as err:
        check_cpu_fit(dsv4_flash_shape(), CPU_STEPS, memory_bytes=memory, workers=2)
    message = str(err.value)
    assert "CPU step 'cpu-align' needs ~3,569" in message and "this machine has 24.0 GB" in message
    assert "trainer fp32 master weights 1,137.3 GB" in message and "alignment gate on the cluster" in message
    with pytest.raises(CpuFitError, match="conversion workers"):  # 16 workers each holding the 4 GB embedding
        check_cpu_fit(dsv4_flash_shape(), ("convert",), memory_bytes=memory, workers=16)


def test_a_config_json_and_its_expert_dtype(tmp_path, tiny_base):
    assert [s.step for s in check_cpu_fit(tiny_base, CPU_STEPS)] == list(CPU_STEPS)  # the tiny model fits here
    raw = json.loads((tiny_base / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "expert_dtype": "fp8"}))
    fp8 = check_cpu_fit(tmp_path, ("cpu-eval",))[0]
    fp4 = check_cpu_fit(tiny_base, ("cpu-eval",))[0]
    assert dict(fp8.parts)["checkpoint as stored"] > dict(fp4.parts)["checkpoint as stored"]
    with pytest.raises(CpuFitError, match="absent/config.json does not exist"):
        check_cpu_fit(tmp_path / "absent", ("convert",))
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(CpuFitError, match="not readable JSON"):
        check_cpu_fit(tmp_path, ("convert",))
    with pytest.raises(ValueError, match="unknown CPU step 'align'"):
        step_memory(ModelBytes.of(tiny_cpu_shape()), "align")
    assert 1 * GB < machine_memory_bytes()


def test_the_tiny_evaluation_stays_below_its_estimate(tiny_base):
    # VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec, so a child forked from a big pytest reports pytest's
    code = ("from engines.train.held_out import held_out_eval\n"
            "from engines.train.run import TrainRunConfig, tiny_loop\n"
            f"held_out_eval({str(tiny_base)!r}, TrainRunConfig(n_eval=4, loop=tiny_loop(eval_samples=2, seed=0)))\n"
            "hwm = [x for x in open('/proc/self/status') if x.startswith('VmHWM:')][0]\n"
            "print(int(hwm.split()[1]) * 1024)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    peak = int(out.stdout.strip().splitlines()[-1])
    estimate = check_cpu_fit(tiny_base, ("cpu-eval",))[0].bytes
    assert peak < estimate, (peak, estimate)
