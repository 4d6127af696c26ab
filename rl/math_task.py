"""Seeded synthetic math task in DAPO-Math form (``{"prompt": str, "label": str}`` JSONL rows).

What it does
    Builds small addition problems behind a fixed DAPO-style instruction,
    ``"Solve the following math problem. ... Compute 47+38. Answer in \\boxed{}."`` with label
    ``"85"``, for a character-level tokenizer: 141 characters, 129 tokens (``\\boxed{`` is
    one), target completion ``\\boxed{85}`` 10 characters for two-digit operands. The
    instruction makes every sequence longer than 128 tokens, the compression rate of the tiny
    model's HCA layer (as in DeepSeek-V4), so that layer's compressed entry exists for every
    answer token; the problem stays at the end, where the sliding window sees it. The operand
    range is a parameter (default 10..99), so harder or mixed curricula are several calls with
    ``exclude=``. Everything is deterministic for a seed (Python's ``random.Random``, seeded by
    value, independent of ``PYTHONHASHSEED``). Rows are written/read as JSONL, the format
    Miles and :mod:`rl.datasets` load (``--input-key prompt --label-key label``).

How to run
    >>> from rl.math_task import make_splits, parse_prompt, format_answer, write_jsonl
    >>> train, held_out = make_splits(2000, 200, seed=0)
    >>> parse_prompt(train[0]["prompt"]), format_answer(train[0]["label"])  # doctest: +SKIP
    ((47, 38), '\\\\boxed{85}')
    >>> write_jsonl("data/train.jsonl", train)  # doctest: +SKIP

    ``PROMPT_CHARSET`` (or :func:`charset`) lists every character that prompts and target
    completions can contain, for building a character tokenizer.
"""

from __future__ import annotations

import json
import os
import random
import re
import string
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "PROMPT_TEMPLATE",
    "ANSWER_TEMPLATE",
    "PROMPT_CHARSET",
    "charset",
    "make_prompt",
    "parse_prompt",
    "make_problems",
    "make_splits",
    "format_answer",
    "write_jsonl",
    "read_jsonl",
]

PROMPT_TEMPLATE = ("Solve the following math problem. Your response should end with \\boxed{{ANSWER}} where "
                   "ANSWER is the answer. Compute {a}+{b}. Answer in \\boxed{{}}.")
"""Prompt text; ``{a}`` and ``{b}`` are the operands. At least 127 tokens with one-digit operands (128 with BOS),
so that the last prompt position already sees the first 128-token HCA entry (engines/presets/models.py)."""

ANSWER_TEMPLATE = "\\boxed{{{label}}}"
"""Target completion (what the model should emit after the prompt, before EOS)."""


_PROMPT_RE = re.compile(re.escape(PROMPT_TEMPLATE.format(a="\0", b="\1")).replace("\0", r"(-?\d+)", 1)
                        .replace("\1", r"(-?\d+)", 1))
"""Parses a :func:`make_prompt` prompt back into its operands (derived from the template)."""


def charset() -> str:
    """Sorted string of every character a prompt or target completion can contain.

    Digits and ``-`` (negative operands/sums), plus each character of the two templates.
    """
    template_chars = PROMPT_TEMPLATE.format(a="", b="") + ANSWER_TEMPLATE.format(label="")
    return "".join(sorted(set(template_chars) | set(string.digits) | {"-", "+"}))


PROMPT_CHARSET: frozenset[str] = frozenset(charset())


def make_prompt(a: int, b: int) -> str:
    """The prompt for ``a + b``."""
    return PROMPT_TEMPLATE.format(a=a, b=b)


def parse_prompt(prompt: str) -> tuple[int, int] | None:
    """The operands of a :func:`make_prompt` prompt, or None for any other text."""
    match = _PROMPT_RE.fullmatch(prompt)
    return (int(match.group(1)), int(match.group(2))) if match else None


def format_answer(label: str) -> str:
    """Target completion for a label: ``format_answer("85") == "\\\\boxed{85}"`` (no EOS)."""
    return ANSWER_TEMPLATE.format(label=str(label).strip())


def make_problems(
    n: int,
    seed: int,
    *,
    low: int = 10,
    high: int = 99,
    exclude: set[str] | None = None,
) -> list[dict[str, str]]:
    """``n`` distinct problems ``a + b`` with ``a, b`` in ``[low, high]``, deterministic for a seed.

    ``exclude`` holds prompts that must not appear (e.g. a held-out set). Raises
    ``ValueError`` when fewer than ``n`` distinct problems are left in the range.
    """
    if n < 0:
        raise ValueError(f"make_problems: n={n} must be >= 0")
    if low > high:
        raise ValueError(f"make_problems: low={low} > high={high}; pass low <= high")
    exclude = exclude or set()
    pool = (high - low + 1) ** 2
    blocked = _count_in_range(exclude, low, high)
    available = pool - blocked
    if n > available:
        raise ValueError(
            f"make_problems: asked for n={n} distinct problems but operands in "
            f"[{low}, {high}] give only {available} ({pool} pairs, {blocked} excluded); "
            "lower n or widen low/high"
        )
    rng = random.Random(seed)
    rows: list[dict[str, str]] = []
    seen: set[str] = set()
    candidates: Iterable[tuple[int, int]]
    if n * 2 > available:  # dense request: shuffle the whole pool
        pairs = [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
        rng.shuffle(pairs)
        candidates = pairs
    else:  # sparse request: rejection-sample (at least half the pool stays free, so this ends fast)
        candidates = _random_pairs(rng, low, high)
    for a, b in candidates:
        if len(rows) == n:
            break
        prompt = make_prompt(a, b)
        if prompt in seen or prompt in exclude:
            continue
        seen.add(prompt)
        rows.append({"prompt": prompt, "label": str(a + b)})
    return rows


def make_splits(
    n_train: int, n_eval: int, seed: int, *, low: int = 10, high: int = 99
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """``(train_rows, eval_rows)`` with a held-out eval set: no prompt is in both.

    The eval set is drawn first (from a seed derived from ``seed``), then the training set
    from the remaining problems, so the eval set does not change when ``n_train`` does.
    """
    eval_rows = make_problems(n_eval, _derive_seed(seed, "eval"), low=low, high=high)
    eval_prompts = {row["prompt"] for row in eval_rows}
    train_rows = make_problems(
        n_train, _derive_seed(seed, "train"), low=low, high=high, exclude=eval_prompts
    )
    overlap = eval_prompts & {row["prompt"] for row in train_rows}
    if overlap:
        raise AssertionError(
            f"make_splits: train and eval share {len(overlap)} prompts, e.g. {min(overlap)!r}"
        )
    return train_rows, eval_rows


def _random_pairs(rng: random.Random, low: int, high: int) -> Iterator[tuple[int, int]]:
    while True:
        yield rng.randint(low, high), rng.randint(low, high)


def _count_in_range(prompts: set[str], low: int, high: int) -> int:
    """How many of ``prompts`` are addition prompts with both operands in ``[low, high]``."""
    count = 0
    for prompt in prompts:
        operands = parse_prompt(prompt)
        if operands and all(low <= x <= high for x in operands):
            count += 1
    return count


def _derive_seed(seed: int, purpose: str) -> int:
    return random.Random(f"{seed}:{purpose}").getrandbits(63)


def write_jsonl(path: str | os.PathLike[str], rows: Iterable[dict[str, Any]]) -> Path:
    """Write ``rows`` as JSONL atomically (temp file in the same folder, then ``os.replace``)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            for i, row in enumerate(rows):
                try:
                    line = json.dumps(row, ensure_ascii=False)
                except TypeError as exc:
                    raise ValueError(
                        f"write_jsonl {target}: row {i} is not JSON-serialisable ({exc}); "
                        "convert its values to str/int/float/list/dict"
                    ) from exc
                handle.write(line + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp_name, 0o644)  # mkstemp creates 0600; give the file ordinary permissions
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return target


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read a JSONL file of objects; blank lines are skipped.

    Raises ``ValueError("<path>:<line>: ...")`` for a malformed line or a non-object line.
    """
    source = Path(path)
    rows: list[dict[str, Any]] = []
    with source.open(encoding="utf-8-sig") as handle:  # a leading byte-order mark is not part of row 1
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{source}:{lineno}: malformed JSON ({exc.msg} at column {exc.colno}); "
                    "fix or delete this line"
                ) from exc
            if not isinstance(row, dict):
                raise ValueError(
                    f"{source}:{lineno}: expected a JSON object per line, got {type(row).__name__}"
                )
            rows.append(row)
    return rows
