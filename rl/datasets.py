"""Load prompt/label datasets (DAPO-Math-17K, AIME-2024, our synthetic task) from local files.

What it does
    ``load_prompt_dataset(path)`` reads a local ``.jsonl``/``.json`` file (line by line, with
    the standard ``json`` module) or a ``.parquet`` file (pyarrow) and returns ``(rows,
    report)``: a list of :class:`PromptRow` and a :class:`DatasetReport`. The format is the one
    Miles reads (``--input-key prompt --label-key label``; other column names through
    ``input_key=`` / ``label_key=``): ``prompt`` is a string or an OpenAI-style message list
    ``[{"role": "user", "content": ...}]`` (kept as ``messages``; ``prompt_text`` is the last
    user message), ``label`` is the answer, often an int in the file (returned as ``str``;
    integral floats such as ``34.0`` become ``"34"``).

    Bad rows do not crash a load: they are dropped and counted per reason in the report
    (with the first few 0-based row indices), or, with ``strict=True``, the first one raises
    ``ValueError`` naming the file, row and field. A line of a JSON-lines file that is not
    valid JSON, or not a JSON object, is such a bad row (``malformed_json``, the message names
    its line number): one broken line in a large file costs that line, not the run.
    ``max_prompt_chars`` drops over-long prompts (counted as ``too_long``; a filter, so it
    never raises, even when strict). File-level problems (missing file, unknown extension, no
    such column, an unreadable parquet file) raise :class:`DatasetError` (a ``ValueError``)
    with the path in a one-line message. The first few drops of each reason are logged as
    warnings naming the file, the 0-based row and what is wrong.

    ``load_encoded_prompts(path, encode, context_length=..., max_new_tokens=..., min_rows=...)``
    is what a run uses: the same load, then each prompt tokenized with ``encode``; a prompt whose
    tokens plus ``max_new_tokens`` exceed the model's context length is dropped as
    ``over_context``. Fewer than ``min_rows`` usable rows (an empty file, every row bad) raise
    :class:`DatasetError` naming the file, the counts per reason and the fix.

How to run
    >>> from rl.datasets import load_prompt_dataset
    >>> rows, report = load_prompt_dataset(  # doctest: +SKIP
    ...     "dapo-math-17k.jsonl", max_prompt_chars=4000
    ... )
    >>> print(report.summary())  # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

__all__ = ["PromptRow", "DatasetReport", "DatasetError", "EncodedPrompts", "load_prompt_dataset",
           "load_encoded_prompts", "DROP_REASONS", "SAMPLE_DATA"]

log = logging.getLogger(__name__)

DROP_REASONS = {
    "missing_prompt": "the prompt field is missing or null",
    "prompt_type": "the prompt is neither a string nor a list of messages",
    "bad_messages": "the prompt list has an entry that is not {'role': str, 'content': str}",
    "no_user_message": "the prompt list has no message with role 'user'",
    "empty_prompt": "the prompt (last user message) is empty",
    "missing_label": "the label field is missing, null or NaN",
    "label_type": "the label is not a string or number",
    "empty_label": "the label is an empty string",
    "too_long": "the prompt is longer than max_prompt_chars",
    "over_context": "the prompt's tokens plus max_new_tokens exceed the model's context length",
    "malformed_json": "the line is not valid JSON, or not a JSON object",
}
"""Every reason a row can be dropped for, with what it means."""

SAMPLE_DATA = Path(__file__).resolve().with_name("sample_math.jsonl")
"""256 rows in the working format and wording (the synthetic addition task's training split, seed 0): what
`v4rl train --train-data` reads and the tiny base gets a non-zero reward on. The tiny base solves only this
wording; a DAPO-style prompt gets reward 0 on every sample, so no step has a learning signal."""

_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_EXAMPLES_PER_REASON = 5


@dataclass(frozen=True)
class PromptRow:
    """One usable prompt: the text, its gold label, the chat messages if any, the file row index."""

    prompt_text: str
    label: str
    messages: list[dict[str, Any]] | None
    source_index: int


@dataclass
class DatasetReport:
    """What a load kept and dropped; ``dropped`` counts rows per reason (see ``DROP_REASONS``)."""

    path: str
    n_rows: int = 0
    n_kept: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[int]] = field(default_factory=dict)

    @property
    def n_dropped(self) -> int:
        return sum(self.dropped.values())

    def add_drop(self, reason: str, index: int, detail: str = "") -> None:
        """Count a dropped row; the first few of each reason are kept as examples and logged."""
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        rows = self.examples.setdefault(reason, [])
        if len(rows) < _EXAMPLES_PER_REASON:
            rows.append(index)
            log.warning("%s: row %d (0-based) dropped [%s]: %s", self.path, index, reason,
                        detail or DROP_REASONS.get(reason, reason))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready counts (for events.jsonl and reports)."""
        return {"path": self.path, "n_rows": self.n_rows, "n_kept": self.n_kept, "n_dropped": self.n_dropped,
                "dropped": dict(sorted(self.dropped.items())),
                "examples": {k: list(v) for k, v in sorted(self.examples.items())}}

    def summary(self) -> str:
        """One human-readable paragraph, e.g. for logs and Prefect artifacts."""
        text = f"{self.path}: kept {self.n_kept} of {self.n_rows} rows"
        if self.dropped:
            parts = [
                f"{reason}={count} (rows {', '.join(map(str, self.examples.get(reason, [])))})"
                for reason, count in sorted(self.dropped.items())
            ]
            text += "; dropped " + "; ".join(parts)
        return text


class _BadRow(Exception):
    def __init__(self, reason: str, field_name: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.field_name = field_name
        self.detail = detail


def load_prompt_dataset(
    path: str | os.PathLike[str],
    *,
    input_key: str = "prompt",
    label_key: str = "label",
    max_prompt_chars: int | None = None,
    strict: bool = False,
) -> tuple[list[PromptRow], DatasetReport]:
    """Load a local JSONL/parquet prompt file; returns ``(rows, report)`` (see the module doc)."""
    source = Path(path)
    records = _read_records(source)
    _check_columns(source, [r for r in records if isinstance(r, dict)], input_key, label_key)
    report = DatasetReport(path=str(source), n_rows=len(records))
    rows: list[PromptRow] = []
    for index, record in enumerate(records):
        try:
            if isinstance(record, _Malformed):
                raise _BadRow("malformed_json", "line", f"line {record.line}: {record.detail}")
            prompt_text, messages = _prompt(record.get(input_key))
            label = _label(record.get(label_key))
        except _BadRow as bad:
            field_name = {"prompt": input_key, "label": label_key}.get(bad.field_name)
            where = f"field {field_name!r}: " if field_name else ""
            if strict:
                raise DatasetError(
                    f"{source}: row {index} (0-based), {where}{bad.detail} "
                    f"[{bad.reason}]; fix the row, or load with strict=False to skip bad rows"
                ) from None
            report.add_drop(bad.reason, index, f"{where}{bad.detail}")
            continue
        if max_prompt_chars is not None:
            length = _prompt_chars(prompt_text, messages)
            if length > max_prompt_chars:
                report.add_drop("too_long", index, f"{length} characters > max_prompt_chars={max_prompt_chars}")
                continue
        rows.append(PromptRow(prompt_text, label, messages, index))
    report.n_kept = len(rows)
    return rows, report


# Column names data sets commonly use instead of Miles' prompt / label, for the hint in the error.
_LIKELY_COLUMNS = {"input_key": ("question", "problem", "prompt", "messages", "query", "input", "instruction"),
                   "label_key": ("answer", "solution", "label", "ground_truth", "final_answer", "target")}


def _check_columns(source: Path, records: list[dict[str, Any]], input_key: str, label_key: str) -> None:
    """DatasetError naming the missing column(s), the columns the file has and the options that pick others."""
    if not records:
        return
    columns = set().union(*(r.keys() for r in records))
    missing = [(key, option) for key, option in ((input_key, "input_key"), (label_key, "label_key"))
               if key not in columns]
    if not missing:
        return
    fix = []
    for _, option in missing:
        guess = next((c for c in _LIKELY_COLUMNS[option] if c in columns and c not in (input_key, label_key)), None)
        fix.append(f"--{option.replace('_', '-')} {guess or 'COLUMN'}")
    raise DatasetError(
        f"{source}: " + " and ".join(f"no {key!r} column" for key, _ in missing) + f" (columns: {sorted(columns)}); "
        f"name the column(s) with {' '.join(fix)} (v4rl train; flow parameters "
        + " / ".join(option for _, option in missing) + ")")


class DatasetError(ValueError):
    """A dataset file cannot serve the run (missing, unreadable, without the named column, too few usable rows);
    the one-line message names the file and the fix. A ValueError: Prefect's tasks do not retry it."""


@dataclass(frozen=True)
class EncodedPrompts:
    """Usable rows of a dataset file, tokenized: prompt ids, labels, file row indices, and the load report."""

    prompt_ids: list[list[int]]
    labels: list[str]
    source_indices: list[int]
    report: DatasetReport


def load_encoded_prompts(
    path: str | os.PathLike[str],
    encode: Callable[[str], list[int]],
    *,
    context_length: int,
    max_new_tokens: int,
    min_rows: int = 1,
    max_rows: int | None = None,
    what: str = "dataset",
    needed_by: str = "",
    input_key: str = "prompt",
    label_key: str = "label",
) -> EncodedPrompts:
    """Load a prompt file for a run: drop bad rows (counted per reason), tokenize, drop over-context prompts.

    ``what`` names the setting the file came from (e.g. ``"train_data"``) and ``needed_by`` the setting that
    asks for ``min_rows`` (e.g. ``"prompts_per_step=64"``); both appear in the error. ``max_rows`` keeps the
    first that many usable rows (a held-out set of fixed size).
    """
    room = context_length - max_new_tokens
    if room < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the context length "
                         f"{context_length}; lower max_new_tokens")
    rows, report = load_prompt_dataset(path, input_key=input_key, label_key=label_key)
    ids: list[list[int]] = []
    labels: list[str] = []
    indices: list[int] = []
    for row in rows:
        tokens = list(encode(row.prompt_text))
        if len(tokens) > room:
            report.add_drop("over_context", row.source_index,
                            f"{len(tokens)} prompt tokens + max_new_tokens={max_new_tokens} > context length "
                            f"{context_length}")
            continue
        ids.append(tokens)
        labels.append(row.label)
        indices.append(row.source_index)
    report.n_kept = len(ids)
    _require_rows(report, min_rows, what, needed_by)
    if max_rows is not None:
        ids, labels, indices = ids[:max_rows], labels[:max_rows], indices[:max_rows]
    return EncodedPrompts(ids, labels, indices, report)


def _require_rows(report: DatasetReport, min_rows: int, what: str, needed_by: str) -> None:
    if report.n_kept >= min_rows:
        return
    if report.n_rows == 0:
        state = "has no rows"
    elif report.n_kept == 0:
        state = f"has no usable row: all {report.n_rows} were dropped"
    else:
        state = f"has only {report.n_kept} usable rows of {report.n_rows}"
    reasons = "; ".join(f"{r}: {DROP_REASONS.get(r, r)}" for r in sorted(report.dropped))
    need = f" ({needed_by})" if needed_by else ""
    raise DatasetError(
        f"{report.path}: {what} {state}, and the run needs at least {min_rows}{need}. {report.summary()}"
        + (f" [{reasons}]" if reasons else "")
        + f". Fix or remove the dropped rows, point {what} at a file with enough rows"
        + (f", or lower {needed_by.split('=')[0]}" if needed_by else "") + ".")


# --------------------------------------------------------------------------- file reading


@dataclass(frozen=True)
class _Malformed:
    """A line of a JSON-lines file that is not a JSON object: a bad row like any other (``malformed_json``)."""

    line: int
    detail: str


def _read_records(source: Path) -> list[dict[str, Any] | _Malformed]:
    fmt = _FORMATS.get(source.suffix.lower())
    if fmt is None:
        raise DatasetError(f"{source}: unsupported file type {source.suffix!r}; use one of {sorted(_FORMATS)}")
    if not source.exists():
        raise DatasetError(f"{source}: no such file; check the dataset path")
    if not source.is_file():
        raise DatasetError(f"{source} is not a file; give the path of a {', '.join(sorted(_FORMATS))} file")
    if source.stat().st_size == 0:
        return []
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(source).to_pylist()
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a damaged file
            raise DatasetError(f"{source}: could not be read as parquet ({type(exc).__name__}: "
                               f"{str(exc).splitlines()[0] if str(exc) else ''}); check the file") from None
    try:  # utf-8-sig: a leading byte-order mark (Excel, Notepad) is not part of the first row
        text = source.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{source}: not UTF-8 text at byte {exc.start}; give a JSON-lines (.jsonl), JSON or "
                           "parquet file") from None
    if source.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:  # a .json file holding one array of row objects
            whole = json.loads(text)
        except json.JSONDecodeError:
            pass  # read it as JSON lines: each broken line is one bad row
        else:
            return [row if isinstance(row, dict) else _Malformed(i + 1, f"entry {i} is a {type(row).__name__}, "
                                                                        "expected a JSON object")
                    for i, row in enumerate(whole)]
    return _json_lines(text)


def _json_lines(text: str) -> list[dict[str, Any] | _Malformed]:
    """One record per non-blank line (as datasets' json loader counts rows): an object, or _Malformed."""
    records: list[dict[str, Any] | _Malformed] = []
    for lineno, line in enumerate(text.split("\n"), start=1):  # not splitlines: U+2028 may sit inside a string
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            records.append(_Malformed(lineno, f"malformed JSON ({exc.msg} at column {exc.colno}); fix or delete "
                                              "this line"))
            continue
        records.append(row if isinstance(row, dict) else
                       _Malformed(lineno, f"a JSON {type(row).__name__}, expected an object per line"))
    return records


# --------------------------------------------------------------------------- field checks


def _prompt(value: Any) -> tuple[str, list[dict[str, Any]] | None]:
    if value is None:
        raise _BadRow("missing_prompt", "prompt", "prompt is missing or null")
    if isinstance(value, str):
        if not value.strip():
            raise _BadRow("empty_prompt", "prompt", "prompt is an empty string")
        return value, None
    if isinstance(value, list):
        for i, message in enumerate(value):
            if not (
                isinstance(message, dict)
                and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)
            ):
                raise _BadRow(
                    "bad_messages",
                    "prompt",
                    f"message {i} is {message!r:.80}, expected {{'role': str, 'content': str}}",
                )
        users = [m for m in value if m["role"] == "user"]
        if not users:
            raise _BadRow("no_user_message", "prompt", "no message has role 'user'")
        text = users[-1]["content"]
        if not text.strip():
            raise _BadRow("empty_prompt", "prompt", "the last user message is empty")
        return text, [dict(m) for m in value]
    raise _BadRow(
        "prompt_type",
        "prompt",
        f"prompt is a {type(value).__name__} ({value!r:.60}), expected a string or a message list",
    )


def _label(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        raise _BadRow("missing_label", "label", "label is missing, null or NaN")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise _BadRow(
            "label_type",
            "label",
            f"label is a {type(value).__name__} ({value!r:.60}), expected a string or number",
        )
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    text = str(value).strip()
    if not text:
        raise _BadRow("empty_label", "label", "label is an empty string")
    return text


def _prompt_chars(prompt_text: str, messages: list[dict[str, Any]] | None) -> int:
    """Prompt length in characters: the string, or all message contents together."""
    if messages is None:
        return len(prompt_text)
    return sum(len(m["content"]) for m in messages)
