"""Miles' metric log lines (`step 12: {'train/pg_loss': ...}`) parsed, with names mapped to ours."""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_RECORD = re.compile(r"(?:^|[\s\]>:-])(?P<kind>perf|rollout|eval|step|multi_turn|passrate|[a-z]+-step) "
                     r"(?P<index>\d+): (?P<body>\{.*\})\s*$")
_STEP_KEYS = ("train/step", "rollout/step", "eval/step")


@dataclass(frozen=True)
class MetricRecord:
    """One metric line of the Miles log, with names mapped to ours."""

    kind: str
    """perf | rollout | step | eval | multi_turn | passrate (the word before the number)."""
    index: int
    """The rollout id (or accumulated train step for `step` lines) the line carries."""
    step: int
    """The record's own step axis (train/step, rollout/step, eval/step) when present, else `index`."""
    metrics: dict[str, float]


def _literal(node: ast.AST) -> Any:
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id in ("nan", "inf"):
        return float(node.id)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_literal(node.operand)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "tensor" and node.args:
        return _literal(node.args[0])
    raise ValueError(f"not a literal: {ast.dump(node)[:60]}")


def to_v4rl_metrics(miles: Mapping[str, Any]) -> dict[str, float]:
    """Miles metric names -> ours: identical by design, except eval's flat suffixes and the step axes."""
    out: dict[str, float] = {}
    for key, value in miles.items():
        if key in _STEP_KEYS or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if key.startswith("eval/") and "/" not in key[5:]:
            name = key[5:]
            for suffix in ("-truncated_ratio", "-none_reward_ratio"):
                if name.endswith(suffix):
                    key = f"eval/{name[:-len(suffix)]}/{suffix[1:]}"
                    break
            else:
                key = f"eval/{name}/reward"
        out[key] = float(value)
    return out


def parse_metric_line(line: str) -> MetricRecord | None:
    """A MetricRecord for `[... ] file.py:N - step 12: {...}` style lines (any prefix), else None."""
    m = _RECORD.search(line.rstrip("\n"))
    if not m:
        return None
    try:
        raw = _literal(ast.parse(m.group("body"), mode="eval").body)
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return None
    if not isinstance(raw, dict):
        return None
    index = int(m.group("index"))
    step = next((int(raw[k]) for k in _STEP_KEYS if isinstance(raw.get(k), (int, float)) and not
                 (isinstance(raw[k], float) and math.isnan(raw[k]))), index)
    return MetricRecord(m.group("kind"), index, step, to_v4rl_metrics(raw))
