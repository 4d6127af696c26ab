"""Fixtures of the conformance suite: the real engines' own code, on CPU, from outside the repo.

Each fixture skips (with what to set) when its source is unavailable: a fresh clone has no ../shared/vendor,
so Miles and Megatron-LM then come from $V4RL_MILES_DIR / $V4RL_MEGATRON_DIR; SGLang comes from the cache that
setup.sh fills from the registry (or $V4RL_SGLANG_DIR). Every test here carries the `conformance` marker.

    .venv/bin/python -m pytest tests/conformance -q
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engines import engine_sources

HERE = Path(__file__).resolve().parent


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
    if os.environ.get(engine_sources.MILES.env):
        pytest.skip(f"${engine_sources.MILES.env} is set: checks of the PR-head tarball are skipped")
    return _or_skip(engine_sources.miles_tree, None, engine_sources.MILES_SEED_PR)


@pytest.fixture(scope="session")
def megatron_tree() -> Path:
    """Megatron-LM miles-main at the pinned commit (or $V4RL_MEGATRON_DIR)."""
    return _or_skip(engine_sources.megatron_tree)


@pytest.fixture(scope="session")
def sglang_paths() -> list[Path]:
    """sys.path entries for the pinned SGLang (cached by setup.sh; installed here if the registry answers)."""
    return _or_skip(engine_sources.sglang_paths)
