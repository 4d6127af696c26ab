"""The engines' own modules the conformance suite and the cluster preflight rely on import on CPU, with only
GPU-only packages stubbed (engines/upstream/stubs.py).

    .venv/bin/python -m pytest tests/conformance/test_engine_imports.py -q
"""

from __future__ import annotations

import json

from engines.rollout.sglang_pin import sglang_version
from engines.upstream.sources import engine_python
from engines.upstream.stubs import GPU_ONLY_ROOTS

SGLANG_MODULES = ["sglang.srt.server_args", "sglang.srt.managers.io_struct", "sglang.srt.entrypoints.http_server",
                  "sglang.srt.configs.model_config", "sglang.srt.models.deepseek_v4",
                  "sglang.lang.backend.runtime_endpoint", "sglang.api.v1.api_types", "sglang.test.kl_test_utils",
                  "sglang.test.test_utils"]


def test_sglang_modules_import_with_only_gpu_packages_stubbed(sglang_paths):
    code = f"""
import importlib, json, sys
import sglang
mods = {SGLANG_MODULES!r}
for name in mods:
    importlib.import_module(name)
print(json.dumps({{"version": sglang.__version__, "file": sglang.__file__,
                  "stubbed": sorted(set(s.split(".")[0] for s in sys.modules["engine_stubs"].STUBBED))}}))
"""
    out = json.loads(engine_python(code, sglang_paths, timeout=600).stdout.strip().splitlines()[-1])
    assert out["version"] == sglang_version()
    assert out["file"].startswith(str(sglang_paths[0]))
    assert set(out["stubbed"]) <= set(GPU_ONLY_ROOTS) and "sglang" not in out["stubbed"]
