"""`v4rl bench learning` (bench/learning.py) at tiny sizes: two arms (BF16 rollout + TIS, FP8 rollout + TIS), one
seed, one step of real embedded training each; the JSON and the PNG it writes, and its bad-input lines.

    .venv/bin/python -m pytest tests/test_corrections_bench_learning.py -q
"""

from __future__ import annotations

import json

import pytest

from bench.learning import ARMS, LearningSettings, gap_to_baseline, main, parse_arms, run_config
from bench.learning_plot import learning_table

TINY = LearningSettings(steps=1, seeds=1, prompts_per_step=4, n_samples=4, eval_interval=1, n_eval=8, eval_samples=8,
                        max_new_tokens=6, lr=1e-3)


def test_two_arms_write_the_json_and_the_curves(tiny_base, tmp_path):
    out = tmp_path / "bench" / "learning.json"
    unfinished = tmp_path / "runs" / "fp8-tis" / "seed-0"
    unfinished.mkdir(parents=True)
    (unfinished / "left-by-an-interrupted-run").write_text("")
    result = main(out, arms="fp8-tis,bf16-tis", settings=TINY, work_dir=tmp_path / "runs", base=str(tiny_base),
                  log=lambda m: None)
    assert not (unfinished / "left-by-an-interrupted-run").exists()  # an unfinished run is rerun from scratch
    written = json.loads(out.read_text())
    assert [a["arm"] for a in written["arms"]] == ["bf16-tis", "fp8-tis"]  # ARMS' order, not the option's
    for arm in written["arms"]:
        assert [e["step"] for e in arm["evals"]] == [0, 1] and arm["seeds"] == 1
        assert all(0.0 <= e[k] <= 1.0 and e[f"{k}_se"] is None for e in arm["evals"] for k in ("pass@1", "pass@8"))
        assert all(e["pass@8"] >= e["pass@1"] for e in arm["evals"])
        assert 0.0 < arm["abs_dlogprob"] < 0.2 and arm["step_seconds"] > 0.0
        assert arm["masked_token_frac"] == 0.0  # TIS clips, it never masks
        assert 0.0 <= arm["router_mismatch_frac"] < 0.2  # logged without routing replay too
    bf16, fp8 = written["arms"]
    assert (bf16["rollout_weights"], fp8["rollout_weights"]) == ("bf16", "fp8")
    assert bf16["gap_pass@1_vs_bf16"]["last"] == 0.0 and bf16["step_seconds_vs_bf16"] == 1.0
    assert fp8["gap_pass@1_vs_bf16"]["last"] == pytest.approx(fp8["evals"][-1]["pass@1"] - bf16["evals"][-1]["pass@1"])
    table = learning_table(written).splitlines()
    assert len(table) == 4 and table[2].startswith("| bf16-tis | BF16 |") and table[3].startswith("| fp8-tis | FP8")
    # the BF16 arm's rollout really served unquantized linears: its start weights hold no FP8 scales
    start = json.loads((tmp_path / "runs" / "bf16-tis" / "seed-0" / "weights" / "current" / "config.json").read_text())
    assert "quantization_config" not in start
    fp8_start = tmp_path / "runs" / "fp8-tis" / "seed-0" / "weights" / "current" / "config.json"
    assert "quantization_config" in json.loads(fp8_start.read_text())
    png = out.with_suffix(".png")
    assert result["plot"] == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result_mtime = (unfinished / "bench-run.json").stat().st_mtime_ns
    assert not list(out.parent.glob(".*.tmp*"))  # written under a temporary name, renamed when complete

    # run again on the same work dir: both finished runs are reused (no training), the result is the same
    again = main(tmp_path / "again.json", arms="fp8-tis,bf16-tis", settings=TINY, work_dir=tmp_path / "runs",
                 base=str(tiny_base), log=lambda m: None)
    assert [a["evals"] for a in again["arms"]] == [a["evals"] for a in written["arms"]]
    assert (unfinished / "bench-run.json").stat().st_mtime_ns == result_mtime
    with pytest.raises(ValueError, match="seed-0/bench-run.json: finished with other settings"):
        main(tmp_path / "other.json", arms="fp8-tis", settings=TINY, steps=2, work_dir=tmp_path / "runs",
             base=str(tiny_base), log=lambda m: None)


def test_the_gap_is_paired_by_seed_and_averaged_from_step_5():
    def run(seed, curve):
        return {"seed": seed, "evals": [{"step": s, "pass@1": p} for s, p in zip((0, 5, 10), curve)]}

    base = [run(0, (0.2, 0.3, 0.4)), run(1, (0.2, 0.5, 0.6))]
    arm = [run(0, (0.2, 0.2, 0.3)), run(1, (0.2, 0.5, 0.5)), run(2, (0.2, 0.9, 0.9))]  # seed 2: no pair, left out
    gap = gap_to_baseline(arm, base)
    # seed 0: mean(-0.1, -0.1) = -0.1; seed 1: mean(0, -0.1) = -0.05 -> -0.075, se = stdev/sqrt(2) = 0.025
    assert gap["seeds"] == 2 and gap["mean"] == pytest.approx(-0.075) and gap["se"] == pytest.approx(0.025)
    assert gap["last"] == pytest.approx(-0.1) and gap["last_se"] == pytest.approx(0.0)


def test_arms_differ_only_in_rollout_weights_and_correction():
    a, b = run_config("bf16-tis", 2, TINY), run_config("fp8-r3-tis", 2, TINY)
    assert (a.rollout_weights, a.quantization_aware, b.rollout_weights, b.quantization_aware) == ("bf16", False,
                                                                                                  "fp8", True)
    assert b.rollout_correction.routing_replay and not a.rollout_correction.routing_replay
    assert a.loop == b.loop and a.loop.seed == 2 and (a.steps, a.n_eval, a.lr) == (b.steps, b.n_eval, b.lr)
    assert len(ARMS) == 7 and parse_arms(None) == list(ARMS)
    plain = run_config("fp8-bf16trainer-tis", 2, TINY)  # the cluster's mismatch: FP8 rollout, BF16 forward
    assert (plain.rollout_weights, plain.quantization_aware) == ("fp8", False) and plain.loop == a.loop
    assert ARMS["fp8-geo-mask"].correction.reject_bounds == (0.99, 1.01)  # SkyRL's; Miles' 0.9999/1.0001 masked 97%


def test_bad_input_is_one_line(tmp_path):
    from typer.testing import CliRunner

    from v4rl.cli import app

    with pytest.raises(ValueError, match="--arms: unknown arm.*'fp9-tis'.*choose from bf16-tis"):
        parse_arms("fp8-tis,fp9-tis")
    with pytest.raises(ValueError, match="eval_samples=4; give 8 or more"):
        LearningSettings(eval_samples=4)
    res = CliRunner().invoke(app, ["bench", "learning", "--json", str(tmp_path / "l.json"), "--arms", "nope"])
    assert res.exit_code == 2 and "--arms: unknown arm(s) ['nope']" in res.output
    res = CliRunner().invoke(app, ["bench", "train", "--json", str(tmp_path / "t.json"), "--seeds", "2"])
    assert res.exit_code == 2 and "--seeds applies to learning and e2e only" in res.output
    res = CliRunner().invoke(app, ["bench", "e2e", "--json", str(tmp_path / "e.json"), "--n-eval", "5"])
    assert res.exit_code == 2 and "--n-eval applies to learning only" in res.output
    res = CliRunner().invoke(app, ["bench", "e2e", "--json", str(tmp_path / "e.json"), "--arms", "v4rl,fp8-tis"])
    assert res.exit_code == 2 and "--arms: unknown arm(s) ['fp8-tis']; choose from v4rl, bf16-rollout" in res.output


def test_the_engine_serves_bf16_and_refuses_to_mix_storages(tiny_checkpoint, tmp_path):
    """The BF16 arm's engine side (engines/rollout/weights.py): an unquantized checkpoint is served and updated as
    such; an update in the other storage is refused in either direction, naming the tensor."""
    from checkpoints.hf import load_hf_checkpoint, save_hf_checkpoint
    from engines.rollout.weights import WeightStore, WeightUpdateError, read_weight_dir

    cfg, state = load_hf_checkpoint(tiny_checkpoint)
    bf16_dir = save_hf_checkpoint(tmp_path / "bf16", cfg, state, weight_format="bf16", tokenizer_dir=tiny_checkpoint)
    fp8, bf16 = WeightStore.from_dir(tiny_checkpoint), WeightStore.from_dir(bf16_dir)
    assert "bfloat16" in bf16.storage_summary() and "fp8" not in bf16.storage_summary()
    bf16_update, fp8_update = read_weight_dir(bf16_dir)[1], read_weight_dir(tiny_checkpoint)[1]
    assert bf16.check_update(bf16_update, source="bf16") and fp8.check_update(fp8_update, source="fp8")
    with pytest.raises(WeightUpdateError, match="arrived as bfloat16 but is stored as a quantized weight"):
        fp8.check_update(bf16_update, source="bf16")
    with pytest.raises(WeightUpdateError, match=r"arrived as FP8\+scale but is stored as unquantized"):
        bf16.check_update(fp8_update, source="fp8")
