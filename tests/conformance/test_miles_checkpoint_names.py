"""Each Miles generation's own code agrees with checkpoints/names.py: its bridge's name tables and its load guard.

Miles' mbridge DeepSeek-V4 bridge (`miles_plugins/mbridge/deepseekv4.py`) maps every Megatron weight of its
generation to the HF name SGLang loads: the dict literals of `_ATTENTION_MAPPING.update`, `_OTHER_MAPPING`,
`_MLP_MAPPING.update`, `_DIRECT_MAPPING.update` and (generation 2) `_ALPHA_SEGMENTS` are read from the pinned
tree as data (ast, nothing imported), and each pair must be one of v4rl's rows: the Megatron column of that
generation and the HF (sglang) column name the same native tensor, a split alpha its block of the packed scale.
Then Miles e9e19b223's own `assert_checkpoint_is_current` (run in a subprocess from the tree) accepts a release
checkpoint v4rl writes under Megatron's names and refuses one under the plugin names. A few seconds.

    .venv/bin/python -m pytest tests/conformance/test_miles_checkpoint_names.py -q
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from checkpoints.names import convert_name, native_to_megatron, placements
from checkpoints.torch_dist import (
    ChunkFileWriter,
    mark_release,
    megatron_specs,
    write_checkpointing_config,
    write_common,
    write_dcp_metadata,
)
from engines.upstream.sources import engine_python
from engines.model.params import native_param_specs
from engines.presets.models import tiny_cpu_model_config

BRIDGE = "miles_plugins/mbridge/deepseekv4.py"
TABLES = ("_ATTENTION_MAPPING", "_OTHER_MAPPING", "_MLP_MAPPING", "_DIRECT_MAPPING", "_ALPHA_SEGMENTS")


def bridge_tables(miles: Path) -> dict[str, dict]:
    """The literal dicts the bridge class assigns or `.update()`s, by table name (merged in source order)."""
    tree = ast.parse((miles / BRIDGE).read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "DeepseekV4Bridge")
    out: dict[str, dict] = {}
    for node in cls.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            name = node.targets[0].id  # type: ignore[attr-defined]
            out.setdefault(name, {}).update(ast.literal_eval(node.value))
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            func = node.value.func
            if isinstance(func, ast.Attribute) and func.attr == "update" and node.value.args:
                out.setdefault(func.value.id, {}).update(ast.literal_eval(node.value.args[0]))  # type: ignore[attr-defined]
    return {k: v for k, v in out.items() if k in TABLES}


def _check_bridge(miles: Path, names: str, column: str) -> int:
    tables = bridge_tables(miles)
    alpha = tables.get("_ALPHA_SEGMENTS", {})
    cfg = tiny_cpu_model_config()
    shapes = native_param_specs(cfg)
    checked = 0
    for table in ("_ATTENTION_MAPPING", "_OTHER_MAPPING", "_MLP_MAPPING", "_DIRECT_MAPPING"):
        for megatron, hf in tables[table].items():
            hf_name = hf[0] if isinstance(hf, list) else hf
            layer = "{layer_number}" in hf_name
            native = convert_name(hf_name.replace("{layer_number}", "1"), "sglang", "native")
            key = f"decoder.layers.1.{megatron}" if layer else megatron
            spec_name = native if native in shapes else native.replace("layers.1.", "layers.0.")
            boxes = placements(native, shapes[spec_name].shape, column, cfg.n_routed_experts)
            ours = {p.name: p for p in boxes}
            assert key in ours, f"{table}: Miles' {names} model names {key!r} for {hf_name}; v4rl's table: {list(ours)}"
            leaf = megatron.rsplit(".", 1)[-1]
            if leaf in alpha:  # the packed scale's block this alpha holds, as the bridge slices it
                assert ours[key].source_rows == (alpha[leaf], alpha[leaf] + 1), (key, alpha)
            checked += 1
    return checked


def test_first_generation_bridge_names_are_the_plugin_column(miles_tree):
    assert _check_bridge(miles_tree, "plugin", "megatron") >= 25


def test_second_generation_bridge_names_are_the_megatron_column(miles_gen2_tree):
    assert bridge_tables(miles_gen2_tree)["_ALPHA_SEGMENTS"] == {"alpha_pre": 0, "alpha_post": 1, "alpha_res": 2}
    assert _check_bridge(miles_gen2_tree, "megatron", "megatron2") >= 29


def _release(root: Path, names: str) -> Path:
    """A release checkpoint of the tiny model under `names`, written as the converter writes (arange values)."""
    cfg = tiny_cpu_model_config()
    native = {n: torch.zeros(s.shape) for n, s in native_param_specs(cfg).items()}
    specs = megatron_specs(cfg, names)
    rel = root / "release"
    rel.mkdir(parents=True)
    with ChunkFileWriter(rel / "__0_0.distcp") as w:
        for key, t in native_to_megatron(native, cfg, names).items():
            w.append(key, (0,) * t.ndim, t.to(specs[key].dtype).contiguous())
    write_dcp_metadata(rel, w.records, specs)
    write_common(rel, cfg, hf_config=cfg.to_hf_dict(), names=names)
    write_checkpointing_config(rel)
    mark_release(root)
    return root


GUARD = """
import sys
from miles_plugins.models.deepseek_v4.arguments import assert_checkpoint_is_current
for path in sys.argv[1:]:
    try:
        assert_checkpoint_is_current(path)
        print("ACCEPTED")
    except ValueError as exc:
        print("REFUSED", " ".join(str(exc).split()))
"""


def test_second_generation_load_guard_accepts_megatron_names_only(tmp_path, miles_gen2_tree):
    paths = [str(_release(tmp_path / names, names)) for names in ("megatron", "plugin")]
    done = engine_python(GUARD, [miles_gen2_tree], args=paths, stub_roots=())  # one process: torch imports once
    answers = dict(zip(("megatron", "plugin"), done.stdout.strip().splitlines()[-2:]))
    assert answers["megatron"] == "ACCEPTED"
    assert answers["plugin"].startswith("REFUSED") and "before the attention weights were renamed" in answers["plugin"]
