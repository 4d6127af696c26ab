"""Fixtures of the conformance suite: the real engines' own code, on CPU, from outside the repo.

Each fixture skips (with what to set) when its source is unavailable: a fresh clone has no ../shared/vendor,
so Miles and Megatron-LM then come from $V4RL_MILES_DIR / $V4RL_MEGATRON_DIR; SGLang comes from the cache that
setup.sh fills from the registry (or $V4RL_SGLANG_DIR). Every test here carries the `conformance` marker.

    .venv/bin/python -m pytest tests/conformance -q
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from engines.miles import pins
from engines.upstream import sources as engine_sources

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the suite's helpers (sglang_worker.py) import by name


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.conformance)


def _or_skip(get, *args):
    try:
        return get(*args)
    except engine_sources.EngineSourceMissing as exc:
        pytest.skip(f"engine source unavailable: {exc}")


@pytest.fixture(scope="session")
def miles_tree() -> Path:
    """Miles main at the pinned commit (or $V4RL_MILES_DIR)."""
    return _or_skip(engine_sources.miles_tree)


@pytest.fixture(scope="session")
def miles_seed_pr_tree() -> Path:
    """Miles PR #1300 head (the seed's exact command line), from the vendor tarball only."""
    if os.environ.get(pins.MILES.env):
        pytest.skip(f"${pins.MILES.env} is set: checks of the PR-head tarball are skipped")
    return _or_skip(engine_sources.miles_tree, None, pins.MILES_SEED_PR)


@pytest.fixture(scope="session")
def megatron_tree() -> Path:
    """Megatron-LM miles-main at the pinned commit (or $V4RL_MEGATRON_DIR)."""
    return _or_skip(engine_sources.megatron_tree)


@pytest.fixture(scope="session")
def miles_gen2_tree() -> Path:
    """Miles e9e19b223 (DeepSeek-V4 generation 2: Megatron's names, --dsv4-impl), from the vendor tarball; with
    $V4RL_MILES_DIR set, that checkout when it is of generation 2 (else skipped)."""
    return _generation_tree(2, engine_sources.miles_tree, pins.MILES_GEN2)


@pytest.fixture(scope="session")
def megatron_gen2_tree() -> Path:
    """Megatron-LM dsv4-dual-backend 6184c094a (fits Miles e9e19b223), or $V4RL_MEGATRON_DIR with a gen-2 Miles."""
    return _generation_tree(2, engine_sources.megatron_tree, pins.MEGATRON_GEN2)


def _generation_tree(generation: int, get, pin) -> Path:
    if os.environ.get(pin.env):
        from engines.miles.generation import detect_generation

        user_miles = _or_skip(engine_sources.miles_tree)
        found = detect_generation(user_miles).generation
        if found != generation:
            pytest.skip(f"${pins.MILES.env} is a generation-{found} Miles; generation-{generation} checks "
                        "run on the vendor tarballs only")
        return _or_skip(get)
    return _or_skip(get, None, pin)


@pytest.fixture(scope="session")
def sglang_paths() -> list[Path]:
    """sys.path entries for the pinned SGLang (cached by setup.sh; installed here if the registry answers)."""
    return _or_skip(engine_sources.sglang_paths)


@pytest.fixture(scope="session")
def sglang_worker(sglang_paths, tmp_path_factory):
    """One subprocess with SGLang imported (tests/conformance/sglang_worker.py), shared by the SGLang checks."""
    from sglang_worker import SGLangWorker

    worker = SGLangWorker(sglang_paths, tmp_path_factory.mktemp("sglang-worker"))
    yield worker
    worker.close()


@pytest.fixture(scope="session")
def sglang_app(sglang_worker, tmp_path_factory) -> dict:
    """SGLang's real FastAPI app with only the TokenizerManager faked, on 127.0.0.1, API key `SGLANG_APP_KEY`."""
    url = sglang_worker.call("start_app", workdir=str(tmp_path_factory.mktemp("sglang-app")),
                             api_key=SGLANG_APP_KEY)["url"]
    return {"url": url, "api_key": SGLANG_APP_KEY}


SGLANG_APP_KEY = "conformance-key"
