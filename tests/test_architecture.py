"""The layout rules of docs/architecture.md, checked on the source: no loose modules at engines/'s root, library
packages never import Prefect, and packages import each other without cycles (a package = a directory; its
modules' imports at any depth, a child importing its own parent package not counted), nor do engines/'s
packages with their subpackages folded in; every Ray actor method is called by library code (no test-only code).

    .venv/bin/python -m pytest tests/test_architecture.py -q
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOPS = ("engines", "checkpoints", "rl", "flows", "tasks", "v4rl")


def _package(module: str) -> str:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if REPO.joinpath(*parts[:n]).is_dir():
            return ".".join(parts[:n])
    return parts[0]


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def _package_edges() -> dict[str, dict[str, set[str]]]:
    edges: dict[str, dict[str, set[str]]] = {}
    for top in TOPS:
        for path in (REPO / top).rglob("*.py"):
            rel = path.relative_to(REPO)
            src = ".".join(rel.parent.parts)
            for name in _imports(path):
                if name.split(".")[0] not in TOPS:
                    continue
                dst = _package(name)
                if dst != src and not src.startswith(dst + "."):
                    edges.setdefault(src, {}).setdefault(dst, set()).add(str(rel))
    return edges


def _cycle(edges: dict[str, dict[str, set[str]]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in edges.get(node, {}):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in list(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_engines_has_no_loose_modules_at_its_root():
    loose = sorted(p.name for p in (REPO / "engines").glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules at engines/'s root belong in a package that names their concern: {loose}"


def test_library_packages_never_import_prefect():
    offenders = sorted(str(p.relative_to(REPO)) for top in ("engines", "checkpoints", "rl")
                       for p in (REPO / top).rglob("*.py") if any(n.split(".")[0] == "prefect" for n in _imports(p)))
    assert not offenders, f"library modules importing Prefect (only flows/ and tasks/ may): {offenders}"


def test_packages_import_each_other_without_cycles():
    edges = _package_edges()
    cycle = _cycle(edges)
    assert cycle is None, "package import cycle " + " -> ".join(cycle) + ": " + "; ".join(
        f"{a} -> {b} in {sorted(edges[a][b])[:3]}" for a, b in zip(cycle, cycle[1:]))


def test_engines_packages_import_each_other_without_cycles():
    """engines/<package> as one node each, subpackages folded in (engines.miles is engines.train): a cycle
    there (issue 40: engines.align scored with engines.train's trainer while engines.miles ran align's gate)
    hides below the finer graph, where a subpackage counts as its own node."""
    edges: dict[str, dict[str, set[str]]] = {}
    for src, targets in _package_edges().items():
        for dst, files in targets.items():
            a, b = (".".join(n.split(".")[:2]) for n in (src, dst))
            if a != b and a.startswith("engines.") and b.startswith("engines."):
                edges.setdefault(a, {}).setdefault(b, set()).update(files)
    cycle = _cycle(edges)
    assert cycle is None, "engines package import cycle " + " -> ".join(cycle) + ": " + "; ".join(
        f"{a} -> {b} in {sorted(edges[a][b])[:3]}" for a, b in zip(cycle, cycle[1:]))


def test_every_ray_actor_method_is_called_by_the_library():
    """engines/train/actors.py's workers are reached only through Ray handles (`worker.name.remote()`); a method no
    library module calls is test-only code in the library (issue 40: `parameter_fingerprint`)."""
    actors = REPO / "engines" / "train" / "actors.py"
    methods = {f"{c.name}.{f.name}": f.name for c in ast.parse(actors.read_text()).body if isinstance(c, ast.ClassDef)
               for f in c.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")}
    called = {node.attr for top in TOPS for path in (REPO / top).rglob("*.py") if path != actors
              for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Attribute)}
    unused = sorted(q for q, name in methods.items() if name not in called)
    assert not unused, f"actor methods no library code calls (move what tests need into tests/): {unused}"


def test_the_grpo_loop_knows_no_engine_plumbing():
    """rl/loop.py is the algorithm: the engines reach it only as the Rollout/Learner protocols and LoopHooks."""
    plumbing = ("ray", "httpx", "prefect", "engines", "flows", "tasks")
    offenders = sorted(n for p in (REPO / "rl").rglob("*.py") for n in _imports(p) if n.split(".")[0] in plumbing)
    assert not offenders, f"rl/ imports engine plumbing (implement rl.loop's protocols in engines/ instead): {offenders}"
