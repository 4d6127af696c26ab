"""Metric sinks (engines/runs/sinks.py) with the real packages: TensorBoard event files read back with
TensorBoard's own EventAccumulator, W&B offline runs read back from their .wandb record logs. Rows go in
through RunLog, as in training; a resumed or rolled-back run leaves one value per step in TensorBoard and
sends W&B no step twice; no wandb-core process outlives a run; bad configuration names field and fix; and
two tiny training steps, killed after the first and resumed, land in both sinks as metrics.jsonl holds them.

Nothing here reaches beyond this machine: W&B is offline with error reporting off, and any HTTP(S) client
that honours the proxy variables is pointed at a closed loopback port.

    .venv/bin/python -m pytest tests/test_metric_sinks.py -q
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import psutil
import pytest

from engines.runs.runlog import RunLog
from engines.runs.sinks import MetricSinkUnavailable, open_sinks, wandb_run_id


@pytest.fixture(autouse=True)
def offline_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB_DISABLE_CODE", "true")
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")  # a closed port: an attempt to go out fails here
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    yield
    assert not _wandb_services(), "a wandb-core service outlived the test"


def _wandb_services() -> list[psutil.Process]:
    alive = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "wandb-core" in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE:
                alive.append(child)
        except psutil.NoSuchProcess:
            pass
    return alive


# --- reading back ------------------------------------------------------------------------------------


def _tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _wandb_records(path: Path):
    """The records of a .wandb file: LevelDB's log format (32 KiB blocks, 7-byte chunk headers) after W&B's
    7-byte file header, each record a wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B record log"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:  # block tail too short for a header: zero padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        pending += data[pos:pos + length]
        pos += length
        if kind in (1, 4):  # FULL or LAST chunk: a record is complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _wandb_sessions(run_dir: Path) -> list[dict]:
    """Per offline session (oldest first): run id, exit code and history {step: {key: value}}."""
    sessions = []
    for directory in sorted((run_dir / "wandb").glob("offline-run-*")):
        (log,) = directory.glob("run-*.wandb")
        session = {"dir": directory, "run_id": None, "exit_code": None, "history": {}}
        for record in _wandb_records(log):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                session["run_id"] = record.run.run_id
            elif kind == "exit":
                session["exit_code"] = record.exit.exit_code
            elif kind == "history":
                values = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                          for item in record.history.item}
                session["history"][record.history.step.num] = {k: v for k, v in values.items()
                                                               if not k.startswith("_")}
        sessions.append(session)
    return sessions


# --- synthetic rows ----------------------------------------------------------------------------------


def _row(step: int, session: int = 1) -> dict[str, float]:
    return {"rollout/raw_reward": 0.1 * step + session, "train/grad_norm": float(step),
            "perf/step_time": 2.0 * step}


def _eval(step: int) -> dict:
    return {"pass@1": 0.2 + step / 100, "pass@8": 0.7 + step / 100, "truncated_ratio": 0.0, "n_problems": 8}


def test_tensorboard_holds_every_committed_row_and_eval(tmp_path):
    runlog = RunLog(tmp_path, sinks=open_sinks(["tensorboard"], tmp_path))
    with runlog.sinks:
        runlog.truncate_after(0)  # what a run does first (fresh or resumed)
        runlog.write_eval(0, _eval(0))
        runlog.append_metrics(1, _row(1))
        runlog.append_metrics(2, {**_row(2), "train/grad_norm": float("nan")})  # a null in metrics.jsonl
        runlog.append_metrics(3, _row(3))
        runlog.write_eval(3, _eval(3))
    scalars = _tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["rollout/raw_reward"] == [(s, pytest.approx(0.1 * s + 1)) for s in (1, 2, 3)]
    assert scalars["perf/step_time"] == [(1, 2.0), (2, 4.0), (3, 6.0)]
    assert scalars["train/grad_norm"] == [(1, 1.0), (3, 3.0)]  # the non-finite value is left out, as in jsonl
    assert scalars["eval/math/pass@1"] == [(0, pytest.approx(0.2)), (3, pytest.approx(0.23))]
    assert scalars["eval/math/n_problems"] == [(0, 8.0), (3, 8.0)]
    assert not any(tag == "step" or tag.endswith("/step") for tag in scalars)


def test_a_resumed_run_leaves_one_value_per_step_in_tensorboard(tmp_path):
    first = RunLog(tmp_path, sinks=open_sinks(["tensorboard"], tmp_path))
    with pytest.raises(KeyboardInterrupt), first.sinks:
        first.truncate_after(0)
        for step in (1, 2, 3):  # step 3 is logged, then the process dies before its checkpoint
            first.append_metrics(step, _row(step, session=1))
        raise KeyboardInterrupt("simulated kill")
    second = RunLog(tmp_path, sinks=open_sinks(["tensorboard"], tmp_path))
    with second.sinks:
        assert second.truncate_after(2) == 1  # resume from the step-2 checkpoint, as run_training does
        for step in (3, 4):
            second.append_metrics(step, _row(step, session=2))
    rewards = _tensorboard_scalars(tmp_path / "tensorboard")["rollout/raw_reward"]
    assert [s for s, _ in rewards] == [1, 2, 3, 4]
    assert [v for _, v in rewards] == pytest.approx([1.1, 1.2, 2.3, 2.4])  # steps 3-4 from the resumed run
    assert [(r["step"], r["rollout/raw_reward"]) for r in second.metrics()] == [(s, v) for s, v in
                                                                                zip([1, 2, 3, 4], [1.1, 1.2, 2.3, 2.4])]


def test_a_rollback_within_one_session_replaces_the_dropped_steps(tmp_path):
    runlog = RunLog(tmp_path, sinks=open_sinks(["tensorboard"], tmp_path))
    with runlog.sinks:
        runlog.truncate_after(0)
        for step in (1, 2, 3, 4):
            runlog.append_metrics(step, _row(step, session=1))
        runlog.truncate_after(2)  # the mismatch guard's rollback to the step-2 checkpoint
        for step in (3, 4, 5):
            runlog.append_metrics(step, _row(step, session=5))
    rewards = _tensorboard_scalars(tmp_path / "tensorboard")["rollout/raw_reward"]
    assert rewards == [(1, pytest.approx(1.1)), (2, pytest.approx(1.2)), (3, pytest.approx(5.3)),
                       (4, pytest.approx(5.4)), (5, pytest.approx(5.5))]


def test_wandb_offline_run_holds_every_row_under_the_run_directory(tmp_path):
    config = {"lr": 1e-3, "steps": 3}
    runlog = RunLog(tmp_path, sinks=open_sinks(["wandb"], tmp_path, config=config))
    with runlog.sinks:
        runlog.truncate_after(0)
        runlog.write_eval(0, _eval(0))
        for step in (1, 2):
            runlog.append_metrics(step, _row(step))
        runlog.write_eval(2, _eval(2))
        assert _wandb_services(), "W&B should run its service while the run is open"
    (session,) = _wandb_sessions(tmp_path)
    assert session["run_id"] == wandb_run_id(tmp_path) and session["exit_code"] == 0
    history = session["history"]
    assert sorted(history) == [0, 1, 2]
    assert history[0] == {f"eval/math/{k}": v for k, v in _eval(0).items()}
    assert history[1] == _row(1)
    assert history[2] == {**_row(2), **{f"eval/math/{k}": v for k, v in _eval(2).items()}}
    assert json.loads((tmp_path / "wandb" / "v4rl-state.json").read_text())["last_step"] == {"metrics": 2, "eval": 2}


def test_a_resumed_run_continues_its_wandb_run_without_sending_a_step_twice(tmp_path):
    first = RunLog(tmp_path, sinks=open_sinks(["wandb"], tmp_path))
    with pytest.raises(KeyboardInterrupt), first.sinks:
        first.truncate_after(0)
        for step in (1, 2, 3):
            first.append_metrics(step, _row(step, session=1))
        raise KeyboardInterrupt("simulated kill")
    assert not _wandb_services()
    second = RunLog(tmp_path, sinks=open_sinks(["wandb"], tmp_path))
    with second.sinks:
        second.truncate_after(2)
        for step in (3, 4):
            second.append_metrics(step, _row(step, session=2))
    killed, resumed = _wandb_sessions(tmp_path)
    assert killed["run_id"] == resumed["run_id"] == wandb_run_id(tmp_path)
    assert killed["exit_code"] == 1 and resumed["exit_code"] == 0  # the killed session is marked failed
    assert sorted(killed["history"]) == [1, 2, 3]
    assert resumed["history"] == {4: _row(4, session=2)}  # step 3 is already in W&B: not sent again


def test_bad_sink_configuration_names_the_field_and_the_fix(tmp_path, monkeypatch):
    import importlib.util

    from engines.train.run import TrainRunConfig
    from flows.params import PipelineParams

    with pytest.raises(ValueError, match=r"metric_sinks has unknown metric sink\(s\) \['tensorbord'\]; "
                                         r"allowed: tensorboard, wandb"):
        TrainRunConfig(metric_sinks=["tensorbord"])
    with pytest.raises(ValueError, match="metric_sinks must be a list of sink names, got 'wandb'"):
        TrainRunConfig(metric_sinks="wandb")
    assert TrainRunConfig(metric_sinks=("wandb", "tensorboard", "wandb")).metric_sinks == ["wandb", "tensorboard"]
    with pytest.raises(ValueError, match="metric_sinks"):
        PipelineParams(metric_sinks=["mlflow"])

    real_find_spec = importlib.util.find_spec
    without_wandb = lambda name, *a: None if name == "wandb" else real_find_spec(name, *a)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", without_wandb)
    with pytest.raises(MetricSinkUnavailable, match="the wandb package is not installed; run `pip install wandb`"):
        open_sinks(["tensorboard", "wandb"], tmp_path)


def test_cli_flags_and_pipeline_params_reach_the_training_config(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import engines.train.run as run_module
    from flows.params import PipelineParams
    from v4rl.cli import app

    seen = []
    monkeypatch.setattr(run_module, "run_training", lambda out, config, **kw: seen.append(config) or {"evals": []})
    for flags, expected in ((["--tensorboard", "--wandb"], ["tensorboard", "wandb"]), ([], [])):
        result = CliRunner().invoke(app, ["train", "--out", str(tmp_path), "--steps", "1", *flags])
        assert result.exit_code == 0, result.output
        assert seen.pop().metric_sinks == expected
    assert PipelineParams(metric_sinks=["tensorboard"]).backend().config.metric_sinks == ["tensorboard"]


def test_training_steps_land_in_both_sinks_across_a_kill_and_resume(tiny_base, tmp_path):
    from engines.train.run import TrainRunConfig, run_training
    from rl.loop import LoopConfig

    config = TrainRunConfig(base=str(tiny_base), steps=2, save_interval=2, n_eval=8, n_train=64, lr=1e-3,
                            use_ray=False, metric_sinks=["tensorboard", "wandb"],
                            loop=LoopConfig(prompts_per_step=4, n_samples=4, eval_interval=2, max_new_tokens=6,
                                            dynamic_sampling=False))

    def die_after_step_1(step, metrics):
        raise KeyboardInterrupt("simulated kill")  # step 1 is logged, never checkpointed

    with pytest.raises(KeyboardInterrupt):
        run_training(tmp_path, config, log=lambda m: None, on_step=die_after_step_1)
    assert not _wandb_services(), "the failed run must stop W&B's service"
    run_training(tmp_path, config, log=lambda m: None)  # resumes from scratch: steps 1 and 2 run (again)

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = {e["step"]: e for e in RunLog(tmp_path).evals()}
    assert [r["step"] for r in rows] == [1, 2] and sorted(evals) == [0, 2]

    scalars = _tensorboard_scalars(tmp_path / "tensorboard")
    for name in ("rollout/raw_reward", "train/train_rollout_logprob_abs_diff", "train/pg_loss", "perf/step_time"):
        assert scalars[name] == [(r["step"], pytest.approx(r[name], rel=1e-6)) for r in rows], name
    assert scalars["eval/math/pass@1"] == [(s, pytest.approx(evals[s]["pass@1"], rel=1e-6)) for s in (0, 2)]

    killed, resumed = _wandb_sessions(tmp_path)
    assert (killed["exit_code"], resumed["exit_code"]) == (1, 0)
    assert sorted(killed["history"]) == [0, 1] and sorted(resumed["history"]) == [2]
    history = {**killed["history"], **resumed["history"]}
    for row in rows:  # step 1 comes from the killed session: a deterministic replay, equal but for timings
        expected = {k: v for k, v in row.items() if k != "step" and v is not None and not k.startswith("perf/")}
        assert {k: history[row["step"]][k] for k in expected} == expected
    assert history[2]["eval/math/pass@8"] == evals[2]["pass@8"]
    assert history[0]["eval/math/pass@1"] == evals[0]["pass@1"]
