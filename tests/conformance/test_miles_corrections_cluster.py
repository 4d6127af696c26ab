"""Each rollout correction a cluster preset can carry, as v4rl's Miles job writes it, through Miles' own
`parse_args` (with Megatron-LM's validation) in both DeepSeek-V4 generations, resolved as meant; with icepop the
probe also imports `--custom-tis-function-path` with Miles' own `load_function`, as Miles' loss does.

One parse per generation carries icepop + OPSM + routing replay (every correction flag at once); token TIS with
non-default bounds is the `slow` pair. With routing replay Miles must resolve `--pause-generation-mode
in_place` (radixark/miles#3277), its default `retract` without. The first generation's icepop job and the icepop job naming a function
this Miles lacks share one probe process (a module fixture: preflight.check_requests, each argv parsed afresh and
answered on its own). About 40 s per probe process on 2 cores.

    .venv/bin/python -m pytest tests/conformance/test_miles_corrections_cluster.py -q
"""

from __future__ import annotations

import dataclasses

import pytest

from engines.presets.runs import SEED_RUN, apply_overrides
from engines.profiles.site import Site
from engines.miles import MilesJob
from engines.upstream.miles_preflight import check_job, check_requests, job_request
from engines.miles.train_args import ICEPOP_FUNCTION

SITE = Site(ray_address="http://10.0.0.1:8265", master_addr="10.0.0.1", socket_ifname="ens50f0", ib_hca="rdma0")
TREES = {1: ("miles_tree", "megatron_tree"), 2: ("miles_gen2_tree", "megatron_gen2_tree")}
SETTINGS = {
    "icepop+opsm+r3": {"mode": "icepop", "opsm": True, "opsm_delta": 1e-3, "routing_replay": True},
    "tis-bounds": {"mode": "tis", "clip_low": 0.1, "clip_high": 3.0},
}


def _job(tmp_path) -> MilesJob:
    return MilesJob(run_id="r1", hf_checkpoint="/cluster/V4-Flash-FP8", ref_load="/cluster/V4-Flash_torch_dist",
                    save_dir=str(tmp_path / "save"), data_dir="/cluster/datasets")


@pytest.fixture(scope="module")
def first_generation_icepop(tmp_path_factory, miles_tree, megatron_tree, sglang_paths):
    """Miles 31f1ca961 on the icepop + OPSM + routing-replay job, and on the plain icepop job with
    --custom-tis-function-path naming ICEPOP_FUNCTION + "_v2" (a typo, a later Miles' function), from one
    check_requests."""
    job = _job(tmp_path_factory.mktemp("icepop"))
    every_flag, _ = apply_overrides(SEED_RUN, {"rollout_correction": SETTINGS["icepop+opsm+r3"]})
    icepop, _ = apply_overrides(SEED_RUN, {"rollout_correction": "icepop"})
    unimportable = job_request(icepop, job, site=SITE)
    argv = list(unimportable.command.argv)
    i = argv.index("--custom-tis-function-path")
    assert argv[i + 1] == ICEPOP_FUNCTION
    argv[i + 1] = ICEPOP_FUNCTION + "_v2"
    unimportable = dataclasses.replace(unimportable, command=dataclasses.replace(unimportable.command, argv=argv))
    checks = check_requests([job_request(every_flag, job, site=SITE), unimportable], miles_dir=miles_tree,
                            megatron_dir=megatron_tree)
    return dict(zip(("icepop+opsm+r3", "unimportable"), checks))


@pytest.mark.parametrize("generation", [1, 2])
@pytest.mark.parametrize("name", ["icepop+opsm+r3", pytest.param("tis-bounds", marks=pytest.mark.slow)])
def test_miles_parses_the_correction_flags(request, tmp_path, sglang_paths, generation, name):
    miles_dir, megatron_dir = (request.getfixturevalue(f) for f in TREES[generation])
    overrides = {"rollout_correction": SETTINGS[name]}
    if generation == 2:
        overrides.update(miles_generation=2)
    preset, _ = apply_overrides(SEED_RUN, overrides)
    if (generation, name) == (1, "icepop+opsm+r3"):  # checked with the unimportable function's job
        check = request.getfixturevalue("first_generation_icepop")[name]
    else:
        check = check_job(preset, _job(tmp_path), site=SITE, miles_dir=miles_dir, megatron_dir=megatron_dir)
    assert check.ok, check.summary()  # every correction value resolved as preflight.correction_values meant
    r, s = check.resolved, SETTINGS[name]
    assert r["use_tis"] is True and r["use_opsm"] is s.get("opsm", False)
    assert r["use_rollout_routing_replay"] is s.get("routing_replay", False)
    # both generations define --pause-generation-mode (default retract); with replay the job pauses in place, as
    # retract re-prefills and pairs old logprobs with new routes (radixark/miles#3277)
    assert r["pause_generation_mode"] == ("in_place" if s.get("routing_replay") else "retract")
    if s["mode"] == "icepop":
        assert (r["custom_tis_function_path"], r["custom_tis_function"]) == (ICEPOP_FUNCTION, "icepop_function")
        assert (r["tis_clip_low"], r["tis_clip"], r["opsm_delta"]) == (0.5, 2.0, 1e-3)
    else:
        assert r["custom_tis_function_path"] is None and (r["tis_clip_low"], r["tis_clip"]) == (0.1, 3.0)


def test_a_custom_function_miles_cannot_import_is_named(first_generation_icepop):
    """The probe's import check fails when the path names nothing in this Miles (a typo, a later Miles' function)."""
    check = first_generation_icepop["unimportable"]
    assert not check.accepted and "--custom-tis-function-path" in check.error and "icepop_function_v2" in check.error
