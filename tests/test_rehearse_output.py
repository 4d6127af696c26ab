"""What `v4rl rehearse` prints at its end (issue 40): the substitution table with every "why" whole at a 120-column
terminal (it was cut at 60 characters), and a last line that says at a glance whether the rehearsal passed and what
it showed, or which stage failed and why. Built from a report as the rehearsal returns it; a second.

    .venv/bin/python -m pytest tests/test_rehearse_output.py -q
"""

from __future__ import annotations

from engines.upstream.rehearsal.job import Substitution, substitution_table
from engines.upstream.rehearsal.run import RehearsalReport
from v4rl.cmd_rehearse import verdict

WHY = ("the rehearsal's actor runs at layout 1, so Miles' --debug-rollout-only sizes its idle actor from "
       "--rollout-num-gpus; the cluster's 8 would make Ray wait for GPUs that this machine's logical cluster lacks")
SUBS = [Substitution("--rollout-num-gpus", "8", "1", WHY),
        Substitution("model flags (--num-layers, --hidden-size, --num-experts, ...)", "DeepSeek-V4-Flash",
                     "the tiny checkpoint's config.json", "a CPU holds the tiny model only"),
        Substitution("OMP_NUM_THREADS", "(unset)", "2", "short")]


def _words(text: str) -> list[str]:
    return text.split()


def test_the_substitution_table_keeps_every_why_whole_within_the_width():
    for width in (120, 200):
        table = substitution_table(SUBS, width=width)
        assert all(len(line) <= width for line in table.splitlines()), table
        assert " ".join(_words(WHY)) in " ".join(_words(table)), table  # whole, in order, wrapped
        assert "--rollout-num-gpus;" in _words(table), table  # a flag is never broken at its hyphens
        assert table.splitlines()[0].startswith("flag or variable"), table


def _report(**stages) -> RehearsalReport:
    return RehearsalReport(generation=2, miles_dir="/miles", stages=stages,
                           rollouts={"0": {"train/train_rollout_logprob_abs_diff": 0.0041},
                                     "1": {"train/train_rollout_logprob_abs_diff": 0.0063}},
                           evals=[{"rollout": 0, "datasets": {}}],
                           logprob_bound={"bound": 0.012, "broadcast_bound": 0.02})


def test_the_last_line_says_what_passed_and_what_it_showed():
    ok = {"ok": True, "seconds": 12.0, "error": None}
    line = verdict(_report(rollout=ok, train=ok))
    assert line == ("rehearsal passed: stage rollout, stage train (Miles generation 2; 2 rollouts logged; "
                    "1 evaluation; max |Δlogprob| 0.0063 (bound 0.0120))"), line
    full = _report(full=ok)
    full.weight_checks = [{"ok": True}, {"ok": True}]
    full.resumed_from = {"latest_checkpointed_iteration": 1}
    line = verdict(full)
    assert line.startswith("rehearsal passed: stage full (") and "(bound 0.0200)" in line, line
    assert "2/2 weight checks equal" in line and "resumed from iteration 1" in line, line


def test_the_last_line_names_the_failed_stage_and_why():
    line = verdict(_report(rollout={"ok": True, "seconds": 9.0, "error": None},
                           train={"ok": False, "seconds": 30.0, "error": "Miles logged no train/loss for rollout 1"}))
    assert line == ("rehearsal FAILED at stage train: Miles logged no train/loss for rollout 1 "
                    "(passed: stage rollout)"), line
