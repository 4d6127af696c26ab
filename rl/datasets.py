"""Load prompt/label datasets (DAPO-Math-17K, AIME-2024, our synthetic task) from local files.

What it does
    ``load_prompt_dataset(path)`` reads a local ``.jsonl``/``.json`` or ``.parquet`` file with
    the Hugging Face ``datasets`` library (``load_dataset("json" | "parquet", data_files=...)``;
    never the Hub) and returns ``(rows, report)``: a list of :class:`PromptRow` and a
    :class:`DatasetReport`. The format is the one Miles reads (``--input-key prompt
    --label-key label``): ``prompt`` is a string or an OpenAI-style message list
    ``[{"role": "user", "content": ...}]`` (kept as ``messages``; ``prompt_text`` is the last
    user message), ``label`` is the answer, often an int in the file (returned as ``str``;
    integral floats such as ``34.0`` become ``"34"``).

    Bad rows do not crash a load: they are dropped and counted per reason in the report
    (with the first few 0-based row indices), or, with ``strict=True``, the first one raises
    ``ValueError`` naming the file, row and field. ``max_prompt_chars`` drops over-long
    prompts (counted as ``too_long``; a filter, so it never raises, even when strict).
    File-level problems (missing file, unknown extension, no such column, malformed JSON
    line) always raise with the path (and line) in the message.

How to run
    >>> from rl.datasets import load_prompt_dataset
    >>> rows, report = load_prompt_dataset(  # doctest: +SKIP
    ...     "dapo-math-17k.jsonl", max_prompt_chars=4000
    ... )
    >>> print(report.summary())  # doctest: +SKIP

Note: this module is ``rl.datasets``; it imports the Hugging Face library as
``import datasets as hf_datasets``, which works as long as the ``rl/`` folder itself is not
on ``sys.path`` (import it as ``rl.datasets``).
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets as hf_datasets

from rl.math_task import read_jsonl

__all__ = ["PromptRow", "DatasetReport", "load_prompt_dataset", "DROP_REASONS"]

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
}
"""Every reason a row can be dropped for, with what it means."""

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

    def add_drop(self, reason: str, index: int) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        rows = self.examples.setdefault(reason, [])
        if len(rows) < _EXAMPLES_PER_REASON:
            rows.append(index)

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
    columns = set().union(*(r.keys() for r in records)) if records else set()
    for key, option in ((input_key, "input_key"), (label_key, "label_key")):
        if records and key not in columns:
            raise ValueError(
                f"{source}: no {key!r} column (columns: {sorted(columns)}); "
                f"pass {option}= with the right column name"
            )
    report = DatasetReport(path=str(source), n_rows=len(records))
    rows: list[PromptRow] = []
    for index, record in enumerate(records):
        try:
            prompt_text, messages = _prompt(record.get(input_key))
            label = _label(record.get(label_key))
        except _BadRow as bad:
            field_name = input_key if bad.field_name == "prompt" else label_key
            if strict:
                raise ValueError(
                    f"{source}: row {index} (0-based), field {field_name!r}: {bad.detail} "
                    f"[{bad.reason}]; fix the row, or load with strict=False to skip bad rows"
                ) from None
            report.add_drop(bad.reason, index)
            continue
        if max_prompt_chars is not None:
            length = _prompt_chars(prompt_text, messages)
            if length > max_prompt_chars:
                report.add_drop("too_long", index)
                continue
        rows.append(PromptRow(prompt_text, label, messages, index))
    report.n_kept = len(rows)
    return rows, report


# --------------------------------------------------------------------------- file reading


def _read_records(source: Path) -> list[dict[str, Any]]:
    fmt = _FORMATS.get(source.suffix.lower())
    if fmt is None:
        raise ValueError(
            f"{source}: unsupported file type {source.suffix!r}; use one of {sorted(_FORMATS)}"
        )
    if not source.is_file():
        raise FileNotFoundError(f"{source}: no such file; check the dataset path")
    if source.stat().st_size == 0:
        return []
    progress_was_on = hf_datasets.is_progress_bar_enabled()
    hf_datasets.disable_progress_bars()
    try:
        # A throw-away cache directory: local files only, nothing left behind, never stale.
        with tempfile.TemporaryDirectory(prefix="v4rl-datasets-") as cache_dir:
            dataset = hf_datasets.load_dataset(
                fmt,
                data_files=str(source),
                split="train",
                cache_dir=cache_dir,
                keep_in_memory=True,
            )
            return dataset.to_list()
    except Exception as exc:
        if fmt == "json" and source.suffix.lower() == ".jsonl":
            read_jsonl(source)  # raises "<path>:<line>: ..." naming the first bad line
        raise ValueError(f"{source}: could not be read as {fmt}: {exc}") from exc
    finally:
        if progress_was_on:
            hf_datasets.enable_progress_bars()


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
