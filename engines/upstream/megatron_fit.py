"""Whether a Megatron-LM checkout fits a Miles checkout: every `megatron.*` module Miles imports at module level
exists in that Megatron-LM.

Miles pins its Megatron-LM (radixark's fork, one branch per DeepSeek-V4 generation: engines/upstream/sources.py
MILES_GENERATIONS), and the two drift apart: generation 2's Miles imports `megatron.core.tokenizers.utils.
build_tokenizer`, which generation 1's Megatron-LM lacks, and generation 1's imports `megatron.training.tokenizer.
tokenizer`, which generation 2's lacks. A misfit otherwise surfaces as a ModuleNotFoundError in the first Ray actor
that imports Miles, after Ray and the engine have started. Files are read as text (ast), nothing is imported;
imports inside functions, `try` or `if` blocks are optional to Miles and not checked.

    problem = megatron_misfit(miles_dir, megatron_dir)   # None, or one line: Miles' file:line and the module

Tests: `.venv/bin/python -m pytest tests/test_miles_generation.py -q -k fit`.
"""

from __future__ import annotations

import ast
from pathlib import Path

MILES_SOURCES = ("train.py", "train_async.py", "miles", "miles_plugins")
"""Miles' entry points and packages, whose module-level imports must resolve."""


def megatron_imports(miles: Path) -> dict[str, tuple[str, int]]:
    """Each `megatron.*` module Miles imports at module level -> (the first importing file, relative, and line)."""
    found: dict[str, tuple[str, int]] = {}
    for entry in MILES_SOURCES:
        path = miles / entry
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.is_file() else []
        for file in files:
            try:
                tree = ast.parse(file.read_text(errors="replace"))
            except SyntaxError:
                continue
            for node in tree.body:
                names = [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else \
                    [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
                for name in names:
                    if name.split(".")[0] == "megatron":
                        found.setdefault(name, (file.relative_to(miles).as_posix(), node.lineno))
    return found


def _has_module(megatron: Path, name: str) -> bool:
    path = megatron.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def megatron_misfit(miles: Path, megatron: Path) -> str | None:
    """None when every module-level `megatron.*` import of Miles resolves in `megatron`; else one line naming the
    first that does not (Miles' file and line, the module)."""
    for name, (file, line) in sorted(megatron_imports(miles).items(), key=lambda item: item[1]):
        if not _has_module(megatron, name):
            return f"{file}:{line} imports {name}, which the Megatron-LM at {megatron} lacks"
    return None
