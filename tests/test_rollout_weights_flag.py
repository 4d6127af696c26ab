"""`v4rl train --rollout-weights fp8|bf16` (TrainRunConfig.rollout_weights, issue 29's BF16-rollout arm): the option
is the field's own default and docstring, reaches the run's config (bf16 turns the quantization-aware forward off,
as `v4rl bench learning`'s BF16 arm runs), and a bad value is one line naming the flag, before anything starts.

    .venv/bin/python -m pytest tests/test_rollout_weights_flag.py -q
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import engines.train.run as run_module
from rl.field_docs import field_default_and_doc
from v4rl.cli import app


def _train_option(name: str):
    import typer.main

    command = typer.main.get_command(app).commands["train"]
    return next(p for p in command.params if p.name == name)


def test_option_is_the_config_fields_default_and_docstring():
    default, doc = field_default_and_doc("engines.train.run", "TrainRunConfig", "rollout_weights")
    option = _train_option("rollout_weights")
    assert option.default == default == run_module.TrainRunConfig().rollout_weights == "fp8"
    assert option.help.startswith(doc) and "bf16" in doc


@pytest.mark.parametrize("flags, weights, quantization_aware", [([], "fp8", True),
                                                                 (["--rollout-weights", "bf16"], "bf16", False),
                                                                 (["--rollout-weights", "fp8"], "fp8", True)])
def test_flag_reaches_the_training_config(tmp_path, monkeypatch, flags, weights, quantization_aware):
    seen = []
    monkeypatch.setattr(run_module, "run_training", lambda out, config, **kw: seen.append(config) or {"evals": []})
    result = CliRunner().invoke(app, ["train", "--out", str(tmp_path / "run"), *flags])
    assert result.exit_code == 0, result.output
    assert (seen[0].rollout_weights, seen[0].quantization_aware) == (weights, quantization_aware)
    recorded = seen[0].to_dict()  # config.json: the fp8 default stays out, so older runs resume unchanged
    assert recorded.get("rollout_weights", "fp8") == weights and ("rollout_weights" in recorded) == (weights == "bf16")


def test_bad_value_is_one_line_and_leaves_no_run_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(run_module, "run_training", lambda *a, **k: pytest.fail("the run started"))
    result = CliRunner().invoke(app, ["train", "--out", str(tmp_path / "run"), "--rollout-weights", "fp4"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "error: --rollout-weights 'fp4' is not a way the rollout engine serves the linears; choose fp8 (FP8 rollout, "
        "as on the cluster) or bf16 (unquantized)"]
    assert not (tmp_path / "run").exists()
