"""`v4rl train` as a user reads it, through the real command in a child process (issue 40): each held-out
evaluation printed as it lands, a summary at the end with the report, plots and checkpoints (written and named),
and a warning when the held-out prompts are training prompts (the same file given as --train-data and --eval-data).
Half a minute on a loaded 2-core machine.

    .venv/bin/python -m pytest tests/test_train_cli.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "rl" / "sample_math.jsonl"


def test_train_prints_evals_as_they_land_a_summary_and_warns_when_eval_data_is_train_data(tmp_path, tiny_base):
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "v4rl.cli", "train", "--out", str(out), "--steps", "2", "--no-ray",
         "--prompts-per-step", "4", "--n-samples", "2", "--n-eval", "4", "--eval-interval", "1",
         "--train-data", str(SAMPLE), "--eval-data", str(SAMPLE)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "400"}, capture_output=True, text=True,
        timeout=600)
    text = result.stdout
    assert result.returncode == 0 and "Traceback" not in result.stderr, text + result.stderr
    lines = text.splitlines()

    warning = [x for x in lines if x.startswith("warning: 4 of the 4 held-out prompts")]
    assert len(warning) == 1 and f"--eval-data {SAMPLE}" in warning[0] and f"--train-data {SAMPLE}" in warning[0], text

    def at(prefix: str) -> int:
        found = [i for i, x in enumerate(lines) if x.startswith(prefix)]
        assert len(found) == 1, (prefix, text)
        return found[0]

    # each evaluation as it lands, after its step's line and before the next step's
    assert at("eval step 0: pass@1 ") < at("step 1: reward") < at("eval step 1: pass@1 ") < at("step 2: reward") \
        < at("eval step 2: pass@1 ") < at("summary:"), text
    assert " ± " in lines[at("eval step 2: ")] and "pass@8 " in lines[at("eval step 2: ")], text

    summary = lines[at("summary:"):]
    assert any(x.startswith("  held-out pass@1: step 0 ") and " -> step 2 " in x for x in summary), summary
    assert f"  report: {out / 'report.md'}" in summary and (out / "report.md").is_file(), summary
    (plots,) = [x for x in summary if x.startswith("  plots: ")]
    assert all(Path(p).is_file() for p in plots.removeprefix("  plots: ").split(", ")), plots
    assert f"  checkpoints: {out / 'checkpoints'} (latest: step 2)" in summary, summary
    assert "4 of the 4 held-out prompts" in (out / "report.md").read_text()  # recorded in events.jsonl, reported
