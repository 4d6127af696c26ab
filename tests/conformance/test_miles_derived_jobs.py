"""Miles' own parse_args (main 31f1ca961 with Megatron-LM 2e64d788b, on CPU through the preflight's probe)
accepts every job the pipeline derives from v4rl's training job (engines/miles/jobs.py) for the seed's
layout, and resolves what each one is for: the run's one training job (first submission and a
resubmission that skips the evaluation already recorded), Miles' eval-only run on --ref-load and on a
saved iteration, and the alignment gate's train-only debug run. All five argvs go through one probe process
(preflight.check_commands: one Miles import, each argv parsed afresh and answered on its own).

    .venv/bin/python -m pytest tests/conformance/test_miles_derived_jobs.py -q
"""

from __future__ import annotations

import dataclasses


def test_every_derived_job_passes_miles_parse_args(miles_tree, megatron_tree, sglang_paths, tmp_path):
    from engines.profiles import get_profile
    from engines.presets.runs import SEED_RUN, layout_input
    from engines.profiles.site import Site
    from engines.miles import MilesJob, build_command
    from engines.miles.jobs import align_argv, eval_only_argv, run_argv
    from engines.upstream.miles_preflight import check_commands

    profile = get_profile(SEED_RUN.profile)
    cluster = layout_input(SEED_RUN, profile=profile).cluster
    save, ref = str(tmp_path / "save"), str(tmp_path / "torch_dist")
    job = MilesJob(run_id="derived", hf_checkpoint="/absent/DeepSeek-V4-Flash-FP8", ref_load=ref, save_dir=save)
    site = Site(ray_address="http://10.0.0.1:8265", master_addr="10.0.0.1", socket_ifname="eth0", ib_hca="rdma0")
    command = build_command(SEED_RUN, job, site=site, cluster=cluster, profile=profile)
    n = SEED_RUN.train.n_samples_per_prompt
    jobs = {
        "run": (run_argv(command.argv, steps=30, eval_interval=10, save_interval=20),
                {"num_rollout": 30, "skip_eval_before_train": False, "log_passrate": True, "eval_interval": 10,
                 "save_interval": 20, "save": save, "load": ref}),  # no tracker in --save yet: Miles starts
                                                                          # from --ref-load, our torch_dist
        "resubmission": (run_argv(command.argv, steps=30, eval_interval=10, save_interval=20, evaluate_first=False),
                         {"num_rollout": 30, "skip_eval_before_train": True, "eval_interval": 10, "save": save}),
        "eval step 0": (eval_only_argv(command.argv),
                        {"num_rollout": 0, "load": ref, "save": None, "log_passrate": True, "finetune": True}),
        "eval step 20": (eval_only_argv(command.argv, checkpoint_dir=save, iteration=19),
                         {"num_rollout": 0, "load": save, "ckpt_step": 19, "finetune": True, "no_load_optim": True}),
        "align": (align_argv(command.argv, rollout_data=f"{tmp_path}/rollout_data/{{rollout_id}}.pt",
                             train_dump=f"{tmp_path}/train_data/{{rollout_id}}_{{rank}}.pt", n_prompts=16),
                  {"debug_train_only": True, "debug_disable_optimizer": True, "num_rollout": 1, "load": ref,
                   "save": None, "rollout_batch_size": 16, "global_batch_size": 16 * n, "eval_interval": None,
                   "use_rollout_routing_replay": False,
                   "load_debug_rollout_data": f"{tmp_path}/rollout_data/{{rollout_id}}.pt"}),
    }
    checks = check_commands([dataclasses.replace(command, argv=argv) for argv, _ in jobs.values()], SEED_RUN, job,
                            cluster=cluster, profile=profile)
    assert len(checks) == len(jobs)
    failures = []
    for (name, (_, want)), check in zip(jobs.items(), checks):
        if not check.accepted:
            failures.append(f"{name}: {check.summary()}")
            continue
        wrong = {k: (v, check.resolved.get(k)) for k, v in want.items() if check.resolved.get(k) != v}
        if wrong:
            failures.append(f"{name}: resolved differently (want, got): {wrong}")
    assert not failures, "\n".join(failures)
