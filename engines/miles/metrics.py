"""Miles' metric log lines parsed, names kept exactly as Miles emits them, and its eval records read back.

Miles prints one python dict per record through `logging` (format `[time name] file.py:N - <kind> <id>: {...}`,
behind a `(Actor pid=..., ip=...)` prefix when Ray forwards a worker's output):

    step <train step>: {'train/pg_loss': ..., 'train/step': ...}   log_utils.py log_train_step (printed twice:
                                                                     there and again by megatron_utils/model.py)
    critic-step <n>: {...}                                          the same for a PPO critic
    rollout <rollout id>: {'rollout/raw_reward': ...}               trainer side, log_utils.gather_log_data
    perf <rollout id>: {'rollout/response_len/mean': ..., 'perf/rollout_time': ...}   rollout side, and
                      {'perf/actor_train_time': ...}                                  trainer side
    eval <rollout id>: {'eval/<d>': ..., 'eval/<d>-pass@8': np.float64(...), ...}     ray/rollout/metrics.py
    multi_turn <rollout id>: {...}

Values are Python floats, except where numpy computed them: `compute_pass_rate` returns np.float64, which
numpy >= 2 prints as `np.float64(0.25)` (A14), so such calls are read as their argument; `tensor(x)` too.
A line a Ray log dedup folded (` [repeated 3x across cluster]`) still parses.

Names: Miles' own, untouched (DESIGN.md chose ours to be the same). Evaluation names are
`eval/<dataset>` (mean reward), `eval/<dataset>-pass@<k>` (only with `--log-passrate`),
`eval/<dataset>-truncated_ratio`, `eval/<dataset>-none_reward_ratio` (always logged, so it marks a dataset)
and `eval/<dataset>/response_len/<stat>` (A13); `eval_datasets` reads them per dataset.
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_RECORD = re.compile(r"(?:^|[\s\]>:-])(?P<kind>perf|rollout|eval|step|multi_turn|passrate|[a-z]+-step) "
                     r"(?P<index>\d+): (?P<body>\{.*\})\s*(?:\[repeated \d+x across cluster\]\s*)?$")
RAY_JOB_SUBMITTED = re.compile(r"Job '(?P<id>[A-Za-z0-9_\-]+)' submitted successfully")
"""What `ray job submit` prints once the job is accepted: in a Miles log, the start of a (resumed) run."""
_STEP_KEYS = ("train/step", "rollout/step", "eval/step")
_NUMPY_MODULES = ("np", "numpy")
_NUMPY_SCALARS = re.compile(r"^(float|int|uint|bool|complex)(\d+|_)?$|^(double|single|longlong|intc|half)$")
_DATASET_MARK = "-none_reward_ratio"
"""log_eval_rollout_data logs `eval/<dataset>-none_reward_ratio` for every dataset, whatever the flags."""


@dataclass(frozen=True)
class MetricRecord:
    """One metric line of the Miles log (names as Miles emits them)."""

    kind: str
    """perf | rollout | step | eval | multi_turn | passrate | critic-step (the word before the number)."""
    index: int
    """The number after the kind: the rollout id, or the accumulated train step for `step` lines."""
    step: int
    """The record's own step axis (train/step, rollout/step, eval/step) when present, else `index`."""
    metrics: dict[str, float]


def _numpy_scalar(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in _NUMPY_MODULES
            and bool(_NUMPY_SCALARS.match(node.attr)))


def _literal(node: ast.AST) -> Any:
    """A python value from the repr Miles logged; only literals and numeric wrappers, never a call to run."""
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id in ("nan", "inf"):
        return float(node.id)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in _NUMPY_MODULES \
            and node.attr in ("True_", "False_", "nan", "inf"):
        return {"True_": True, "False_": False, "nan": math.nan, "inf": math.inf}[node.attr]
    if isinstance(node, ast.Call) and len(node.args) == 1 and (
            _numpy_scalar(node.func) or (isinstance(node.func, ast.Name) and node.func.id == "tensor")):
        return _literal(node.args[0])  # np.float64(0.5) -> 0.5; tensor(0.5, device='cuda:0') -> 0.5
    raise ValueError(f"not a literal: {ast.dump(node)[:60]}")


def to_v4rl_metrics(miles: Mapping[str, Any]) -> dict[str, float]:
    """The numeric metrics of one record under Miles' own names (ours by design); step axes and text dropped."""
    return {key: float(value) for key, value in miles.items()
            if key not in _STEP_KEYS and not isinstance(value, bool) and isinstance(value, (int, float))}


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


def eval_datasets(metrics: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """{dataset: {"reward", "pass@k"..., "truncated_ratio", "none_reward_ratio", "response_len/mean"...}} of an
    `eval N:` record; datasets are the names Miles logged `eval/<name>-none_reward_ratio` for, so extras such as
    `eval/lag_steps` or `eval/duration_seconds` are never taken for one. Dataset names may contain dashes."""
    names = sorted((k[5:-len(_DATASET_MARK)] for k in metrics if k.startswith("eval/") and k.endswith(_DATASET_MARK)),
                   key=len, reverse=True)  # longest first: "aime-2024" before "aime"
    out: dict[str, dict[str, float]] = {name: {} for name in sorted(names)}
    for key, value in metrics.items():
        if not key.startswith("eval/"):
            continue
        rest = key[5:]
        for name in names:
            if rest == name:
                out[name]["reward"] = value
            elif rest.startswith(name + "/"):
                out[name][rest[len(name) + 1:]] = value
            elif rest.startswith(name + "-"):  # -pass@k, -truncated_ratio, -none_reward_ratio
                out[name][rest[len(name) + 1:]] = value
            else:
                continue
            break
    return out
