"""`v4rl plan`'s storage cost of a Miles job start and a save (engines/miles/costs.py, v4rl/plan_cost.py):
the byte counts follow from the model's exact parameter count and the layout, and the run's totals from the job
shape (one job per segment before, one job per run now). Well under a second per test.

    .venv/bin/python -m pytest tests/test_plan_cost.py -q
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from engines.layout.shape import dsv4_flash_shape, total_params
from engines.miles.costs import job_costs, run_costs


def _cli():
    import typer

    from v4rl.cmd_plan import register

    app = typer.Typer()
    register(app)
    app.command(name="noop")(lambda: None)  # a second command keeps `plan` a subcommand
    return app


def test_save_and_start_bytes_of_the_seed_run():
    params = total_params(dsv4_flash_shape())
    costs = job_costs("dsv4-flash-mi355x", storage_gb_per_s=5.0)
    assert 284e9 < params < 285e9 and costs.params == params
    assert (costs.save_weights_bytes, costs.save_optimizer_bytes) == (2 * params, 12 * params)  # BF16; fp32+Adam
    assert costs.start_fresh_bytes == 2 * params and costs.start_resume_bytes == 14 * params
    assert costs.sglang_engines == 4  # 2 rollout nodes x 8 GPUs, TP4 engines
    assert 0.9 * params < costs.rollout_checkpoint_bytes < 1.1 * params  # FP8 experts and linears, BF16 rest
    assert costs.seconds(5e9) == pytest.approx(1.0)
    lean = job_costs("dsv4-flash-mi355x", save_optim=False)
    assert lean.save_bytes == lean.start_resume_bytes == 2 * params


def test_one_job_per_run_against_one_job_per_segment():
    costs = job_costs("dsv4-flash-mi355x")
    runs = run_costs(costs, steps=200, eval_interval=10, save_interval=20)
    before, after = runs["one job per segment"], runs["one job per run"]
    assert (before.jobs, before.fresh_starts, before.resumes, before.saves) == (21, 2, 19, 20)  # + step 0's job
    assert (after.jobs, after.fresh_starts, after.resumes, after.saves) == (1, 1, 0, 10)
    assert after.bytes_written == 10 * costs.save_bytes and before.bytes_written == 20 * costs.save_bytes
    assert after.bytes_read == costs.start_fresh_bytes + costs.sglang_bytes
    assert before.seconds > 4 * after.seconds
    assert run_costs(costs, steps=25, eval_interval=10, save_interval=20)["one job per run"].saves == 2  # 20, 25


def test_plan_prints_the_cost_and_refuses_a_bad_bandwidth():
    res = CliRunner().invoke(_cli(), ["plan", "--preset", "dsv4-flash-mi355x", "--storage-gb-per-s", "2"])
    assert res.exit_code == 0, res.output
    assert "storage cost at 2 GB/s" in res.output and "one job per run: 1 job starts, 10 saves" in res.output
    res = CliRunner().invoke(_cli(), ["plan", "--preset", "dsv4-flash-mi355x", "--no-save-optim", "--json"])
    cost = json.loads(res.output)["storage_cost"]
    assert cost["save_optimizer_bytes"] == 0 and cost["run"] == {"steps": 200, "eval_interval": 10,
                                                                 "save_interval": 20}
    res = CliRunner().invoke(_cli(), ["plan", "--preset", "dsv4-flash-mi355x", "--storage-gb-per-s", "0"])
    assert res.exit_code == 1 and "--storage-gb-per-s must be > 0" in res.output
    res = CliRunner().invoke(_cli(), ["plan", "--preset", "tiny-cpu"])
    assert res.exit_code == 0 and "storage cost" not in res.output  # no Miles job on tiny-cpu
