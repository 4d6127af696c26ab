"""Tests for rl.math_task (synthetic task, JSONL I/O) and rl.datasets (local prompt files)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl.datasets import DROP_REASONS, DatasetError, PromptRow, load_prompt_dataset
from rl.math_task import (
    PROMPT_CHARSET,
    charset,
    format_answer,
    make_problems,
    make_prompt,
    make_splits,
    parse_prompt,
    read_jsonl,
    write_jsonl,
)
from rl.rewards import grade

# --------------------------------------------------------------------------- math_task


def test_make_problems_is_deterministic_for_a_seed() -> None:
    assert make_problems(50, seed=3) == make_problems(50, seed=3)
    assert make_problems(50, seed=3) != make_problems(50, seed=4)
    dense = make_problems(8000, seed=3)  # the shuffle path (most of the 8100 pairs)
    assert dense == make_problems(8000, seed=3)
    assert len({row["prompt"] for row in dense}) == 8000


def test_problem_rows_are_dapo_form_and_past_the_hca_rate() -> None:
    from engines.model.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    rows = make_problems(200, seed=0)
    for row in rows:
        assert set(row) == {"prompt", "label"}
        a, b = parse_prompt(row["prompt"])
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert row["label"] == str(a + b)
        assert row["prompt"] == make_prompt(a, b)
        assert row["prompt"].endswith(f"Compute {a}+{b}. Answer in \\boxed{{}}.")
        tokens = len(tokenizer(row["prompt"], add_special_tokens=False).input_ids)
        assert tokens == 129  # + BOS: the last prompt position (129) sees the first 128-token HCA entry
        assert set(row["prompt"] + format_answer(row["label"])) <= PROMPT_CHARSET
    assert len({row["prompt"] for row in rows}) == len(rows)


def test_operand_range_and_exclude() -> None:
    from engines.model.tokenizer import build_tokenizer

    rows = make_problems(20, seed=1, low=100, high=999)
    for row in rows:
        a, b = parse_prompt(row["prompt"])
        assert 100 <= a <= 999 and 100 <= b <= 999
    assert parse_prompt("Compute 1+1.") is None and parse_prompt(make_prompt(-3, 4)) == (-3, 4)
    small = make_problems(4, seed=0, low=1, high=2)  # the whole pool of 4 pairs
    assert len(small) == 4
    with pytest.raises(ValueError, match="only 3"):
        make_problems(4, seed=0, low=1, high=2, exclude={make_prompt(1, 1)})
    keep = make_problems(3, seed=0, low=1, high=2, exclude={make_prompt(1, 1)})
    assert make_prompt(1, 1) not in {row["prompt"] for row in keep}
    shortest = len(build_tokenizer()(make_prompt(1, 1), add_special_tokens=False).input_ids)
    assert shortest + 1 >= 128  # with BOS: even one-digit problems reach the HCA entry
    negative = make_problems(5, seed=0, low=-9, high=-1)
    assert all(set(r["prompt"] + format_answer(r["label"])) <= PROMPT_CHARSET for r in negative)


def test_splits_are_disjoint_and_stable() -> None:
    train, held_out = make_splits(3000, 300, seed=7)
    assert len(train) == 3000 and len(held_out) == 300
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert make_splits(3000, 300, seed=7) == (train, held_out)
    # The held-out set does not depend on the training-set size.
    assert make_splits(100, 300, seed=7)[1] == held_out
    # Every problem can be used: 8100 pairs in 10..99.
    full_train, full_eval = make_splits(8100 - 100, 100, seed=0)
    assert not {r["prompt"] for r in full_train} & {r["prompt"] for r in full_eval}
    with pytest.raises(ValueError, match="lower n or widen"):
        make_splits(8100, 1, seed=0)


def test_format_answer_is_graded_correct() -> None:
    assert format_answer("85") == "\\boxed{85}"
    assert format_answer(" 85 ") == "\\boxed{85}"
    for row in make_problems(20, seed=2):
        completion = format_answer(row["label"])
        assert grade(row["prompt"] + completion, row["label"], literal_only=True).reward == 1.0


def test_charset() -> None:
    chars = charset()
    assert chars == "".join(sorted(set(chars)))
    for needed in "0123456789+-\\{}.boxedCA ":
        assert needed in PROMPT_CHARSET


def test_jsonl_round_trip(tmp_path: Path) -> None:
    rows = make_problems(10, seed=0) + [{"prompt": "π ≈ ?", "label": "3.14"}]
    target = write_jsonl(tmp_path / "sub" / "train.jsonl", rows)
    assert target == tmp_path / "sub" / "train.jsonl"
    assert read_jsonl(target) == rows
    assert [p.name for p in target.parent.iterdir()] == ["train.jsonl"]  # no temp file left


def test_write_jsonl_is_atomic_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "rows.jsonl"
    write_jsonl(target, [{"prompt": "old", "label": "1"}])
    with pytest.raises(ValueError, match="row 1 is not JSON-serialisable"):
        write_jsonl(target, [{"prompt": "new", "label": "1"}, {"prompt": object(), "label": "2"}])
    assert read_jsonl(target) == [{"prompt": "old", "label": "1"}]
    assert [p.name for p in tmp_path.iterdir()] == ["rows.jsonl"]


def test_read_jsonl_names_path_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "label": "1"}\n\n{"prompt": "b", "label": \n')
    with pytest.raises(ValueError) as info:
        read_jsonl(path)
    assert f"{path}:3: malformed JSON" in str(info.value)
    path.write_text('{"prompt": "a", "label": "1"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: expected a JSON object"):
        read_jsonl(path)


# --------------------------------------------------------------------------- datasets

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


def _write_lines(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_load_jsonl_string_and_chat_prompts_int_labels(tmp_path: Path) -> None:
    path = _write_lines(
        tmp_path / "dapo.jsonl",
        [
            {"prompt": "Compute 1+1.", "label": 2},
            {"prompt": CHAT, "label": 4, "metadata": {"source": "x"}},
            {"prompt": "Half of one?", "label": "\\frac{1}{2}"},
        ],
    )
    rows, report = load_prompt_dataset(path)
    assert rows == [
        PromptRow("Compute 1+1.", "2", None, 0),
        PromptRow("What is 2+2?", "4", CHAT, 1),
        PromptRow("Half of one?", "\\frac{1}{2}", None, 2),
    ]
    assert report.n_rows == 3 and report.n_kept == 3 and report.n_dropped == 0
    assert "kept 3 of 3" in report.summary()


def test_load_jsonl_counts_bad_rows(tmp_path: Path) -> None:
    path = _write_lines(
        tmp_path / "mixed.jsonl",
        [
            {"prompt": "ok", "label": 1},  # 0 kept
            {"prompt": "no label"},  # 1 missing_label
            {"prompt": 42, "label": 1},  # 2 prompt_type
            {"prompt": "   ", "label": 1},  # 3 empty_prompt
            {"label": 1},  # 4 missing_prompt
            {"prompt": [{"role": "system", "content": "x"}], "label": 1},  # 5 no_user_message
            {"prompt": [{"role": "user"}], "label": 1},  # 6 bad_messages
            {"prompt": "ok", "label": [1, 2]},  # 7 label_type
            {"prompt": "ok", "label": ""},  # 8 empty_label
            {"prompt": "x" * 50, "label": 1},  # 9 too_long
            {"prompt": "fine", "label": 7.0},  # 10 kept, label "7"
            {"prompt": "no label either", "label": None},  # 11 missing_label
        ],
    )
    rows, report = load_prompt_dataset(path, max_prompt_chars=20)
    assert [(r.source_index, r.label) for r in rows] == [(0, "1"), (10, "7")]
    assert report.n_rows == 12 and report.n_kept == 2 and report.n_dropped == 10
    assert report.dropped == {
        "missing_label": 2,
        "prompt_type": 1,
        "empty_prompt": 1,
        "missing_prompt": 1,
        "no_user_message": 1,
        "bad_messages": 1,
        "label_type": 1,
        "empty_label": 1,
        "too_long": 1,
    }
    assert report.examples["missing_label"] == [1, 11]
    assert set(report.dropped) <= set(DROP_REASONS)
    assert "missing_label=2 (rows 1, 11)" in report.summary()


def test_strict_raises_with_row_and_field(tmp_path: Path) -> None:
    path = _write_lines(
        tmp_path / "strict.jsonl",
        [{"prompt": "ok", "label": 1}, {"prompt": "ok", "label": 2}, {"prompt": 5, "label": 3}],
    )
    with pytest.raises(ValueError) as info:
        load_prompt_dataset(path, strict=True)
    message = str(info.value)
    assert str(path) in message and "row 2" in message and "'prompt'" in message
    assert "strict=False" in message
    # Too-long prompts are a filter, not a data error: strict does not raise for them.
    rows, report = load_prompt_dataset(
        _write_lines(tmp_path / "long.jsonl", [{"prompt": "x" * 9, "label": 1}]),
        strict=True,
        max_prompt_chars=5,
    )
    assert rows == [] and report.dropped == {"too_long": 1}


def test_load_parquet_with_chat_prompts_and_custom_keys(tmp_path: Path) -> None:
    path = tmp_path / "aime.parquet"
    table = pa.table(
        {
            "question": [
                CHAT,
                [{"role": "user", "content": "Find x."}],
                [{"role": "user", "content": ""}],
            ],
            "answer": [4, 17, 3],
        }
    )
    pq.write_table(table, path)
    rows, report = load_prompt_dataset(path, input_key="question", label_key="answer")
    assert [(r.prompt_text, r.label, r.source_index) for r in rows] == [
        ("What is 2+2?", "4", 0),
        ("Find x.", "17", 1),
    ]
    assert rows[0].messages == CHAT
    assert report.dropped == {"empty_prompt": 1} and report.examples["empty_prompt"] == [2]


def test_load_parquet_string_prompts_with_null_label(tmp_path: Path) -> None:
    path = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", None], "label": [1, None, 3]}), path)
    rows, report = load_prompt_dataset(path)
    assert [(r.prompt_text, r.label) for r in rows] == [("a", "1")]
    assert report.dropped == {"missing_label": 1, "missing_prompt": 1}


def test_synthetic_task_file_loads(tmp_path: Path) -> None:
    train, _ = make_splits(50, 10, seed=0)
    rows, report = load_prompt_dataset(write_jsonl(tmp_path / "train.jsonl", train))
    assert [(r.prompt_text, r.label) for r in rows] == [(t["prompt"], t["label"]) for t in train]
    assert report.n_dropped == 0


def test_file_level_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"missing\.jsonl: no such file; check the dataset path"):
        load_prompt_dataset(tmp_path / "missing.jsonl")
    folder = tmp_path / "d.jsonl"
    folder.mkdir()
    with pytest.raises(DatasetError, match=r"d\.jsonl is not a file"):
        load_prompt_dataset(folder)
    (tmp_path / "data.csv").write_text("prompt,label\n")
    with pytest.raises(DatasetError, match=r"data\.csv: unsupported file type"):
        load_prompt_dataset(tmp_path / "data.csv")
    wrong_key = _write_lines(tmp_path / "keys.jsonl", [{"question": "q", "answer": 1}])
    columns = (r"no 'prompt' column and no 'label' column \(columns: \['answer', 'question'\]\); name the "
               r"column\(s\) with --input-key question --label-key answer \(v4rl train; flow parameters "
               r"input_key / label_key\)")
    with pytest.raises(DatasetError, match=columns):
        load_prompt_dataset(wrong_key)
    rows, _ = load_prompt_dataset(wrong_key, input_key="question", label_key="answer")
    assert [(r.prompt_text, r.label) for r in rows] == [("q", "1")]
    only_label = _write_lines(tmp_path / "label.jsonl", [{"prompt": "q", "solution": "1"}])
    with pytest.raises(DatasetError, match=r"no 'label' column .*; name the column\(s\) with --label-key solution "):
        load_prompt_dataset(only_label)
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DatasetError, match=r"bad\.parquet: could not be read as parquet \(\w+"):
        load_prompt_dataset(tmp_path / "bad.parquet")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    rows, report = load_prompt_dataset(empty)
    assert rows == [] and report.n_rows == 0


def test_a_malformed_json_line_is_a_dropped_row_not_a_failed_load(tmp_path: Path, caplog) -> None:
    """One broken line in 101 costs that line (counted, its line number in the warning), as `v4rl train --help`
    says of bad rows; a line that is JSON but not an object likewise. strict=True still stops at it."""
    lines = [json.dumps({"prompt": f"p{i}", "label": i}) for i in range(101)]
    lines[50] = '{"prompt": "p50", "label": 50'  # line 51: the closing brace lost
    lines.insert(80, "")  # a blank line is no row
    lines.append("[1, 2]")
    path = tmp_path / "big.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with caplog.at_level("WARNING", logger="rl.datasets"):
        rows, report = load_prompt_dataset(path)
    assert (report.n_rows, report.n_kept, report.dropped) == (102, 100, {"malformed_json": 2})
    assert report.examples["malformed_json"] == [50, 101]
    assert 50 not in [r.source_index for r in rows] and rows[50].label == "51"
    warned = [r.getMessage() for r in caplog.records]
    assert any("row 50 (0-based) dropped [malformed_json]: line 51: malformed JSON" in m for m in warned), warned
    assert any("line 103: a JSON list, expected an object per line" in m for m in warned), warned
    with pytest.raises(DatasetError, match=r"big\.jsonl: row 50 \(0-based\), line 51: malformed JSON"):
        load_prompt_dataset(path, strict=True)


def test_json_array_files_and_json_lines_with_a_json_suffix_load(tmp_path: Path) -> None:
    array = tmp_path / "rows.json"
    array.write_text(json.dumps([{"prompt": "a", "label": 1}, "oops", {"prompt": "b", "label": 2.0}]))
    rows, report = load_prompt_dataset(array)
    assert [(r.prompt_text, r.label) for r in rows] == [("a", "1"), ("b", "2")]
    assert report.dropped == {"malformed_json": 1}
    lines = tmp_path / "lines.json"
    lines.write_text('{"prompt": "a", "label": "x\u2028y"}\n{"prompt": "b", "label": 3}\n')
    rows, report = load_prompt_dataset(lines)
    assert [r.label for r in rows] == ["x\u2028y", "3"] and report.n_dropped == 0


def test_a_byte_order_mark_is_not_part_of_the_first_row(tmp_path: Path) -> None:
    # Excel and Notepad save "UTF-8" with a BOM; json.loads refuses it ("decode using utf-8-sig"), so the first row
    # used to be dropped as malformed_json
    rows = [{"prompt": "a", "label": 1}, {"prompt": "b", "label": 2}]
    lines = tmp_path / "bom.jsonl"
    lines.write_bytes(b"\xef\xbb\xbf" + "\n".join(json.dumps(r) for r in rows).encode())
    kept, report = load_prompt_dataset(lines)
    assert [(r.prompt_text, r.label) for r in kept] == [("a", "1"), ("b", "2")] and report.n_dropped == 0
    array = tmp_path / "bom.json"
    array.write_bytes(b"\xef\xbb\xbf" + json.dumps(rows).encode())
    assert [r.prompt_text for r in load_prompt_dataset(array)[0]] == ["a", "b"]
    assert read_jsonl(lines) == rows

