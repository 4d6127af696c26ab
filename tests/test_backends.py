"""The two backends behind one interface (engines/backends): both implementations satisfy `Backend` member by
member, the flow's parameters build the one the preset names, and no task or flow asks which backend it has
(an AST check of tasks/ and flows/, itself checked on planted branches).

    .venv/bin/python -m pytest tests/test_backends.py -q
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from engines.backends import Backend, backend_name
from engines.backends.embedded import EmbeddedBackend
from engines.backends.miles import MilesBackend

REPO = Path(__file__).resolve().parent.parent
BACKEND_NAMES = {"embedded", "miles"}
BACKEND_VARIABLES = {"cluster", "miles", "backend", "engine"}
"""Names the tasks and flows gave (or might give) the backend's settings: compared with None, they are a branch."""
BACKEND_HINTS = BACKEND_VARIABLES | {"name", "backend_name", "pipeline_backend", "eval_task"}
"""What the other side of a comparison with "miles"/"embedded" mentions when it asks for the backend (and not,
say, Miles' --dsv4-impl, whose values include "miles")."""


def _members(cls) -> dict[str, object]:
    return {name: value for name, value in vars(cls).items() if not name.startswith("_")}


def _parameters(fn) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("impl", [EmbeddedBackend, MilesBackend])
def test_each_implementation_has_every_member_of_the_protocol_with_its_parameters(impl):
    protocol = _members(Backend)
    assert {"run_dir", "steps", "check", "align", "train", "evaluate"} <= set(protocol)
    for name, member in protocol.items():
        if isinstance(member, property):  # a property, or a dataclass field (an instance attribute)
            assert isinstance(getattr(impl, name, None), property) or name in impl.__dataclass_fields__, (impl, name)
        elif inspect.isfunction(member):
            assert _parameters(getattr(impl, name)) == _parameters(member), (impl, name)


def test_the_flow_parameters_build_the_backend_the_preset_names(tmp_path):
    from flows.params import PipelineParams

    tiny = PipelineParams.preset_defaults("tiny-cpu", runs_root=str(tmp_path), steps=7, eval_interval=7, n_eval=3)
    embedded = tiny.backend()
    assert backend_name("tiny-cpu") == "embedded" and isinstance(embedded, EmbeddedBackend)
    assert isinstance(embedded, Backend)
    assert (embedded.run_dir, embedded.steps, embedded.config.n_eval) == (str(tiny.run_dir), 7, 3)
    assert embedded.eval_task == "held-out-eval" and "cpu-eval" in embedded.cpu_steps

    flash = PipelineParams.preset_defaults("dsv4-flash-mi355x", runs_root=str(tmp_path), steps=40, eval_interval=5,
                                           ray_address="http://10.0.0.1:8265", master_addr="10.0.0.1")
    miles = flash.backend()
    assert backend_name("dsv4-flash-mi355x") == "miles" and isinstance(miles, MilesBackend)
    assert isinstance(miles, Backend)
    assert (miles.run_dir, miles.steps, miles.run.eval_interval) == (str(flash.run_dir), 40, 5)
    assert dict(miles.overrides) == flash.miles_overrides() and miles.run.job == flash.miles_job()
    assert miles.eval_task == "miles-eval" and miles.cpu_steps == ("convert", "verify")


def test_every_backend_names_an_evaluation_task_that_exists(tmp_path):
    from flows.params import PipelineParams
    from tasks.evaluate import EVAL_TASKS, eval_task

    tiny = PipelineParams.preset_defaults("tiny-cpu", runs_root=str(tmp_path)).backend()
    assert eval_task(tiny).name == tiny.eval_task and eval_task(tiny).retries == 1
    assert {"held-out-eval", "miles-eval"} == set(EVAL_TASKS)


def branches_on_the_backend(source: str) -> list[str]:
    """Where `source` asks which backend it has: a comparison with a backend's name, a backend setting compared
    with None, `.on_cluster`, an isinstance check against a *Backend class, a config dict asked for "engine"."""
    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            constants = {c.value for side in sides for c in ast.walk(side) if isinstance(c, ast.Constant)}
            mentions = {_name(n) for side in sides for n in ast.walk(side)} | (constants - BACKEND_NAMES)
            if constants & BACKEND_NAMES and mentions & BACKEND_HINTS:
                found.append(f"{where}: compares with {sorted(constants & BACKEND_NAMES)}")
            named = {_name(side) for side in sides} & BACKEND_VARIABLES
            if named and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
                found.append(f"{where}: {sorted(named)} compared with None")
        elif isinstance(node, ast.Attribute) and node.attr == "on_cluster":
            found.append(f"{where}: .on_cluster")
        elif isinstance(node, ast.Call) and _name(node.func) == "isinstance" and len(node.args) == 2 \
                and any(_name(n).endswith("Backend") for n in ast.walk(node.args[1])):
            found.append(f"{where}: isinstance against a backend")
        elif isinstance(node, ast.Call) and _name(node.func) == "get" and node.args \
                and isinstance(node.args[0], ast.Constant) and node.args[0].value == "engine":
            found.append(f'{where}: .get("engine")')
    return found


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


@pytest.mark.parametrize("planted", [
    'if config.get("engine") == "miles":\n    pass',
    "if cluster is not None:\n    pass",
    "x = a if miles is None else b",
    "if pipeline_backend(p).on_cluster:\n    pass",
    'if backend_name(p) in ("embedded",):\n    pass',
    'if backend.name == "miles":\n    pass',
    "if isinstance(backend, MilesBackend):\n    pass",
])
def test_the_check_finds_a_planted_branch(planted):
    assert branches_on_the_backend(planted)


def test_the_check_leaves_other_comparisons_alone():
    assert not branches_on_the_backend('if self.dsv4_impl != "miles" or preset == "tiny-cpu":\n    pass')


BUILDS_THE_BACKEND = REPO / "flows" / "params.py"
"""The one place that chooses: it builds the backend the preset names, and refuses settings that apply to one
backend only (rehearse)."""


def test_no_task_or_flow_branches_on_the_backend():
    paths = sorted(p for top in ("tasks", "flows") for p in (REPO / top).rglob("*.py") if p != BUILDS_THE_BACKEND)
    found = {str(p.relative_to(REPO)): hits for p in paths if (hits := branches_on_the_backend(p.read_text()))}
    assert not found, f"tasks/flows ask which backend they have; call the Backend (engines/backends) instead: {found}"
