"""The SGLang API surface v4rl depends on, against the pinned SGLang: the same, and named when it changes.

`snapshots/sglang-surface.json` records, for the pinned version, every route v4rl's server serves (methods,
whether SGLang requires a body, the body's fields), GenerateReqInput's and the contract SamplingParams' fields,
the ServerArgs fields v4rl's launch argv and /server_info use, and /model_info's keys. A bumped pin (or another
SGLang via $V4RL_SGLANG_DIR) that differs fails `test_surface_matches_the_snapshot` with each difference named;
after reviewing them (and fixing v4rl where needed), rewrite the snapshot with
    V4RL_WRITE_SGLANG_SURFACE=1 .venv/bin/python -m pytest tests/conformance/test_sglang_surface.py -q
The other tests hold v4rl's server to the live SGLang, whatever the snapshot says: no route or body field SGLang
lacks, a 400 on an empty body exactly where SGLang requires one, /model_info with SGLang's keys, /server_info
with ServerArgs names only.

    .venv/bin/python -m pytest tests/conformance/test_sglang_surface.py -q
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
from pydantic import BaseModel

from engines.rollout.sglang_pin import sglang_version
from engines.rollout.engine import RolloutEngine
from engines.rollout.info import ServingState
from engines.rollout.launcher import SGLangServerSpec, build_launch_command
from engines.rollout.server import RolloutServer, create_app
from engines.rollout.sglang import SGLangClient

SNAPSHOT = Path(__file__).parent / "snapshots" / "sglang-surface.json"
SCHEDULER_INFO = {"status", "max_total_num_tokens", "max_req_input_len", "startup_time"}
"""/server_info keys SGLang takes from the scheduler's handshake rather than ServerArgs."""
SERVER_INFO_EXTRA = {"internal_states", "version", "v4rl"}
"""/server_info keys beside ServerArgs and scheduler info: SGLang's own two, and v4rl's namespaced extensions."""


@pytest.fixture(scope="module")
def live(sglang_worker) -> dict:
    return sglang_worker.call("surface", timeout=120)


@pytest.fixture(scope="module")
def ours(tiny_checkpoint):
    engine = RolloutEngine(tiny_checkpoint)
    with RolloutServer(engine) as server:
        app = create_app(engine)
        routes = {}
        for route in app.routes:
            methods = getattr(route, "methods", None)
            if methods and not route.path.startswith(("/docs", "/redoc", "/openapi")):
                routes.setdefault(route.path, {"methods": set(), "model": None})["methods"] |= set(methods)
                body = getattr(route, "body_field", None)
                annotation = getattr(getattr(body, "field_info", None), "annotation", None)
                models = [a for a in getattr(annotation, "__args__", (annotation,)) if isinstance(a, type)
                          and issubclass(a, BaseModel)]
                routes[route.path]["model"] = models[0] if models else None
        yield {"server": server, "routes": routes, "startup_fields": set(ServingState(engine).startup_args)}


def _used_server_args(tmp_path: Path) -> set[str]:
    spec = SGLangServerSpec(model_path="/m", tp_size=4, ep_size=2, attn_dp_size=2, dp_size=2, max_running_requests=1,
                            max_total_tokens=1, context_length=1, api_key="k", deterministic=True)
    flags = [a for a in build_launch_command(spec, host="h", port=1) if a.startswith("--")]
    return {f[2:].replace("-", "_") for f in flags}


def _restricted(surface: dict, route_paths: set[str], server_args: set[str]) -> dict:
    return {"version": surface["version"],
            "routes": {p: surface["routes"].get(p) for p in sorted(route_paths)},
            "generate_fields": surface["generate_fields"], "sampling_fields": surface["sampling_fields"],
            "server_args_fields": sorted(set(surface["server_args_fields"]) & server_args),
            "server_args_missing": sorted(server_args - set(surface["server_args_fields"]))}


def _differences(old: dict, new: dict, where: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for k in sorted(old.keys() | new.keys())
                for d in (_differences(old.get(k), new.get(k), f"{where}.{k}" if where else k)
                          if k in old and k in new else [f"{where}.{k}: {'added' if k in new else 'removed'}"
                                                          f" ({(new if k in new else old)[k]!r})"])]
    if isinstance(old, list) and isinstance(new, list) and old != new:
        added = sorted(set(map(str, new)) - set(map(str, old)))
        removed = sorted(set(map(str, old)) - set(map(str, new)))
        return [f"{where}: added {added}, removed {removed}" if added or removed else f"{where}: reordered"]
    return [] if old == new else [f"{where}: {old!r} -> {new!r}"]


def test_surface_matches_the_snapshot(live, ours, tmp_path):
    used_args = _used_server_args(tmp_path) | ours["startup_fields"]
    current = _restricted(live, set(ours["routes"]), used_args)
    if os.environ.get("V4RL_WRITE_SGLANG_SURFACE") == "1":
        SNAPSHOT.parent.mkdir(exist_ok=True)
        partial = SNAPSHOT.with_suffix(".json.partial")
        partial.write_text(json.dumps(current, indent=1, sort_keys=True) + "\n")
        partial.replace(SNAPSHOT)
    recorded = json.loads(SNAPSHOT.read_text())
    changed = _differences(recorded, current)
    assert not changed, (f"SGLang {current['version']} (pinned: {sglang_version()}) differs from the surface recorded "
                         f"for {recorded['version']} in {SNAPSHOT.name}:\n  " + "\n  ".join(changed) +
                         "\nreview each, fix v4rl where it depends on it, then rewrite the snapshot "
                         "(V4RL_WRITE_SGLANG_SURFACE=1, see this module's docstring)")
    missing = current["server_args_missing"]
    assert not missing, f"v4rl uses ServerArgs fields SGLang lacks: {missing}"


def test_no_route_or_body_field_sglang_lacks(live, ours):
    for path, route in ours["routes"].items():
        theirs = live["routes"].get(path)
        assert theirs is not None, f"v4rl serves {path}, which SGLang {live['version']} does not have"
        assert route["methods"] <= set(theirs["methods"]), (path, sorted(route["methods"]), theirs["methods"])
        if route["model"] is not None:
            extra = set(route["model"].model_fields) - set(theirs["body_fields"])
            assert not extra, f"{path}: v4rl's body has fields SGLang's lacks: {sorted(extra)}"


def test_empty_body_refused_exactly_where_sglang_requires_one(live, ours):
    url = ours["server"].url
    for path, route in sorted(ours["routes"].items()):
        if "POST" not in route["methods"] or path == "/generate":
            continue
        required = live["routes"][path]["body_required"]
        status = httpx.post(f"{url}{path}", timeout=60).status_code
        assert (status == 400) == required, f"{path}: SGLang requires a body: {required}; v4rl answered {status}"
    assert live["routes"]["/generate"]["body_required"]
    assert httpx.post(f"{url}/generate", timeout=60).status_code == 400


def test_info_fields_are_sglangs(live, ours, sglang_app):
    with SGLangClient(sglang_app["url"], api_key=sglang_app["api_key"]) as theirs, \
            SGLangClient(ours["server"].url) as mine:
        assert set(mine.model_info()) == set(theirs.model_info())
        info = mine.server_info()
    unknown = set(info) - set(live["server_args_fields"]) - SCHEDULER_INFO - SERVER_INFO_EXTRA
    assert not unknown, f"/server_info keys that are no ServerArgs field: {sorted(unknown)}"


def test_a_changed_surface_is_named():
    old = {"version": "0.5.23", "routes": {"/x": {"methods": ["GET", "POST"], "body_required": False}},
           "sampling_fields": ["a", "b"]}
    new = {"version": "0.5.24", "routes": {"/x": {"methods": ["GET"], "body_required": True}, "/y": {}},
           "sampling_fields": ["a", "c"]}
    assert _differences(old, new) == [
        "routes./x.body_required: False -> True", "routes./x.methods: added [], removed ['POST']",
        "routes./y: added ({})", "sampling_fields: added ['c'], removed ['b']", "version: '0.5.23' -> '0.5.24'"]
