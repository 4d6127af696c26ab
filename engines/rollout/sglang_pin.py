"""The SGLang version v4rl speaks to and launches: pyproject.toml's `cluster` extra pins it (`sglang==X`), the one
place it is written; the launcher, the server's /server_info and the conformance suite's SGLang source all read it.

    from engines.rollout.sglang_pin import sglang_version
    sglang_version()        # "0.5.23"
"""

from __future__ import annotations

import re
from pathlib import Path

_PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


class SGLangPinMissing(RuntimeError):
    """No `sglang==X` pin in pyproject.toml or the installed v4rl's metadata."""


def sglang_version() -> str:
    """The SGLang version of pyproject.toml's `cluster` extra (`sglang==X`): the one place it is pinned."""
    text = _PYPROJECT.read_text() if _PYPROJECT.is_file() else ""
    if not text:
        from importlib.metadata import PackageNotFoundError, requires

        try:
            text = "\n".join(requires("v4rl") or ())
        except PackageNotFoundError:
            text = ""
    found = re.search(r"""["']?sglang==([0-9][^"';\s,\]]*)""", text)
    if not found:
        raise SGLangPinMissing("no `sglang==X` pin in pyproject.toml's `cluster` extra (or the installed v4rl's "
                                  "metadata); add one, e.g. cluster = [\"sglang==0.5.23\"]")
    return found.group(1)
