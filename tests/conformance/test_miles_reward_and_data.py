"""The user's data and reward against Miles' own code (pinned Miles, run on CPU in a subprocess).

  - Miles' `Dataset` (`--input-key prompt --label-key label`, what the cluster run reads) loads the same DAPO-format
    file rl/datasets.py loads, with the same message lists and the same labels (ours as strings);
  - Miles' `--rm-type math` grader (`grade_answer_verl`, the one its DeepSeek-V4 launcher uses) and v4rl's
    `math-verify` grader agree on every case below except the ones pinned in DISAGREE: Miles refuses an
    unevaluated expression for an integer label and an unreduced fraction, math-verify compares values. A change
    on either side (a new Miles pin, a new math-verify) fails here naming the case.

    .venv/bin/python -m pytest tests/conformance/test_miles_reward_and_data.py -q
"""

from __future__ import annotations

import json

from engines.upstream.sources import engine_python
from engines.upstream.stubs import GPU_ONLY_ROOTS
from rl.datasets import load_prompt_dataset
from rl.reward_spec import resolve_reward

# Miles main imports this module of its own SGLang branch (sglang-miles), which upstream SGLang 0.5.23 lacks.
MILES_STUB_ROOTS = (*GPU_ONLY_ROOTS, "sglang.srt.entrypoints.openai.encoding_dsv4")

CASES = [
    ("\\boxed{85}", "85"), ("The answer is \\boxed{85}.", "85"), ("\\boxed{84}", "85"), ("85", "85"),
    ("\\boxed{34}", "34"), ("\\boxed{034}", "34"), ("\\boxed{-3}", "-3"), ("\\boxed{+5}", "5"), ("\\boxed{5.0}", "5"),
    ("\\boxed{1,000}", "1000"), ("\\boxed{1000}", "1,000"), ("\\boxed{1 000}", "1000"),
    ("\\boxed{\\frac{1}{2}}", "0.5"), ("\\boxed{0.5}", "\\frac{1}{2}"), ("\\boxed{\\dfrac12}", "\\frac{1}{2}"),
    ("\\boxed{5\\text{ cm}}", "5"), ("\\boxed{85\\%}", "85"), ("\\boxed{(1,2)}", "(1,2)"),
    ("\\boxed{\\left(1,2\\right)}", "(1,2)"), ("\\boxed{3\\sqrt{2}}", "\\sqrt{18}"), ("\\boxed{x=3}", "3"),
    ("\\boxed{\\pi}", "\\pi"), ("\\boxed{47+38}", "85"), ("\\boxed{\\sqrt{4}}", "2"), ("\\boxed{2/4}", "\\frac{1}{2}"),
]
DISAGREE = {("\\boxed{47+38}", "85"): (0.0, 1.0), ("\\boxed{\\sqrt{4}}", "2"): (0.0, 1.0),
            ("\\boxed{2/4}", "\\frac{1}{2}"): (0.0, 1.0)}
"""(Miles --rm-type math, v4rl math-verify) where they differ."""


def _miles(code: str, miles_tree, sglang_paths, *args: str) -> object:
    done = engine_python(code, [miles_tree, *sglang_paths], args=args, stub_roots=MILES_STUB_ROOTS, timeout=600)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_miles_math_grader_and_ours_agree_except_where_pinned(miles_tree, sglang_paths, tmp_path):
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps(CASES))
    code = """
import json, sys
from miles.rollout.rm_hub.math_utils import grade_answer_verl
cases = json.load(open(sys.argv[1]))
print(json.dumps([1.0 if grade_answer_verl(response, label) else 0.0 for response, label in cases]))
"""
    miles = _miles(code, miles_tree, sglang_paths, str(cases))
    ours = resolve_reward("math-verify").fn
    found = {case: (theirs, ours(*case)) for case, theirs in zip(CASES, miles) if theirs != ours(*case)}
    assert found == DISAGREE


def test_miles_dataset_reads_a_dapo_file_as_rl_datasets_does(miles_tree, sglang_paths, tmp_path):
    rows = [{"prompt": [{"role": "system", "content": "Answer briefly."},
                        {"role": "user", "content": "Compute 12+30. Answer in \\boxed{}."}], "label": 42},
            {"prompt": [{"role": "user", "content": "Compute 25+17. Answer in \\boxed{}."}], "label": 42,
             "metadata": {"source": "test"}},
            {"prompt": [{"role": "user", "content": "Half of one?"}], "label": "\\frac{1}{2}"}]
    path = tmp_path / "dapo.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = """
import json, sys
from miles.utils.data import Dataset
data = Dataset(sys.argv[1], tokenizer=None, processor=None, max_length=None, prompt_key="prompt", label_key="label")
print(json.dumps([[sample.prompt, sample.label] for sample in data.samples]))
"""
    miles = _miles(code, miles_tree, sglang_paths, str(path))
    ours, report = load_prompt_dataset(path)
    assert report.n_kept == len(rows) == len(miles)
    assert [row.messages for row in ours] == [prompt for prompt, _ in miles]
    assert [row.label for row in ours] == [str(label) for _, label in miles]
    assert [row.prompt_text for row in ours] == [prompt[-1]["content"] for prompt, _ in miles]
