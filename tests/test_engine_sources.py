"""engines/upstream/sources.py and engines/upstream/stubs.py: pins, source trees, the stub finder's rules.

    .venv/bin/python -m pytest tests/test_engine_sources.py -q
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from engines.upstream import sources as engine_sources
from engines.rollout.sglang_pin import sglang_version
from engines.upstream.sources import EngineSourceMissing, engine_python

REPO = Path(__file__).resolve().parent.parent


def test_sglang_pin_is_the_cluster_extra():
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["cluster"]
    assert f"sglang=={sglang_version()}" in extra


STUB_PROBE = """
import json, sys, typing
import fake_gpu_lib.ops as ops                      # stubbed: nothing real is called fake_gpu_lib
from fake_gpu_lib.language import constexpr

@ops.jit
def kernel(x):
    return x + 1

@ops.autotune(configs=[ops.Config({"BLOCK": 64}, num_warps=4)], key=["n"])
def tuned(x):
    return x

class Runner(ops.KernelBase):                       # a stub as a base class
    pass

try:
    ops.current_device()
    query = "returned"
except sys.modules["engine_stubs"].StubCalled as exc:
    query = "raised"
import json as real_json                              # covered root, but real: never stubbed
union = typing.get_args(ops.A | ops.B)
print(json.dumps({"kernel": kernel(1), "tuned_is_stub": tuned is not None, "runner": Runner.__name__,
                  "query": query, "real_json": real_json.__name__ == "json" and hasattr(real_json, "dumps"),
                  "union": len(union), "version": sys.modules["fake_gpu_lib"].__version__,
                  "stubbed": sorted(sys.modules["engine_stubs"].STUBBED)}))
"""


def test_stubs_cover_only_missing_modules_under_the_roots():
    done = engine_python(STUB_PROBE, [], stub_roots=["fake_gpu_lib", "json"], timeout=60)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["kernel"] == 2  # a decorator passes the function through
    assert out["runner"] == "Runner" and out["tuned_is_stub"]
    assert out["query"] == "raised"  # asking a stub for a value fails loudly
    assert out["real_json"]
    assert out["union"] == 2
    assert "stub" in out["version"]
    assert out["stubbed"] == ["fake_gpu_lib", "fake_gpu_lib.language", "fake_gpu_lib.ops"]


def test_a_module_outside_the_roots_still_fails_to_import():
    done = engine_python("import fake_gpu_lib_two", [], stub_roots=["fake_gpu_lib"], timeout=60, check=False)
    assert done.returncode != 0 and "No module named 'fake_gpu_lib_two'" in done.stderr
    with pytest.raises(RuntimeError, match="fake_gpu_lib_two"):
        engine_python("import fake_gpu_lib_two", [], stub_roots=["fake_gpu_lib"], timeout=60)


def test_a_checkout_that_is_not_miles_is_named(tmp_path):
    with pytest.raises(EngineSourceMissing, match=r"not a miles checkout \(no miles/utils/arguments.py\)"):
        engine_sources.miles_tree(tmp_path)


def test_missing_sources_say_what_to_set(tmp_path, monkeypatch):
    monkeypatch.setenv("V4RL_VENDOR_DIR", str(tmp_path / "absent"))
    monkeypatch.setenv("V4RL_ENGINE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("V4RL_MILES_DIR", raising=False)
    monkeypatch.delenv("V4RL_MEGATRON_DIR", raising=False)
    monkeypatch.delenv("V4RL_SGLANG_DIR", raising=False)
    with pytest.raises(EngineSourceMissing, match=r"set \$V4RL_MILES_DIR to a checkout of .* at 31f1ca961"):
        engine_sources.miles_tree()
    with pytest.raises(EngineSourceMissing, match=r"\$V4RL_MEGATRON_DIR"):
        engine_sources.megatron_tree()
    with pytest.raises(EngineSourceMissing, match=r"not in .*set \$V4RL_SGLANG_DIR"):
        engine_sources.sglang_paths(install=False)


def test_vendor_tarball_is_extracted_once_into_the_cache(tmp_path, monkeypatch):
    if engine_sources.vendor_dir() is None:
        pytest.skip("no ../shared/vendor here (set V4RL_VENDOR_DIR to the pinned tarballs)")
    monkeypatch.setenv("V4RL_ENGINE_CACHE", str(tmp_path))
    monkeypatch.delenv("V4RL_MEGATRON_DIR", raising=False)
    tree = engine_sources.megatron_tree()
    assert tree == tmp_path / "megatron-lm-2e64d788b" and (tree / "megatron/training/arguments.py").is_file()
    (tree / "marker").write_text("kept")
    assert engine_sources.megatron_tree() == tree and (tree / "marker").read_text() == "kept"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".megatron-lm-2e64d788b.") and p.is_dir()]


def test_a_grown_dependency_list_is_topped_up_not_reinstalled(tmp_path):
    """A cache built before a package joined SGLANG_CPU_DEPS names it as missing (sglang_paths installs it)."""
    names = list(engine_sources.SGLANG_CPU_DEPS)
    (tmp_path / "ready.json").write_text(json.dumps({"sglang": "x", "deps": [f"{n}==1" for n in names[:-1]]}))
    assert engine_sources._missing_deps(tmp_path) == [names[-1]]
    (tmp_path / "ready.json").write_text(json.dumps({"sglang": "x", "deps": names}))
    assert engine_sources._missing_deps(tmp_path) == []
    specs = engine_sources._dep_specs(["msgspec", "openai"], {"openai": "2.8.0"})
    assert specs == [f"msgspec=={engine_sources.SGLANG_CPU_DEPS['msgspec']}", "openai==2.8.0"]


# ------------------------------------------------------------------ the engine's own words, one line (issue 25)
ARGPARSE_EXIT = """[model_probe] start at 0.0s
usage: train.py [-h] [--num-layers NUM_LAYERS]
train.py: error: unrecognized arguments: --dsv4-impl miles
"""
ASSERTION = """Traceback (most recent call last):
  File "/miles/miles/utils/arguments.py", line 1700, in parse_args
    assert args.tensor_model_parallel_size == 1, "dsv4_impl=megatron needs TP=1"
AssertionError: dsv4_impl=megatron needs TP=1
"""


def test_engine_error_keeps_argparse_and_assertion_text_and_drops_the_traceback():
    from engines.upstream.sources import engine_error

    assert engine_error(ARGPARSE_EXIT, exception="SystemExit: 2") == \
        "train.py: error: unrecognized arguments: --dsv4-impl miles"
    assert engine_error(ASSERTION) == "AssertionError: dsv4_impl=megatron needs TP=1"
    assert engine_error("loading...\nno config.json in /x", exception="SystemExit: 1") == "no config.json in /x"
    assert engine_error("", "") == "it printed no error line"


def test_a_failed_engine_run_raises_one_line_with_the_engines_error():
    with pytest.raises(RuntimeError) as err:
        engine_python("import sys; print('usage: x', file=sys.stderr); assert False, 'planted: TP must divide 7'", [])
    message = str(err.value)
    assert "AssertionError: planted: TP must divide 7" in message, message
    assert "Traceback" not in message and "\n" not in message, message
