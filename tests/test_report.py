"""The run report and what the demo prints (issue 21, items 10-12): the reward plot smooths over at least 5 steps,
the logprob-difference plot draws the run's mismatch_threshold, legends sit below the axes (never over the points),
pass@k carries one standard error over the problems (JSON, table, error bars, the demo's summary), small numbers
are written in scientific notation (never 0.0000), the alignment artifact is markdown tables (no Python dict), the
demo's UI-less server gets no "View at" links, and the FP8 / math-verify warnings that do not apply to a CPU run
are not printed.

    .venv/bin/python -m pytest tests/test_report.py -q
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

import engines.runs.report as report
from rl.passk import mean_pass_at_k, pass_at_k_stderr

REPO = Path(__file__).resolve().parent.parent


def _run_dir(root: Path, *, steps: int = 10, stderr: bool = True) -> Path:
    """A run directory as a 10-step demo leaves it: metrics, three evaluations, config.json."""
    rng = random.Random(0)
    (root / "eval").mkdir(parents=True)
    rows = [{"step": s, "rollout/raw_reward": 0.4 + 0.01 * s + rng.gauss(0, 0.05),
             "train/train_rollout_logprob_abs_diff": 0.0045 - 2e-5 * s + rng.gauss(0, 2e-4)} for s in range(1, steps + 1)]
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for step, p1 in ((0, 0.277), (steps // 2, 0.305), (steps, 0.283)):
        result = {"step": step, "n_problems": 64, "n_samples": 8, "truncated_ratio": 0.0}
        for k, lift in ((1, 0.0), (2, 0.12), (4, 0.25), (8, 0.4)):
            result[f"pass@{k}"] = p1 + lift
            if stderr:
                result[f"pass@{k}_stderr"] = 0.03 + 0.002 * k
        (root / "eval" / f"step_{step:06d}.json").write_text(json.dumps(result))
    (root / "config.json").write_text(json.dumps({"mismatch_threshold": 0.09}))
    return root


@pytest.fixture
def figures(monkeypatch):
    """Each figure the report draws, kept (with its axes) instead of only saved and closed."""
    kept = {}
    save = report._save

    def keep(fig, path):
        fig.canvas.draw()
        fig.legend_below_axes = _legend_below_axes(fig)  # while the Agg canvas is attached (closing detaches it)
        kept[path.stem] = fig
        return save(fig, path)

    monkeypatch.setattr(report, "_save", keep)
    return kept


def _legend_below_axes(fig) -> bool:
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    return ax.get_legend().get_window_extent(renderer).y1 <= ax.get_window_extent(renderer).y0


def test_plots_smooth_draw_the_threshold_and_keep_legends_off_the_data(tmp_path, figures):
    run = _run_dir(tmp_path / "run")
    out = report.write_report(run)
    assert set(out["plots"]) == {"reward", "logprob_diff", "pass_at_k"}

    reward = figures["reward"].axes[0]
    smoothed = [line for line in reward.get_lines() if "moving average" in line.get_label()]
    assert smoothed and smoothed[0].get_label().startswith("moving average (5 steps")
    raw = [line for line in reward.get_lines() if line.get_label() == "per step"][0]
    assert list(smoothed[0].get_ydata()) != list(raw.get_ydata())  # a window of 1 would copy the series

    diff = figures["logprob_diff"].axes[0]
    limit = [line for line in diff.get_lines() if "mismatch_threshold" in line.get_label()]
    assert limit and set(limit[0].get_ydata()) == {0.09}
    assert diff.get_ylim()[1] >= 0.09 and diff.get_ylim()[0] > 0  # line and data both in view (log axis here)

    passk = figures["pass_at_k"].axes[0]
    assert "64 problems x 8 samples" in passk.get_title() and "standard error" in passk.get_title()
    assert len(passk.containers) == 4 and all(c.has_yerr for c in passk.containers)  # error bars per pass@k
    for name in ("reward", "logprob_diff", "pass_at_k"):
        assert figures[name].legend_below_axes, name


def test_plots_of_a_short_run_tick_whole_steps_only(tmp_path, figures):
    report.write_report(_run_dir(tmp_path / "run", steps=3))  # matplotlib's default puts ticks at 1.0, 1.5, 2.0
    for name in ("reward", "logprob_diff", "pass_at_k"):
        ax = figures[name].axes[0]
        low, high = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if low <= t <= high]
        assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), (name, ticks)


def test_report_numbers_are_never_rounded_to_zero_and_carry_their_noise(tmp_path):
    run = _run_dir(tmp_path / "run")
    markdown = report.write_report(run)["markdown"]
    slope = report.summarize(run)["logprob_abs_diff_slope"]
    assert abs(slope) < 1e-3 and f"| logprob_abs_diff_slope | {slope:.1e} |" in markdown
    assert "| 0.0000 |" not in markdown and "-0.0000" not in markdown
    assert "| step | problems x samples | pass@1 | pass@2 | pass@4 | pass@8 | truncated_ratio |" in markdown
    assert "| 0 | 64 x 8 | 0.277 ± 0.032 | 0.397 ± 0.034 |" in markdown
    assert "± is one standard error over the held-out problems" in markdown
    assert report.smoothing_window(10) == 5 and report.smoothing_window(300) == 30
    # evaluations written before the standard error existed still render (no ±, no bars)
    old = report.write_report(_run_dir(tmp_path / "old", stderr=False))["markdown"]
    assert "| 0 | 64 x 8 | 0.277 | 0.397 |" in old and "±" not in old


def test_pass_at_k_standard_error_is_the_spread_over_problems():
    always, never = [True] * 8, [False] * 8
    assert pass_at_k_stderr([always, never], 1) == pytest.approx(0.5)  # sd 0.707 / sqrt(2)
    assert pass_at_k_stderr([always] * 10, 1) == 0.0 and pass_at_k_stderr([always], 1) == 0.0
    mixed = [[i < c for i in range(8)] for c in (0, 2, 4, 8)]
    values = [c / 8 for c in (0, 2, 4, 8)]
    mean = sum(values) / 4
    assert mean_pass_at_k(mixed, 1) == pytest.approx(mean)
    expected = (sum((v - mean) ** 2 for v in values) / 3 / 4) ** 0.5
    assert pass_at_k_stderr(mixed, 1) == pytest.approx(expected)


def test_alignment_artifact_is_markdown_not_a_python_dict():
    from engines.align.report import markdown

    stats = {"mean": 0.0057, "p50": 0.002, "p99": 0.083, "max": 0.147}
    aligned = {"passed": False, "failures": ["mean |Δlogprob| 0.2 > 0.09"], "token_abs_diff": stats,
               "n_tokens": 175, "n_sequences": 32, "n_empty_responses": 0,
               "pairs": {"rollout_vs_trainer": stats, "rollout_vs_reference": {**stats, "mean": 4e-4}},
               "first_divergence": {"layer": 0, "block": "mhc", "sub_block": "mhc_attn", "metric": "max_rel",
                                    "value": 0.5, "tolerance": 1e-3, "first_position": 3},
               "per_layer": [{}], "thresholds": {"mean": 0.09, "p99": None, "max": None},
               "engines": {"rollout": "ours", "trainer": "transformers from torch_dist"}}
    text = markdown(aligned)
    assert "{" not in text and "'" not in text, text
    assert "| rollout vs trainer (gated) | 0.0057 | 0.0020 | 0.0830 | 0.1470 |" in text
    assert "| rollout vs reference | 4.0e-04 |" in text and "Thresholds on rollout vs trainer: mean 0.09." in text
    assert "First divergence (float32, layer by layer): layer 0 mhc (`mhc_attn`), max_rel 0.5 > 0.001" in text
    assert "| trainer | transformers from torch_dist |" in text and "**FAILED**" in text


def test_demo_summary_states_the_noise(tmp_path):
    from v4rl.demo import pass_at_k_lines

    lines = pass_at_k_lines(_run_dir(tmp_path / "run"))
    assert lines[0] == ("held-out pass@1: step 0 0.277 ± 0.032 -> step 10 0.283 ± 0.032 (change +0.006, within the "
                        "noise of ±0.064)")
    assert lines[-1].startswith("(64 held-out problems x 8 samples per evaluation;")


def test_the_demo_prints_its_ui_commands_unwrapped(tmp_path):
    """On a narrow terminal the command to start the UI and its URL come out whole, one per line, as pasted."""
    import io

    from rich.console import Console

    from v4rl.demo import print_unwrapped, ui_hint_lines

    home = tmp_path / "a-rather-long-folder-name" / "prefect-home"
    out = io.StringIO()
    print_unwrapped(Console(file=out, width=40, force_terminal=False), ui_hint_lines(home))
    lines = out.getvalue().splitlines()
    assert f"  PREFECT_HOME={home} .venv/bin/prefect server start --host 127.0.0.1" in lines, lines
    assert "  http://127.0.0.1:4200" in lines


def test_the_demos_ui_command_works_pasted_when_the_work_dir_has_a_space(tmp_path):
    """The shell reads the printed command as the demo meant it: PREFECT_HOME is the whole path (issue 40)."""
    import shlex

    from v4rl.demo import ui_hint_lines

    home = tmp_path / "my runs" / "demo's home" / "prefect-home"
    (command,) = [x for x in ui_hint_lines(home) if "prefect server start" in x]
    words = shlex.split(command)
    assert words[0] == f"PREFECT_HOME={home}" and words[1:] == [".venv/bin/prefect", "server", "start", "--host",
                                                                "127.0.0.1"], words


def test_demo_links_only_to_a_ui_that_exists(tmp_path):
    """Prefect's own url_for under the demo's client settings: no link for the UI-less server, a link to the served
    UI with --ui (the "View at" lines of every flow and subflow come from url_for)."""
    from v4rl.demo import client_env

    probe = ("from prefect.utilities.urls import url_for; "
             "print(url_for('flow-run', obj_id='00000000-0000-0000-0000-000000000001'))")
    seen = {}
    for ui in (False, True):
        env = {**os.environ, **client_env(41234, tmp_path, ui=ui)}
        seen[ui] = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                                  timeout=300, check=True).stdout.strip()
    assert seen[False] == "None"
    assert seen[True] == "http://127.0.0.1:41234/runs/flow-run/00000000-0000-0000-0000-000000000001"


def test_no_gpu_or_timeout_warnings_that_do_not_apply(tiny_base):
    """transformers' "FP8 ... requires a GPU or XPU" (the reference dequantizes on purpose) and math-verify's
    "Timeout is disabled" (v4rl turns the signal timeout off and bounds the work itself) stay silent, in a fresh
    process as the demo's workers start."""
    probe = (f"from engines.align.score import load_reference; load_reference({str(tiny_base)!r}); "
             "from rl.rewards import grade; print(grade('so \\\\boxed{85}', '85').reward)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0 and done.stdout.strip().endswith("1.0"), done.stderr[-2000:]
    assert "requires a GPU" not in done.stderr and "Timeout is disabled" not in done.stderr, done.stderr[-2000:]
