"""A CLI option derived from the one typed definition of its setting: the default and the docstring of a dataclass
field, read from the module's source (no import: `v4rl --help` stays fast, and torch is not loaded for it).

    default, doc = field_default_and_doc("engines.train.run", "TrainRunConfig", "save_interval")
    save_interval: int = typer.Option(default, min=1, help=doc)
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path


def field_default_and_doc(module: str, cls: str, name: str) -> tuple[object, str]:
    """The literal default and the docstring (the string right below the field) of `cls.name` in `module`."""
    source = Path(importlib.util.find_spec(module).origin).read_text()
    body = next(node for node in ast.parse(source).body if isinstance(node, ast.ClassDef) and node.name == cls).body
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            after = body[i + 1] if i + 1 < len(body) else None
            doc = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else ""
            return ast.literal_eval(node.value), " ".join(str(doc).split())
    raise KeyError(f"{module}.{cls} has no field {name!r}")
