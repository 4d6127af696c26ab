"""`v4rl rehearse` (engines/rehearsal/): bad input is one line before anything starts; the rollout stage itself
(Miles' own train.py --debug-rollout-only against v4rl's engine on local Ray) is `slow`.

    .venv/bin/python -m pytest tests/conformance/test_rehearse.py -q
"""

from __future__ import annotations

import socket

import pytest

from engines.rehearsal.run import RehearsalError, RehearsalRequest, free_port, rehearse, resolve_trees


def test_missing_miles_dir_is_one_line(tmp_path):
    with pytest.raises(RehearsalError) as err:
        resolve_trees(RehearsalRequest(miles_dir=str(tmp_path / "nope")))
    assert "does not exist" in str(err.value) and "\n" not in str(err.value)


def test_not_a_miles_tree_is_one_line(tmp_path):
    (tmp_path / "train.py").write_text("")
    with pytest.raises(RehearsalError) as err:
        resolve_trees(RehearsalRequest(miles_dir=str(tmp_path)))
    assert "not a Miles checkout" in str(err.value) and "\n" not in str(err.value)


def test_megatron_dir_that_is_not_megatron(miles_tree, tmp_path):
    with pytest.raises(RehearsalError) as err:
        resolve_trees(RehearsalRequest(miles_dir=str(miles_tree), megatron_dir=str(tmp_path)))
    assert "megatron/training/arguments.py" in str(err.value) and "\n" not in str(err.value)


def test_port_in_use_names_the_flag():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        with pytest.raises(RehearsalError, match=r"port \d+ on 127.0.0.1 is in use \(--engine-port\)"):
            free_port(held.getsockname()[1], "--engine-port")


def test_unbuilt_stage_is_refused():
    with pytest.raises(RehearsalError, match="only `rollout`"):
        rehearse(RehearsalRequest(stage="train"))


@pytest.mark.slow
@pytest.mark.parametrize("generation", ["miles_tree", "miles_gen2_tree"])
def test_rollout_stage_runs_miles_train_py(generation, request, sglang_paths, tmp_path):
    miles = request.getfixturevalue(generation)
    report = rehearse(RehearsalRequest(miles_dir=str(miles), work_dir=str(tmp_path), timeout_s=900))
    stage = report.stages["rollout"]
    assert stage["ok"], stage["error"]
    assert report.rollouts and report.evals
    assert any(s.name == "--rollout-external" for s in report.substitutions)
