"""Settings surfaces derived from the one typed definition of each setting: the default and the docstring of a
dataclass field, read from its module's source without importing it (`v4rl --help` and the Prefect form stay fast,
and torch is not loaded for them). The command line's options and the flow's form both read them here, so the
three never say different things.

    default, doc = field_default_and_doc("engines.train.run", "TrainRunConfig", "save_interval")
    save_interval: int = typer.Option(default, min=1, help=doc)
    docs = field_docs("rl.correction_setting", "RolloutCorrection")      # {"mode": "...", ...}
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path


@functools.lru_cache(maxsize=None)  # each CLI option asks again; parse each class once
def _fields(module: str, cls: str) -> dict[str, tuple[ast.AnnAssign, str]]:
    source = Path(importlib.util.find_spec(module).origin).read_text()
    matches = [node for node in ast.parse(source).body if isinstance(node, ast.ClassDef) and node.name == cls]
    if not matches:
        raise KeyError(f"{module} defines no class {cls!r}")
    body = matches[0].body
    out: dict[str, tuple[ast.AnnAssign, str]] = {}
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            after = body[i + 1] if i + 1 < len(body) else None
            doc = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else ""
            out[node.target.id] = (node, " ".join(str(doc).split()))
    return out


def field_docs(module: str, cls: str) -> dict[str, str]:
    """The docstring (the string right below the field, on one line) of every field of `cls` in `module`."""
    return {name: doc for name, (_, doc) in _fields(module, cls).items()}


def field_default_and_doc(module: str, cls: str, name: str) -> tuple[object, str]:
    """The literal default and the docstring of `cls.name` in `module`."""
    fields = _fields(module, cls)
    if name not in fields:
        raise KeyError(f"{module}.{cls} has no field {name!r}")
    node, doc = fields[name]
    return ast.literal_eval(node.value), doc
