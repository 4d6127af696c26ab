"""What v4rl reads from Miles and hands to Miles, proven with Miles' own code (main 31f1ca961, vendor tarball or
$V4RL_MILES_DIR) run on CPU in a subprocess:

  - Miles' own logging functions (log_eval_rollout_data, log_rollout_data, log_train_step, log_perf_data_raw)
    print the lines, through its own logger configuration; v4rl's parser and recorder read them back into the
    tiny-cpu run directory, np.float64 pass@k included (A13, A14);
  - the cluster alignment gate's rollout-data file is read by Miles' `load_debug_rollout_data`, every sample
    passes `Sample.validate`, Miles' `convert_samples_to_train_data` and DP split turn it into training shards,
    Miles' `save_debug_train_data_for_rank` dumps them with per-sample `log_probs` where Megatron's forward puts
    them (here: our CPU trainer's scores of the same tokens, the one step that needs GPUs), and the gate reads
    the dumps back into the CPU gate's report.

    .venv/bin/python -m pytest tests/conformance/test_miles_log_and_gate.py -q
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch



MILES_ONLY_SGLANG = ("sglang.srt.entrypoints.openai.encoding_dsv4",)
"""Imported by Miles main, present only on Miles' sglang-miles SGLang branch, not in upstream 0.5.23 (vendor/README)."""


def _run_miles(paths: list[Path], code: str, *, timeout: float = 300) -> str:
    """Miles' own code in a subprocess: `paths` first on sys.path, GPU-only imports stubbed where they fail."""
    from engines.upstream.sources import engine_python
    from engines.upstream.stubs import GPU_ONLY_ROOTS

    done = engine_python(textwrap.dedent(code), paths, env={"RAY_USAGE_STATS_ENABLED": "0", "DO_NOT_TRACK": "1"},
                         cwd=paths[0], timeout=timeout, stub_roots=GPU_ONLY_ROOTS + MILES_ONLY_SGLANG)
    return done.stdout + done.stderr


def test_lines_miles_prints_are_read_back_into_the_run_directory(miles_tree, megatron_tree, sglang_paths, tmp_path):
    log = _run_miles([miles_tree, megatron_tree, *sglang_paths], """
        import types
        import torch
        from miles.utils.logging_utils import configure_logger_raw
        configure_logger_raw("RolloutManager")
        from miles.ray.rollout import metrics
        from miles.backends.training_utils.log_utils import log_train_step
        from miles.utils.train_metric_utils import log_perf_data_raw
        from miles.utils.types import Sample

        args = types.SimpleNamespace(custom_eval_rollout_log_function_path=None, custom_rollout_log_function_path=None,
                                     log_passrate=True, n_samples_per_eval_prompt=4, n_samples_per_prompt=4,
                                     wandb_always_use_train_step=False, load_debug_rollout_data=None,
                                     advantage_estimator="grpo", reward_key=None, sglang_speculative_algorithm=None,
                                     log_reward_category=None, rollout_num_gpus=8, use_session_server=False, ci_test=False)
        metrics.log_eval_rollout_data(0, args, {"aime-2024": {"rewards": [1, 0, 0, 0, 1, 1, 0, 0],
                                                              "truncated": [0, 0, 1, 0, 0, 0, 0, 1]}})
        for rollout_id in range(2):
            samples = [Sample(group_index=i // 4, index=i, response="x", response_length=10 + i, tokens=[1] * (20 + i),
                              reward=float(i % 2), status=Sample.Status.COMPLETED if i % 3 else Sample.Status.TRUNCATED)
                       for i in range(8)]
            metrics.log_rollout_data(rollout_id, args, samples, None, 12.5)
            log_train_step(args, {"pg_loss": torch.tensor(-0.01), "train_rollout_logprob_abs_diff": 0.004 + rollout_id,
                                  "tis": 0.99}, grad_norm=0.5, rollout_id=rollout_id, step_id=0, num_steps_per_rollout=1,
                           should_log=True)
            log_perf_data_raw(rollout_id, args, True, None, extra_metrics={"perf/update_weights_time": 3.0})
        metrics.log_eval_rollout_data(1, args, {"aime-2024": {"rewards": [1, 1, 0, 0, 1, 1, 1, 0],
                                                              "truncated": [0] * 8}})
    """)
    from engines.runs.report import write_report
    from engines.miles import parse_metric_line, record_lines

    lines = log.splitlines()
    evals = [parse_metric_line(x) for x in lines if " - eval " in x]
    assert len(evals) == 2 and "np.float64(" in next(x for x in lines if " - eval 0:" in x)
    assert evals[0].metrics["eval/aime-2024-pass@1"] == pytest.approx(3 / 8)  # np.float64 read back (A14)
    assert evals[0].metrics["eval/aime-2024-pass@4"] == pytest.approx(1.0)  # Miles' own name (A13)
    rec = record_lines(lines, tmp_path, eval_problems={"aime-2024": 2}, n_samples_per_eval_prompt=4)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] == rec.committed
    assert rows[1]["train/train_rollout_logprob_abs_diff"] == pytest.approx(1.004)
    assert rows[0]["train/pg_loss"] == pytest.approx(-0.01) and rows[0]["rollout/truncated_ratio"] == pytest.approx(3 / 8)
    assert rows[0]["rollout/response_len/mean"] == pytest.approx(13.5) and rows[0]["passrate/pass@1"] == 0.5
    assert rec.evaluated == [0, 2]  # before training: step 0; after rollout 1: step 2
    step2 = json.loads((tmp_path / "eval" / "step_000002.json").read_text())
    assert (step2["dataset"], step2["pass@1"], step2["truncated_ratio"]) == ("aime-2024", pytest.approx(5 / 8), 0.0)
    summary = write_report(tmp_path, title="miles")["summary"]
    assert summary["pass@1_first"] == pytest.approx(3 / 8) and summary["pass@1_last"] == pytest.approx(5 / 8)


def test_cluster_gate_rollout_file_and_dumps_through_miles_own_code(miles_tree, tiny_base, tmp_path):
    from transformers import AutoTokenizer

    from engines.align import AlignConfig
    from engines.align.cluster import (ROLLOUT_DATA, TRAIN_DUMP, cluster_report, miles_samples, read_train_dumps,
                                       sglang_rollouts, write_rollout_data)
    from engines.align.inputs import held_out_prompts, load_torch_dist
    from engines.rollout.engine import RolloutEngine
    from engines.rollout.server import RolloutServer
    from engines.rollout.sglang import SGLangClient
    from checkpoints.convert import convert_hf_to_torch_dist
    from checkpoints.hf import read_config
    from engines.train.trainer import Trainer, TrainerConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_base)
    prompts = held_out_prompts(tokenizer, 3, 0, tokenizer.bos_token_id)
    config = AlignConfig(n_prompts=3, max_new_tokens=12)
    with RolloutServer(RolloutEngine(tiny_base)) as server, SGLangClient(server.url) as client:
        groups = sglang_rollouts(client, prompts, n=2, temperature=1.0, max_new_tokens=12, seed=0)
    samples = miles_samples(groups, decode=tokenizer.decode, labels=["1", "2", "3"])
    shared = tmp_path / "shared"
    write_rollout_data(shared / ROLLOUT_DATA.format(rollout_id=0), samples)

    # Megatron's forward is the GPU step: its log_probs come here from our CPU trainer on the converted weights
    cfg, _ = read_config(tiny_base)
    torch_dist = convert_hf_to_torch_dist(tiny_base, tmp_path / "torch_dist").dst
    trainer = Trainer.from_native(cfg, load_torch_dist(torch_dist, cfg), TrainerConfig(compute_dtype="bfloat16"))
    scores = trainer.logprobs([(s["tokens"][:len(s["tokens"]) - s["response_length"]],
                                s["tokens"][len(s["tokens"]) - s["response_length"]:]) for s in samples])
    torch.save({s["index"]: lp for s, lp in zip(samples, scores)}, tmp_path / "scores.pt")

    out = _run_miles([miles_tree], f"""
        import types
        import torch
        from miles.ray.rollout.debug_data import load_debug_rollout_data
        from miles.ray.rollout.train_data_conversion import convert_samples_to_train_data, split_train_data_by_dp_raw
        from miles.utils.train_dump_utils import save_debug_train_data_for_rank

        args = types.SimpleNamespace(load_debug_rollout_data={str(shared / ROLLOUT_DATA)!r},
                                     load_debug_rollout_data_subsample=None, save_debug_train_data={str(shared / TRAIN_DUMP)!r},
                                     advantage_estimator="grpo", rewards_normalization=True, grpo_std_normalization=True,
                                     n_samples_per_prompt=2, reward_key=None, balance_data=False, qkv_format="bshd",
                                     use_dynamic_global_batch_size=False, multi_lora_n_adapters=None)
        samples, metadata = load_debug_rollout_data(args, rollout_id=0)
        for s in samples:
            s.validate()
        data = convert_samples_to_train_data(args, samples, metadata, None, None)
        scores = torch.load({str(tmp_path / "scores.pt")!r})
        for rank, shard in enumerate(split_train_data_by_dp_raw(args, data, dp_size=2)):
            save_debug_train_data_for_rank(args, rollout_id=0, rollout_data=dict(shard), rank=rank)  # first PP stage
            shard["tokens"] = [torch.tensor(t) for t in shard["tokens"]]
            shard["log_probs"] = [torch.tensor(scores[i]) for i in shard["sample_indices"]]  # the last stage's
            save_debug_train_data_for_rank(args, rollout_id=0, rollout_data=shard, rank=rank + 2)
        print("LOADED", len(samples), sorted({{s.status.value for s in samples}}), data["truncated"])
    """)
    loaded = next(x for x in out.splitlines() if x.startswith("LOADED"))
    assert loaded.startswith(f"LOADED {len(samples)} ")
    assert sorted(p.name for p in (shared / "train_data").iterdir()) == ["0_0.pt", "0_1.pt", "0_2.pt", "0_3.pt"]

    trainer_lp = read_train_dumps(shared / "train_data", samples)
    assert trainer_lp == [[float(x) for x in torch.tensor(lp).tolist()] for lp in scores]
    report = cluster_report(samples, trainer_lp, config, engines={"rollout": "v4rl's server"}, inputs={}, seconds={})
    assert report["passed"], report["failures"]
    assert report["n_sequences"] == sum(1 for s in samples if s["response_length"]) and report["n_prompts"] == 3
    assert report["token_abs_diff"]["mean"] < config.mean_threshold and report["first_divergence"] is None
    cpu_keys = {"passed", "failures", "token_abs_diff", "first_divergence", "per_layer", "thresholds", "n_prompts",
                "n_sequences", "n_empty_responses", "n_tokens", "by_position", "pairs", "engines", "localisation",
                "finish_reasons", "config", "inputs", "seconds"}
    assert set(report) == cpu_keys  # the report the CPU gate writes, read by the same task and nightly verdict

    # a dump of another batch, and a missing rank, are refused with the reason
    other = [dict(s, tokens=[s["tokens"][0] + 1] + s["tokens"][1:]) if s["index"] == 0 else s for s in samples]
    with pytest.raises(ValueError, match="other tokens than the rollout-data file"):
        read_train_dumps(shared / "train_data", other)
    (shared / "train_data" / "0_3.pt").unlink()
    with pytest.raises(ValueError, match="every DP rank of the last pipeline stage"):
        read_train_dumps(shared / "train_data", samples)
