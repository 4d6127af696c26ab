"""Miles' own `parse_args` (with Megatron-LM's validation) accepts v4rl's job and resolves it as v4rl meant.

engines/upstream/miles_preflight.py runs Miles' parser in a subprocess on CPU: Megatron-LM miles-main first on
sys.path, Miles main, SGLang 0.5.23's source, GPU-only imports stubbed where they fail, the profile's
accelerator answering torch.cuda, and the job's runtime env. For the seed's layout (TP1 PP4 EP4, 2 + 2 nodes,
which Miles' launcher has no preset for) and Miles' 32-GPU layout (TP4 PP4 EP8) the parallel sizes,
batch/sample counts, eval datasets, save interval, TIS and offload resolve to v4rl's values. A Miles checkout
of another version (the PR-head tarball) names the flag it rejects, and the runtime env is part of what Miles
checks (Megatron asserts CUDA_DEVICE_MAX_CONNECTIONS=1 with TP > 1). Every accepted argv then goes through
Megatron's own `core_transformer_config_from_args` (TransformerConfig's checks). Both Miles DeepSeek-V4 generations:
31f1ca961 + 2e64d788b with the stage sizes, e9e19b223 + 6184c094a with the pipeline layout string its config build
requires (the seed's layout in the default run; the 32-GPU layout, the megatron impl and the refusal of the old
stage flags are `slow`). About 40 s per probe process on 2 cores; the first generation's jobs of the default run
(both layouts, DP attention, and the runtime-env check) are checked by one module fixture (preflight.check_requests:
one probe process per runtime env, each argv parsed afresh and answered on its own), each test asserting on its own.

    .venv/bin/python -m pytest tests/conformance/test_miles_parse_args.py -q
"""

from __future__ import annotations

import dataclasses

import pytest

from engines.presets.runs import MILES_32GPU_RUN, SEED_RUN
from engines.profiles.site import Site
from engines.miles import MilesJob
from engines.upstream.miles_preflight import check_job, check_requests, job_request

SITE = Site(ray_address="http://10.0.0.1:8265", master_addr="10.0.0.1", socket_ifname="ens50f0", ib_hca="rdma0")


def _job(tmp_path, **kw) -> MilesJob:
    return MilesJob(run_id="r1", hf_checkpoint="/cluster/V4-Flash-FP8", ref_load="/cluster/V4-Flash_torch_dist",
                    save_dir=str(tmp_path / "save"), data_dir="/cluster/datasets", **kw)


@pytest.fixture(scope="module")
def first_generation_checks(tmp_path_factory, miles_tree, megatron_tree, sglang_paths):
    """Miles 31f1ca961's checks of the default run's first-generation jobs, by name, from one check_requests."""
    from engines.miles.launch import apply_overrides

    tmp = tmp_path_factory.mktemp("first-generation")
    dp_attention, _ = apply_overrides(MILES_32GPU_RUN, {"sglang_dp": 2})
    jobs = {SEED_RUN.name: (SEED_RUN, _job(tmp)), MILES_32GPU_RUN.name: (MILES_32GPU_RUN, _job(tmp)),
            "dp-attention": (dp_attention, _job(tmp)),
            "max-connections-8": (MILES_32GPU_RUN, _job(tmp, extra_env={"CUDA_DEVICE_MAX_CONNECTIONS": "8"}))}
    checks = check_requests([job_request(preset, job, site=SITE) for preset, job in jobs.values()],
                            miles_dir=miles_tree, megatron_dir=megatron_tree)
    return dict(zip(jobs, checks))


@pytest.mark.parametrize("preset", [SEED_RUN, MILES_32GPU_RUN], ids=lambda p: p.name)
def test_miles_accepts_the_job_and_resolves_it_as_meant(first_generation_checks, preset):
    check = first_generation_checks[preset.name]
    assert check.accepted, check.error
    assert check.ok, check.summary()
    r, p = check.resolved, preset.parallel
    assert (r["tensor_model_parallel_size"], r["pipeline_model_parallel_size"], r["expert_model_parallel_size"],
            r["decoder_last_pipeline_num_layers"]) == (p.tp, p.pp, p.ep, 10)
    assert r["global_batch_size"] == 256 and r["num_rollout"] == preset.num_rollout
    assert [(d["name"], d["path"], d["n_samples_per_eval_prompt"]) for d in r["eval_datasets"]] == [
        ("aime", "/cluster/datasets/aime-2024/aime-2024.jsonl", 8)]
    assert r["save_interval"] == 20 and r["use_tis"] is True and r["optimizer_cpu_offload"] is True
    assert r["load"] == r["ref_load"] == "/cluster/V4-Flash_torch_dist" and r["start_rollout_id"] == 0  # fresh
    assert r["compress_ratios"][:4] == [0, 0, 4, 128] and r["num_layers"] == 43  # read back from config.json
    assert check.stage == "config" and r["config"]["num_layers"] == 43  # Megatron's TransformerConfig builds too


def _second_generation(preset, impl: str = "miles"):
    return dataclasses.replace(preset, miles=dataclasses.replace(preset.miles, generation=2, dsv4_impl=impl))


@pytest.mark.parametrize("preset, impl", [
    (SEED_RUN, "miles"),
    pytest.param(MILES_32GPU_RUN, "miles", marks=pytest.mark.slow),
    pytest.param(SEED_RUN, "megatron", marks=pytest.mark.slow),
], ids=["seed-miles", "32gpu-miles", "seed-megatron"])
def test_second_generation_accepts_the_layout_and_builds_megatrons_config(tmp_path, miles_gen2_tree,
                                                                          megatron_gen2_tree, sglang_paths, preset,
                                                                          impl):
    """Miles e9e19b223 + Megatron-LM 6184c094a: parse_args, then Megatron's own config build, which refuses hash
    layers with PP > 1 unless the layout string is given (conformance C7)."""
    check = check_job(_second_generation(preset, impl), _job(tmp_path), site=SITE, miles_dir=miles_gen2_tree,
                      megatron_dir=megatron_gen2_tree)
    assert check.ok, check.summary()
    r = check.resolved
    assert (check.stage, check.generation, r["dsv4_impl"]) == ("config", 2, impl)
    assert r["pipeline_model_parallel_layout"] == "Et*11|t*11|t*11|t*10L" == r["config"]["pipeline_model_parallel_layout"]
    assert r["decoder_first_pipeline_num_layers"] is None and r["decoder_last_pipeline_num_layers"] is None
    assert r["config"]["experimental_attention_variant"] == ("dsv4_hybrid" if impl == "megatron" else "dsv4")
    assert r["dsa_kernel_backend"] == ("none" if impl == "megatron" else None)  # MI355X has no cuDNN


@pytest.mark.slow
def test_second_generation_refuses_the_first_generations_stage_flags(tmp_path, miles_gen2_tree, megatron_gen2_tree,
                                                                    sglang_paths):
    """The seed's `--decoder-last-pipeline-num-layers 10` passes Miles' parser but not Megatron's config build."""
    from engines.profiles import get_profile
    from engines.presets.runs import layout_input
    from engines.miles import build_command
    from engines.upstream.miles_preflight import check_command

    preset, job = _second_generation(SEED_RUN), _job(tmp_path)
    profile = get_profile(preset.profile)
    cluster = layout_input(preset, profile=profile).cluster
    command = build_command(preset, job, site=SITE, cluster=cluster, profile=profile)
    i = command.argv.index("--pipeline-model-parallel-layout")
    argv = [*command.argv[:i], "--decoder-last-pipeline-num-layers", "10", *command.argv[i + 2:]]
    check = check_command(dataclasses.replace(command, argv=argv), preset, job, cluster=cluster, profile=profile,
                          miles_dir=miles_gen2_tree, megatron_dir=megatron_gen2_tree)
    assert not check.accepted and check.stage == "config"
    assert "pipeline_model_parallel_layout must be set when using hash MoE" in check.error


def test_a_generation_mismatch_is_named(tmp_path, miles_gen2_tree, megatron_gen2_tree, sglang_paths):
    """A generation-1 job against a generation-2 Miles: the preflight says which setting to change."""
    check = check_job(SEED_RUN, _job(tmp_path), site=SITE, miles_dir=miles_gen2_tree, megatron_dir=megatron_gen2_tree)
    assert not check.ok and "set miles_generation 2" in check.summary()


def test_miles_of_another_version_names_the_flag_it_rejects(tmp_path, miles_seed_pr_tree, megatron_tree,
                                                             sglang_paths):
    check = check_job(SEED_RUN, _job(tmp_path), site=SITE, miles_dir=miles_seed_pr_tree, megatron_dir=megatron_tree)
    assert not check.accepted and "--sglang-tp-size" in check.rejected
    assert "rejected flag --sglang-tp-size" in check.summary() and "31f1ca961" in check.summary()


def test_the_runtime_env_is_part_of_the_check(first_generation_checks):
    check = first_generation_checks["max-connections-8"]  # MILES_32GPU_RUN with CUDA_DEVICE_MAX_CONNECTIONS=8
    assert not check.accepted and "CUDA_DEVICE_MAX_CONNECTIONS" in check.error


def test_pipeline_preflight_stops_on_a_missing_eval_dataset(tmp_path, miles_tree, megatron_tree, sglang_paths):
    """The rl-pipeline's preflight task runs the same check on the cluster path before anything is submitted."""
    import dataclasses
    import json

    from prefect.logging import disable_run_logger

    from engines.presets.flash import flash_config
    from engines.backends.miles import MilesBackend
    from engines.miles.pipeline import ClusterRun
    from engines.upstream.miles_preflight import MilesRejected
    from tasks.preflight import preflight

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(flash_config()))
    data = tmp_path / "datasets"
    (data / "dapo-math-17k").mkdir(parents=True)
    (data / "dapo-math-17k" / "dapo-math-17k.jsonl").write_text('{"prompt": "1+1?", "label": "2"}\n')
    job = dataclasses.replace(_job(tmp_path), hf_checkpoint=str(hf), data_dir=str(data))
    run = ClusterRun(preset=SEED_RUN.name, job=job, site=SITE, run_dir=str(tmp_path / "run"), eval_interval=10,
                     overrides={"num_rollout": 20})
    backend = MilesBackend(run=run, steps=20, miles_dir=str(miles_tree), megatron_dir=str(megatron_tree))
    with disable_run_logger(), pytest.raises(MilesRejected) as err:
        preflight.fn(SEED_RUN.name, backend=backend)
    assert "eval dataset 'aime' (--eval-prompt-data)" in str(err.value)
    assert f"{data}/aime-2024/aime-2024.jsonl does not exist" in str(err.value) and "prompt_data" not in str(err.value)


def test_dp_attention_reaches_sglang_as_attn_dp_size(first_generation_checks):
    """RolloutSpec.engine_dp is DP attention inside one engine (SGLang 0.5.23 --attn-dp-size), never SGLang's
    --dp-size replicas, which its weight-sync routes refuse (conformance B18)."""
    check = first_generation_checks["dp-attention"]  # MILES_32GPU_RUN with sglang_dp 2
    assert check.ok, check.summary()
    assert (check.resolved["sglang_dp_size"], check.resolved["sglang_attn_dp_size"]) == (1, 2)
