"""The preflight rehearsal in the rl-pipeline (issue 28, "In the pipeline"; tasks/rehearse.py), through a real Prefect
server on 127.0.0.1 with the cluster preset against the file-level stand-in for `ray job submit`
(tests/cluster_stand_in.py; preflight, convert, verify and align replaced as there, the rehearse task real; why a
stand-in: what is tested is the rehearse task's place and failure in the flow, on a cluster preset with no cluster
here; the cluster path itself runs for real in tests/conformance/test_cluster_rehearsal.py):

  - rehearse on, and a rehearsal that cannot run (miles_check_dir is not a Miles tree, which the rehearsal refuses
    in one line): the flow fails at the rehearse task, not retried, before the conversion and before any Ray job
    is submitted; the flow's state and the `<run>-rehearsal` artifact carry that line;
  - rehearse on with this host's Miles of another generation than the run's: refused in one line the same way;
  - rehearse off (every preset's default): no rehearse task runs and the one job is submitted;
  - slow: a copy of the vendored Miles with a defect planted in its train.py: the stage runs and fails, the task
    is retried once, and the run stops before any submission with the stage and Miles' own message;
  - slow: rehearse=rollout with the vendored Miles runs Miles' own train.py on this host (~3-4 min on 2 loaded
    cores) and the run goes on to its job, with the stage's seconds and the substitution table in the artifact.

    .venv/bin/python -m pytest tests/test_rehearse_task.py -q            # ~1 min
    .venv/bin/python -m pytest tests/test_rehearse_task.py -q -m slow    # the real stage-rollout rehearsal
"""

from __future__ import annotations

import json

import pytest

from tests.cluster_stand_in import cluster_params, install_stand_in, read_calls, replace_cluster_only_steps
from tests.prefect_server import flow_run_children

SHORT = dict(steps=2, eval_interval=2)
"""A two-rollout job: what these tests check happens before it (or that it is submitted at all)."""


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    import flows.rl_pipeline as pipeline

    for name, value in install_stand_in(tmp_path / "bin", tmp_path / "calls.jsonl").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("STAND_IN_ROLLOUT_S", "0.2")
    for name in ("preflight", "convert", "verify", "align"):
        monkeypatch.setattr(pipeline, name, getattr(pipeline, name))  # so that the originals come back afterwards
    replace_cluster_only_steps(pipeline)
    return tmp_path / "calls.jsonl"


def _names(tasks) -> list[str]:
    return [t.name.rsplit("-", 1)[0] for t in tasks]


def _artifacts(key: str, state) -> list:
    """The artifacts `key` of the flow run of `state`, newest first (the session's server holds every test's)."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    run = ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])
    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]), flow_run_id=run),
                                     sort=ArtifactSort.CREATED_DESC)


def test_a_refused_rehearsal_stops_the_run_before_anything_is_submitted(prefect_server, stand_in, tmp_path):  # noqa: F811
    from flows.rl_pipeline import rl_pipeline

    not_miles = tmp_path / "not-miles"
    not_miles.mkdir()
    (not_miles / "README.md").write_text("a checkout of something else\n")
    # miles_generation given: the flow would otherwise read the generation from that directory first and fail there
    params = cluster_params(tmp_path, **SHORT, rehearse="rollout", miles_check_dir=str(not_miles), miles_generation=1)
    state = rl_pipeline(params, return_state=True)

    assert state.is_failed(), state
    line = (f"rehearsal refused: {not_miles} has no miles_plugins/models/deepseek_v4/deepseek_v4.py: not a Miles "
            "checkout with DeepSeek-V4 support")
    assert line in state.message, state.message
    assert not [c for c in read_calls(stand_in) if "submit" in c], "a Ray job was submitted after a failed rehearsal"
    tasks, _ = flow_run_children(state.state_details.flow_run_id, expect=("preflight", "rehearse"))
    assert "convert" not in _names(tasks) and "train" not in _names(tasks), _names(tasks)
    rehearsal = [t for t in tasks if _names([t]) == ["rehearse"]]
    assert len(rehearsal) == 1 and rehearsal[0].state.is_failed() and rehearsal[0].run_count == 1, rehearsal
    artifacts = _artifacts("cluster-run-rehearsal", state)
    assert len(artifacts) == 1, artifacts  # one attempt
    artifact = artifacts[0]
    assert artifact.type == "markdown" and "Rehearsal (stage rollout): FAILED" in artifact.data
    assert line in artifact.data, artifact.data
    assert not (params.run_dir / "rehearsal").exists()  # nothing started, nothing written


def test_a_rehearsal_of_another_miles_generation_than_the_runs_is_refused(prefect_server, stand_in,  # noqa: F811
                                                                          tmp_path):
    """The run targets generation 2; this host's Miles (the vendored default, generation 1) would rehearse another
    job: refused in one line, not retried, nothing started or submitted."""
    from flows.rl_pipeline import rl_pipeline

    miles = _vendored_sources_or_skip()
    params = cluster_params(tmp_path, **SHORT, rehearse="rollout", miles_generation=2)
    state = rl_pipeline(params, return_state=True)
    assert state.is_failed(), state
    assert (f"rehearsal refused: the run's Miles is generation 2 but the Miles on this host ({miles}) is generation "
            "1; point miles_check_dir at a checkout of the cluster's Miles") in state.message, state.message
    assert not [c for c in read_calls(stand_in) if "submit" in c]
    tasks, _ = flow_run_children(state.state_details.flow_run_id, expect=("rehearse",))
    assert [t.run_count for t in tasks if _names([t]) == ["rehearse"]] == [1]
    assert not (params.run_dir / "rehearsal").exists()


def test_with_rehearse_off_the_task_does_not_run(prefect_server, stand_in, tmp_path):  # noqa: F811
    from flows.rl_pipeline import rl_pipeline

    params = cluster_params(tmp_path, **SHORT)
    assert params.rehearse is None  # the preset's default (engines/presets/spec.py MilesSettings.rehearse)
    state = rl_pipeline(params, return_state=True)
    assert state.is_completed(), state
    tasks, _ = flow_run_children(state.state_details.flow_run_id, expect=("preflight", "train"))
    assert "rehearse" not in _names(tasks) and "train" in _names(tasks), _names(tasks)
    assert len([c for c in read_calls(stand_in) if "submit" in c]) == 1


def test_failure_line_names_the_stage_and_the_message():
    from tasks.rehearse import failure_line

    ok = {"ok": True, "seconds": 80.0, "error": None}
    assert failure_line({"rollout": ok}) is None
    assert failure_line({"rollout": ok, "train": {"ok": False, "seconds": 9.5, "error": (
        "stage train: Miles' train.py exited with 1 at miles/utils/arguments.py:1502: AssertionError: TP must be 1")}}
    ) == "rehearsal stage train failed: Miles' train.py exited with 1 at miles/utils/arguments.py:1502: " \
         "AssertionError: TP must be 1"
    assert failure_line({"rollout": {"ok": False, "seconds": 1.0, "error": "Miles exited without logging a rollout"}}
                        ) == "rehearsal stage rollout failed: Miles exited without logging a rollout"
    assert failure_line({}) == "rehearsal failed: no stage ran"


def test_the_artifact_holds_stages_metrics_evals_and_substitutions():
    from engines.upstream.rehearsal.job import Substitution
    from engines.upstream.rehearsal.run import RehearsalReport
    from tasks.rehearse import markdown

    report = RehearsalReport(generation=2, miles_dir="/src/miles", work_dir="/runs/r/rehearsal",
                             stages={"rollout": {"ok": True, "seconds": 88.1, "error": None},
                                     "train": {"ok": False, "seconds": 12.0, "error": "stage train: a | b"}},
                             rollouts={"1": {"rollout/raw_reward": 0.25}, "0": {"rollout/raw_reward": 0.0,
                                                                                "train/tis": 1.019}},
                             evals=[{"rollout": 0, "datasets": {"aime": {"reward": 0.0, "pass@1": 0.0,
                                                                         "pass@4": 0.5}}}],
                             substitutions=[Substitution("--distributed-backend", "nccl", "gloo", "no NCCL on a CPU")],
                             logprob_bound={"bf16_noise": 0.005, "fp8_requant_noise": 0.023, "raw_vs_processed": 0.11,
                                            "tokens": 346, "temperature": 0.8, "factor": 3.0, "bound": 0.015,
                                            "broadcast_bound": 0.084})
    data = {**report.to_json(), "resumed_from": {"latest_checkpointed_iteration": 0},  # what stage full adds
            "weight_checks": [{"run": "run 1", "version": 1, "tensors_sent": 12, "ok": True, "first_differing": None},
                              {"run": "run 1", "version": 2, "tensors_sent": 12, "ok": False,
                               "first_differing": "layers.0.ffn.gate.tid2eid"}]}
    text = markdown("train", data, "rehearsal stage train failed: a | b")
    lines = text.splitlines()
    assert lines[0] == "# Rehearsal (stage train): FAILED" and "**rehearsal stage train failed: a \\| b**" in lines
    assert "| rollout | yes | 88.1 |  |" in lines and "| train | no | 12.0 | stage train: a \\| b |" in lines
    assert "| rollout | rollout/raw_reward | train/tis |" in lines
    assert lines.index("| 0 | 0 | 1.019 |") < lines.index("| 1 | 0.25 |  |")  # rollouts in order, gaps empty
    assert "| 0 | aime | pass@1 0, pass@4 0.5 |" in lines
    assert "| --distributed-backend | nccl | gloo | no NCCL on a CPU |" in lines
    assert "| run 1 | 1 | 12 | yes |  |" in lines and "| run 1 | 2 | 12 | no | layers.0.ffn.gate.tid2eid |" in lines
    assert "Resumed from: latest_checkpointed_iteration 0" in lines
    assert "Bounds on `train/train_rollout_logprob_abs_diff`, from noise measured on this model (346 tokens at " \
           "temperature 0.8): 3 x bf16 0.005 = 0.015 (stage train); 3 x (bf16 + FP8 re-quantization 0.023) = 0.084 " \
           "(stage full)." in lines


def _vendored_sources_or_skip():
    from engines.upstream import sources as src

    try:
        miles = src.miles_tree()
        src.sglang_paths()
    except src.EngineSourceMissing as exc:
        pytest.skip(f"the vendored Miles / SGLang sources are absent: {exc}")
    return miles


@pytest.mark.slow
def test_a_rehearsal_whose_miles_fails_stops_the_run_naming_the_stage_and_miles_message(prefect_server,  # noqa: F811
                                                                                        stand_in, tmp_path):
    """A copy of the vendored Miles with a defect planted in its own train.py: the stage runs (engine, Ray, Miles'
    driver), Miles fails, the task retries once in a fresh work dir, then the run stops before any submission."""
    import shutil

    from flows.rl_pipeline import rl_pipeline

    planted = tmp_path / "miles-planted"
    shutil.copytree(_vendored_sources_or_skip(), planted, symlinks=True)
    train_py = planted / "train.py"
    anchor = "    assert not args.fully_async"
    assert anchor in train_py.read_text(), "the pinned train.py changed: plant the defect elsewhere"
    train_py.write_text(train_py.read_text().replace(
        anchor, '    raise AssertionError("planted defect: the driver stops before placement")\n' + anchor, 1))
    params = cluster_params(tmp_path, **SHORT, rehearse="rollout", miles_check_dir=str(planted))
    state = rl_pipeline(params, return_state=True)

    assert state.is_failed(), state
    assert "rehearsal stage rollout failed: Miles' train.py exited with 1" in state.message, state.message
    assert "AssertionError: planted defect: the driver stops before placement" in state.message, state.message
    assert not [c for c in read_calls(stand_in) if "submit" in c]
    tasks, _ = flow_run_children(state.state_details.flow_run_id, expect=("rehearse",))
    rehearsal = [t for t in tasks if _names([t]) == ["rehearse"]]
    assert len(rehearsal) == 1 and rehearsal[0].run_count == 2, rehearsal  # retried once
    report = json.loads((params.run_dir / "rehearsal.json").read_text())
    assert not report["stages"]["rollout"]["ok"] and report["miles_dir"] == str(planted)
    artifacts = _artifacts("cluster-run-rehearsal", state)
    assert len(artifacts) == 2 and all("planted defect" in a.data for a in artifacts), artifacts  # one per attempt


@pytest.mark.slow
def test_a_stage_rollout_rehearsal_passes_and_the_run_goes_on(prefect_server, stand_in, tmp_path):  # noqa: F811
    from flows.rl_pipeline import rl_pipeline

    _vendored_sources_or_skip()
    params = cluster_params(tmp_path, **SHORT, rehearse="rollout")
    state = rl_pipeline(params, return_state=True)
    assert state.is_completed(), state
    report = json.loads((params.run_dir / "rehearsal.json").read_text())
    assert report["stages"]["rollout"]["ok"], report["stages"]
    assert len([c for c in read_calls(stand_in) if "submit" in c]) == 1
    text = _artifacts("cluster-run-rehearsal", state)[0].data
    assert "Rehearsal (stage rollout): passed" in text and "--rollout-external" in text, text
