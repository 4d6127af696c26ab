"""The Miles jobs v4rl derives from the training job's argv (engines/miles/jobs.py): the run's one
training job, Miles' eval-only run, and the cluster alignment gate's train-only debug run. Miles' parse_args on these argvs
is the preflight's conformance check; here the token edits. NUM_GPUS = 0; well under a second.

    .venv/bin/python -m pytest tests/test_miles_jobs.py -q
"""

from __future__ import annotations

import pytest

from engines.miles.jobs import align_argv, eval_only_argv, flag_values, run_argv, with_flags, without_flags

TRAIN = ["--actor-num-nodes", "2", "--rollout-batch-size", "32", "--n-samples-per-prompt", "8",
         "--num-rollout", "200", "--num-steps-per-rollout", "1", "--use-rollout-routing-replay", "--use-tis",
         "--tis-clip-low", "-0.5", "--eval-interval", "10", "--eval-prompt-data", "aime", "/data/aime-2024.jsonl",
         "--n-samples-per-eval-prompt", "8", "--log-passrate", "--ref-load", "/ckpt/torch_dist", "--load", "/save",
         "--save", "/save", "--save-interval", "10", "--over-sampling-batch-size", "64",
         "--apply-chat-template-kwargs", '{"thinking_mode": "thinking"}']


def test_flag_edits_keep_values_and_negative_numbers():
    assert flag_values(TRAIN, "--eval-prompt-data") == ["aime", "/data/aime-2024.jsonl"]
    assert flag_values(TRAIN, "--use-tis") == [] and flag_values(TRAIN, "--absent") is None
    assert flag_values(TRAIN, "--tis-clip-low") == ["-0.5"]
    out = without_flags(TRAIN, ["--eval-prompt-data", "--use-tis"])
    assert "aime" not in out and "--use-tis" not in out and out[out.index("--tis-clip-low") + 1] == "-0.5"
    out = with_flags(TRAIN, num_rollout=20, skip_eval_before_train=True, use_tis=False)
    assert out.count("--num-rollout") == 1 and out[-3:] == ["--num-rollout", "20", "--skip-eval-before-train"]
    assert "--use-tis" not in out


def test_run_eval_only_and_align_jobs():
    run = run_argv(TRAIN, steps=30, eval_interval=5, save_interval=20)
    assert flag_values(run, "--num-rollout") == ["30"] and flag_values(run, "--skip-eval-before-train") is None
    assert flag_values(run, "--load") == ["/save"] and flag_values(run, "--eval-interval") == ["5"]
    assert flag_values(run, "--save-interval") == ["20"] and run.count("--save-interval") == 1
    assert flag_values(run, "--log-passrate") == []  # pass@k is logged only with it
    resumed = run_argv(TRAIN, steps=30, evaluate_first=False)  # the resume point was evaluated before the failure
    assert flag_values(resumed, "--skip-eval-before-train") == [] and flag_values(resumed, "--save-interval") == ["10"]

    base = eval_only_argv(TRAIN)  # step 0: Miles falls back to --ref-load
    assert flag_values(base, "--num-rollout") == ["0"] and flag_values(base, "--load") is None
    assert flag_values(base, "--save") is None and flag_values(base, "--eval-prompt-data") == ["aime",
                                                                                                "/data/aime-2024.jsonl"]
    assert flag_values(base, "--ref-load") == ["/ckpt/torch_dist"] and flag_values(base, "--log-passrate") == []
    assert flag_values(base, "--lr-decay-iters") == ["1"]  # Megatron's scheduler asserts a positive length
    later = eval_only_argv(TRAIN, checkpoint_dir="/save", iteration=19)  # step 20: iter_0000019, tracker untouched
    assert (flag_values(later, "--ref-load"), flag_values(later, "--ref-ckpt-step")) == (["/save"], ["19"])
    assert flag_values(later, "--load") is None

    gate = align_argv(TRAIN, rollout_data="/shared/rollout_data/{rollout_id}.pt",
                      train_dump="/shared/train_data/{rollout_id}_{rank}.pt", n_prompts=16)
    assert flag_values(gate, "--load-debug-rollout-data") == ["/shared/rollout_data/{rollout_id}.pt"]
    assert flag_values(gate, "--save-debug-train-data") == ["/shared/train_data/{rollout_id}_{rank}.pt"]
    assert flag_values(gate, "--debug-disable-optimizer") == [] and flag_values(gate, "--num-rollout") == ["1"]
    assert flag_values(gate, "--rollout-batch-size") == ["16"] and flag_values(gate, "--n-samples-per-prompt") == ["8"]
    for gone in ("--load", "--save", "--save-interval", "--eval-interval", "--eval-prompt-data",
                 "--use-rollout-routing-replay", "--over-sampling-batch-size"):
        assert flag_values(gate, gone) is None, gone
    assert flag_values(gate, "--ref-load") == ["/ckpt/torch_dist"] and "--use-tis" in gate


def test_jobs_refuse_what_cannot_run():
    with pytest.raises(ValueError, match="--num-rollout"):
        run_argv(TRAIN, steps=0)
    with pytest.raises(ValueError, match="no --save/--load"):
        run_argv(without_flags(TRAIN, ["--save"]), steps=10)
    with pytest.raises(ValueError, match="--save-interval"):
        run_argv(TRAIN, steps=10, save_interval=0)
    with pytest.raises(ValueError, match="no --eval-prompt-data"):
        eval_only_argv(without_flags(TRAIN, ["--eval-prompt-data"]))
    with pytest.raises(ValueError, match="both checkpoint_dir and iteration"):
        eval_only_argv(TRAIN, checkpoint_dir="/save")
    with pytest.raises(ValueError, match="needs {rollout_id}"):
        align_argv(TRAIN, rollout_data="/shared/r.pt", train_dump="/shared/{rollout_id}_{rank}.pt", n_prompts=4)
