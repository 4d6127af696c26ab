"""The loss aggregation is one typed setting (rl/loss_setting.py) read by every surface: the embedded trainer's
GRPOConfig, the run (TrainRunConfig, config.json), `v4rl train --loss-aggregation`, the run preset's
AlgorithmSpec and the Miles job's flags; each refuses a bad value in one line naming itself and the two choices.

    .venv/bin/python -m pytest tests/test_loss_setting.py -q
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engines.presets.runs import SEED_RUN, TINY_RUN, apply_overrides
from engines.miles.train_args import grpo_args
from engines.train.run import TrainRunConfig
from rl.grpo import GRPOConfig
from rl.loss_setting import DEFAULT_LOSS_AGGREGATION

ROOT = Path(__file__).resolve().parents[1]
CHOICES = "choose sample-mean .* or token-mean"


def test_every_surface_defaults_to_the_cluster_jobs_aggregation():
    """Miles reduces per sample unless told --calculate-per-token-loss, and v4rl's job never said so: the default
    everywhere is sample-mean, and token-mean is exactly that one flag."""
    assert DEFAULT_LOSS_AGGREGATION == "sample-mean"
    for spec in (GRPOConfig(), TrainRunConfig(), SEED_RUN.algorithm, TINY_RUN.algorithm):
        assert spec.loss_aggregation == DEFAULT_LOSS_AGGREGATION, spec
    assert "--calculate-per-token-loss" not in grpo_args(SEED_RUN)
    token, _ = apply_overrides(SEED_RUN, {"loss_aggregation": "token-mean"})
    assert grpo_args(token).count("--calculate-per-token-loss") == 1


def test_a_run_from_before_the_setting_resumes_only_as_token_mean(tmp_path):
    """Such a run trained token-mean and its config.json has no loss_aggregation: token-mean is left out of
    config.json, so `--loss-aggregation token-mean` resumes it and the new default is refused naming the field."""
    from engines.runs.runlog import RunLog

    old = {k: v for k, v in TrainRunConfig().to_dict().items() if k != "loss_aggregation"}
    runlog = RunLog(tmp_path)
    runlog.write_config(old)
    runlog.check_config(TrainRunConfig(loss_aggregation="token-mean").to_dict())
    with pytest.raises(ValueError, match=r"different run configuration \(fields \['loss_aggregation'\]\)"):
        runlog.check_config(TrainRunConfig().to_dict())


@pytest.mark.parametrize("build, name", [
    (lambda: GRPOConfig(loss_aggregation="mean"), "GRPOConfig.loss_aggregation"),
    (lambda: TrainRunConfig(loss_aggregation="mean"), "TrainRunConfig.loss_aggregation"),
    (lambda: dataclasses.replace(SEED_RUN.algorithm, loss_aggregation="mean"), "algorithm.loss_aggregation"),
    (lambda: apply_overrides(SEED_RUN, {"loss_aggregation": "mean"}), "algorithm.loss_aggregation"),
])
def test_a_bad_value_is_refused_naming_the_setting_and_the_choices(build, name):
    with pytest.raises(ValueError, match=f"{name}='mean': {CHOICES}"):
        build()


def test_train_command_refuses_a_bad_value_in_one_line(tmp_path):
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "v4rl.cli", "train", "--out", str(out), "--loss-aggregation",
                             "per-token"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "Traceback" not in result.stderr + result.stdout
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --loss-aggregation='per-token': choose sample-mean"), lines
    assert not out.exists()
