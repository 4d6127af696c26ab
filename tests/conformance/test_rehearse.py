"""`v4rl rehearse` (engines/upstream/rehearsal/): bad input is one line before anything starts; stage full of generation 1
(Miles' own train.py in its normal loop against v4rl's engine on local Ray, killed and resumed; about 3 minutes on 2
cores) runs by default; the other stages, models and layouts are `slow` (`-m slow`, run before resolving).

    .venv/bin/python -m pytest tests/conformance/test_rehearse.py -q
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
import socket
import subprocess
import sys

import pytest

from engines.upstream.rehearsal.job import RehearsalPaths, rehearsal_job
from engines.upstream.rehearsal.metrics import read_metrics
from engines.upstream.rehearsal.run import RehearsalError, RehearsalRequest, free_port, rehearse, resolve_trees
from engines.upstream.rehearsal.tiny_model import tiny_miles_config

ENGINE = "127.0.0.1:31777"


def test_missing_miles_dir_is_one_line(tmp_path):
    with pytest.raises(RehearsalError) as err:
        resolve_trees(RehearsalRequest(miles_dir=str(tmp_path / "nope")))
    assert "does not exist" in str(err.value) and "\n" not in str(err.value)


def test_not_a_miles_tree_is_one_line(tmp_path):
    (tmp_path / "train.py").write_text("")
    with pytest.raises(RehearsalError) as err:
        resolve_trees(RehearsalRequest(miles_dir=str(tmp_path)))
    assert "not a Miles checkout" in str(err.value) and "\n" not in str(err.value)


def test_megatron_dir_that_is_not_megatron(miles_tree, tmp_path):
    with pytest.raises(RehearsalError) as err:
        resolve_trees(RehearsalRequest(miles_dir=str(miles_tree), megatron_dir=str(tmp_path)))
    assert "megatron/training/arguments.py" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("miles,megatron,lacks,pinned", [
    ("miles_gen2_tree", "megatron_tree", "megatron.core.tokenizers.utils.build_tokenizer", "6184c094a"),
    ("miles_tree", "megatron_gen2_tree", "megatron.training.tokenizer.tokenizer", "2e64d788b")])
def test_a_megatron_lm_that_does_not_fit_the_miles_generation_is_one_line(miles, megatron, lacks, pinned, request):
    """The other generation's Megatron-LM: refused before anything starts, naming Miles' import and the pinned pair
    (else a ModuleNotFoundError in Miles' first Ray actor, 35 s into the stage)."""
    with pytest.raises(RehearsalError) as err:
        resolve_trees(RehearsalRequest(miles_dir=str(request.getfixturevalue(miles)),
                                       megatron_dir=str(request.getfixturevalue(megatron))))
    line = str(err.value)
    assert "does not fit this Miles" in line and lacks in line and pinned in line and "\n" not in line, line
    assert "miles/backends/megatron_utils/arguments.py:" in line, line


def test_the_pinned_pairs_fit(miles_tree, megatron_tree, miles_gen2_tree, megatron_gen2_tree):
    assert resolve_trees(RehearsalRequest(miles_dir=str(miles_tree), megatron_dir=str(megatron_tree)))[2] == 1
    assert resolve_trees(RehearsalRequest(miles_dir=str(miles_gen2_tree),
                                          megatron_dir=str(megatron_gen2_tree)))[2] == 2


@pytest.mark.slow
def test_a_job_flag_this_miles_rejects_is_miles_own_line(miles_seed_pr_tree, megatron_tree, sglang_paths, tmp_path):
    """The seed's PR-head Miles (a8684732f) has no --sglang-tp-size: the stage fails with Miles' own argparse line
    (about 40 s: Ray's head, the engine and Miles' imports come first; `slow`, the default run holds the two parts:
    test_engine_sources.py's argparse line, and the bootstrap standing aside below); the bootstrap's workarounds
    for functions this Miles lacks stand aside instead of failing its imports."""
    report = rehearse(RehearsalRequest(miles_dir=str(miles_seed_pr_tree), megatron_dir=str(megatron_tree),
                                       work_dir=str(tmp_path), timeout_s=300))
    error = report.stages["rollout"]["error"]
    assert not report.stages["rollout"]["ok"] and "\n" not in error, error
    assert error.endswith("Miles' train.py exited with 2: train.py: error: unrecognized arguments: --sglang-tp-size 1")


def test_ctrl_c_stops_every_process_the_rehearsal_started_and_says_what_was_kept(miles_tree, sglang_paths,
                                                                                tmp_path):
    """SIGINT to `v4rl rehearse` while Miles' driver runs (its own session, so a terminal's Ctrl-C reaches only the
    CLI): within seconds the CLI exits 130 with one line naming the kept work dir, and nothing it started (the
    engine, Ray's head and workers, Miles' driver) is left."""
    import signal
    import time

    import psutil

    work = tmp_path / "work"
    cli = subprocess.Popen([sys.executable, "-m", "v4rl.cli", "rehearse", "--miles-dir", str(miles_tree),
                            "--work-dir", str(work)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (work / "miles.log").is_file() or not (work / "miles.log").stat().st_size:
            assert cli.poll() is None and time.monotonic() < deadline, cli.communicate()
            time.sleep(0.5)
        started = psutil.Process(cli.pid).children(recursive=True)
        os.kill(cli.pid, signal.SIGINT)
        interrupted = time.monotonic()
        out, err = cli.communicate(timeout=60)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 130 and time.monotonic() - interrupted < 40, (cli.returncode, err[-2000:])
    assert f"interrupted: every process this rehearsal started is stopped; its logs and what it wrote are kept in " \
           f"{work.resolve()}" in err and "Traceback" not in err, err[-2000:]
    left = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert len(started) >= 3 and not left, [(p.pid, p.cmdline()[:3]) for p in left]


def test_port_in_use_names_the_flag():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        with pytest.raises(RehearsalError, match=r"port \d+ on 127.0.0.1 is in use \(--engine-port\)"):
            free_port(held.getsockname()[1], "--engine-port")


def test_too_little_memory_for_the_layout_is_one_line_before_anything_starts(monkeypatch, tmp_path):
    import psutil

    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=2 * 2**30))
    with pytest.raises(RehearsalError, match=r"--layout pp2-ep2: .*6.6 GiB .* 2.0 GiB available; free memory, or use "
                                             r"--layout 1$"):
        rehearse(RehearsalRequest(stage="full", layout="pp2-ep2", work_dir=str(tmp_path / "work")))
    assert not (tmp_path / "work").exists()


def test_unknown_stage_is_refused():
    with pytest.raises(RehearsalError, match="--stage all: not a stage; use one of rollout, train, full"):
        rehearse(RehearsalRequest(stage="all"))


def test_missing_rollout_data_is_one_line(miles_gen2_tree, tmp_path):
    with pytest.raises(RehearsalError) as err:
        rehearse(RehearsalRequest(stage="train", miles_dir=str(miles_gen2_tree), rollout_data=str(tmp_path / "no")))
    assert str(err.value).startswith("--rollout-data ") and "no such directory" in str(err.value)
    assert "\n" not in str(err.value)


def test_rollout_data_without_every_rollout_names_the_missing_dump(miles_gen2_tree, tmp_path):
    (tmp_path / "rollout_0.pt").write_bytes(b"")
    with pytest.raises(RehearsalError, match=r"lacks Miles' dump rollout_1.pt \(--num-rollout 2\)"):
        rehearse(RehearsalRequest(stage="train", miles_dir=str(miles_gen2_tree), rollout_data=str(tmp_path)))


def test_train_job_trains_on_the_rollout_stages_dump(tmp_path):
    """Stage rollout saves Miles' own dump; stage train loads the same template, --debug-train-only, CPU init."""
    from engines.presets.runs import SEED_RUN

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(tiny_miles_config().to_hf_dict()))
    paths = RehearsalPaths(hf, tmp_path / "t.jsonl", tmp_path / "e.jsonl", tmp_path)
    rollout = rehearsal_job(SEED_RUN, paths, engine_addr=ENGINE, context_length=4096, stage="rollout").argv
    train = rehearsal_job(SEED_RUN, paths, engine_addr=ENGINE, context_length=4096, stage="train").argv
    dump = str(tmp_path / "rollout-data" / "rollout_{rollout_id}.pt")
    assert rollout[rollout.index("--save-debug-rollout-data") + 1] == dump
    assert train[train.index("--load-debug-rollout-data") + 1] == dump
    assert {"--debug-train-only", "--use-cpu-initialization"} <= set(train) and "--debug-rollout-only" not in train


def test_a_miles_failure_names_the_innermost_miles_frame(tmp_path):
    from engines.upstream.rehearsal.run import _miles_frame

    text = ('Traceback (most recent call last):\n  File "/x/miles/ray/train/group.py", line 12, in a\n'
            '  File "/x/megatron/core/optimizer/__init__.py", line 99, in b\n  File "/usr/lib/torch/x.py", line 1\n'
            "ValueError: boom\n")
    assert _miles_frame(text, tmp_path) == " at megatron/core/optimizer/__init__.py:99"


def _job(tmp_path):
    from engines.presets.runs import SEED_RUN

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(tiny_miles_config().to_hf_dict()))
    return rehearsal_job(SEED_RUN, RehearsalPaths(hf, tmp_path / "t.jsonl", tmp_path / "e.jsonl", tmp_path),
                         engine_addr=ENGINE, context_length=4096)


_ROUTER_ARGS = """
import argparse, json, sys
from sglang_router.launch_router import RouterArgs
parser = argparse.ArgumentParser()
RouterArgs.add_cli_args(parser, use_router_prefix=True, exclude_host_port=True)  # as miles/utils/arguments.py
args, _ = parser.parse_known_args(json.loads(sys.argv[1]))
router = RouterArgs.from_cli_args(args, use_router_prefix=True)              # as ray/rollout/router_manager.py
print(json.dumps({"worker_urls": router.worker_urls, "prometheus_host": router.prometheus_host}))
"""


def test_miles_router_gets_the_engine_and_binds_metrics_to_loopback(tmp_path, sglang_paths):
    """With --rollout-external Miles never registers the engine with the router it launches: the job hands it
    to the router (--worker-urls), else every /generate is 503 no_available_workers; metrics on 127.0.0.1."""
    job = _job(tmp_path)
    env = {"PYTHONPATH": ":".join(map(str, sglang_paths))}
    out = subprocess.run([sys.executable, "-c", _ROUTER_ARGS, json.dumps(job.argv)], capture_output=True,
                         text=True, env=env, timeout=120, check=True).stdout
    assert json.loads(out) == {"worker_urls": [f"http://{ENGINE}"], "prometheus_host": "127.0.0.1"}
    assert {"--worker-urls", "--router-prometheus-host"} <= {s.name for s in job.substitutions}


def test_read_metrics_reads_miles_rollout_and_eval_lines(tmp_path):
    log = tmp_path / "miles.log"
    prefix = "(RolloutManager pid=1, ip=127.0.0.1) [2026-12-02 18:00:00 miles] metrics.py:99 - "
    log.write_text("\n".join([
        "unrelated line",
        prefix + "eval 0: {'eval/aime': 0.0, 'eval/aime-pass@4': np.float64(0.25), "
                 "'eval/aime-none_reward_ratio': 0.0, 'eval/aime-truncated_ratio': 1.0}",
        prefix + "perf 0: {'rollout/response_len/mean': 24.0, 'perf/rollout_time': 3.5}",
        prefix + "rollout 0: {'rollout/raw_reward': 0.0, 'rollout/step': 0}",
        prefix + "perf 1: {'rollout/response_len/mean': 20.0} [repeated 2x across cluster]",
    ]) + "\n")
    m = read_metrics(log)
    assert m.rollouts == {"0": {"rollout/response_len/mean": 24.0, "perf/rollout_time": 3.5,
                                "rollout/raw_reward": 0.0},
                          "1": {"rollout/response_len/mean": 20.0}}
    assert m.evals == [{"rollout": 0, "datasets": {"aime": {"reward": 0.0, "pass@4": 0.25, "none_reward_ratio": 0.0,
                                                            "truncated_ratio": 1.0}}}]
    assert read_metrics(tmp_path / "absent.log").rollouts == {}


@pytest.mark.slow
@pytest.mark.parametrize("generation", ["miles_tree", "miles_gen2_tree"])
def test_rollout_stage_runs_miles_train_py(generation, request, sglang_paths, tmp_path):
    miles = request.getfixturevalue(generation)
    report = rehearse(RehearsalRequest(miles_dir=str(miles), work_dir=str(tmp_path), timeout_s=900))
    stage = report.stages["rollout"]
    assert stage["ok"], stage["error"]
    assert sorted(report.rollouts) == ["0", "1"]  # --num-rollout 2: Miles' own rollout-side metrics of each
    assert all(0 < r["rollout/response_len/mean"] <= 24 for r in report.rollouts.values())
    assert {"pass@1", "pass@4", "truncated_ratio"} <= set(report.evals[0]["datasets"]["aime"])
    assert any(s.name == "--rollout-external" for s in report.substitutions)


def test_ray_temp_dir_stays_within_the_unix_socket_limit(tmp_path):
    from engines.upstream.rehearsal.run import RAY_SOCKET_TAIL, UNIX_SOCKET_MAX, _ray_temp_dir

    short = _ray_temp_dir(tmp_path / ("w" * 80))
    shutil.rmtree(short)
    assert len(str(short)) + RAY_SOCKET_TAIL <= UNIX_SOCKET_MAX
    assert _ray_temp_dir(Path("/tmp/r")) == Path("/tmp/r/ray")


@pytest.mark.parametrize("body,status", [("pass", 0), ("raise ValueError('x')", 1), ("sys.exit(3)", 3)])
def test_driver_exit_keeps_its_status_and_runs_atexit_handlers(tmp_path, body, status):
    """The driver ends through os._exit after the other atexit handlers (Ray's shutdown among them): the status
    is the script's own, handlers registered after the bootstrap (as Ray's are) still ran, and what would hang
    later in the interpreter's teardown (as _raylet.so's destructors do; here a finalizer) never runs."""
    from engines.upstream.rehearsal.run import BOOTSTRAP

    script = tmp_path / "train.py"
    script.write_text("import atexit, sys, time\natexit.register(lambda: print('ray shutdown ran'))\n"
                      "class HangsAtTeardown:\n    def __del__(self, sleep=time.sleep):\n        sleep(600)\n"
                      f"held = HangsAtTeardown()\n{body}\n")
    env = {"PYTHONPATH": str(BOOTSTRAP), "V4RL_REHEARSAL_DRIVER": str(script), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=30)
    assert done.returncode == status and "ray shutdown ran" in done.stdout, done.stderr


def test_a_patch_the_bootstrap_cannot_apply_is_one_line_naming_it(tmp_path):
    """Stage full's broadcast recorder against a Miles whose broadcast module lacks the function it wraps: the import
    fails with one line naming the patch and the module, not a traceback through Miles' import."""
    from engines.upstream.rehearsal.run import BOOTSTRAP

    module = "miles/backends/megatron_utils/update_weight/update_weight_from_distributed/broadcast.py"
    for parent in Path(module).parents:
        if str(parent) != ".":
            (tmp_path / parent).mkdir(parents=True, exist_ok=True)
            (tmp_path / parent / "__init__.py").write_text("")
    (tmp_path / module).write_text("def something_else():\n    pass\n")
    env = {"PYTHONPATH": f"{BOOTSTRAP}:{tmp_path}", "PATH": "/usr/bin:/bin", "V4RL_REHEARSAL_BROADCASTS": str(tmp_path),
           "V4RL_REHEARSAL_ENGINE_URL": "http://127.0.0.1:9"}
    done = subprocess.run([sys.executable, "-c", f"import {module[:-3].replace('/', '.')}"], capture_output=True,
                          text=True, env=env, timeout=60)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and last.startswith("RuntimeError: v4rl's rehearsal bootstrap cannot apply "
                                                    "_record_broadcasts to miles.backends."), done.stderr
    assert "AttributeError" in last and "update_weights_from_distributed" in last, last


def test_a_workaround_stands_aside_where_miles_lacks_the_function_it_wraps(tmp_path):
    """The placement workaround against a Miles whose placement module has no _get_placement_group_layout (the
    seed's PR-head): the module imports as it is, so Miles goes on to its own messages."""
    from engines.upstream.rehearsal.run import BOOTSTRAP

    (tmp_path / "miles" / "ray").mkdir(parents=True)
    for init in ("miles/__init__.py", "miles/ray/__init__.py"):
        (tmp_path / init).write_text("")
    (tmp_path / "miles/ray/placement_group.py").write_text("def create_placement_groups(args):\n    return 'own'\n")
    env = {"PYTHONPATH": f"{BOOTSTRAP}:{tmp_path}", "PATH": "/usr/bin:/bin", "V4RL_REHEARSAL_WORKAROUNDS": "placement"}
    done = subprocess.run([sys.executable, "-c", "import miles.ray.placement_group as m; "
                           "print(m.create_placement_groups(None), hasattr(m, '_get_placement_group_layout'))"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0 and done.stdout.split() == ["own", "False"], done.stderr


def test_generation_2_job_lays_the_tiny_model_on_one_stage(tmp_path):
    """Generation 2 writes the stage sizes into --pipeline-model-parallel-layout: the cluster's PP4 with a
    10-layer last stage cannot split 4 layers, so the job is built at one device's parallelism."""
    import dataclasses

    from engines.presets.runs import SEED_RUN

    preset = dataclasses.replace(SEED_RUN, miles=dataclasses.replace(SEED_RUN.miles, generation=2))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(tiny_miles_config().to_hf_dict()))
    job = rehearsal_job(preset, RehearsalPaths(hf, tmp_path / "t.jsonl", tmp_path / "e.jsonl", tmp_path),
                        engine_addr=ENGINE, context_length=4096)
    argv = job.argv
    assert argv[argv.index("--pipeline-model-parallel-size") + 1] == "1"
    rows = {s.name: s for s in job.substitutions}
    assert "|" not in rows["--pipeline-model-parallel-layout"].rehearsal
    assert rows["--pipeline-model-parallel-layout"].cluster.count("|") == 3


def _gen2_job(tmp_path, stage: str, layout: str):
    import dataclasses

    from engines.presets.runs import SEED_RUN

    preset = dataclasses.replace(SEED_RUN, miles=dataclasses.replace(SEED_RUN.miles, generation=2,
                                                                     dsv4_impl="megatron"))
    hf = tmp_path / "hf"
    hf.mkdir(exist_ok=True)
    (hf / "config.json").write_text(json.dumps(tiny_miles_config().to_hf_dict()))
    return rehearsal_job(preset, RehearsalPaths(hf, tmp_path / "t.jsonl", tmp_path / "e.jsonl", tmp_path),
                         engine_addr=ENGINE, context_length=4096, stage=stage, layout=layout)


@pytest.mark.parametrize("stage", ["train", "full"])
def test_layout_pp2_ep2_sets_the_parallel_flags_gpus_and_rows(tmp_path, stage):
    """--layout pp2-ep2: 4 logical GPUs, PP 2 (generation 2's layout string, 2 layers per stage) x DP 2, EP 2;
    every flag that differs from the cluster's is a row saying both values; Ray gets the 4 GPUs."""
    from engines.miles.command import parse_flags

    job = _gen2_job(tmp_path, stage, "pp2-ep2")
    flags = parse_flags(job.argv)
    assert {f: flags[f] for f in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                                  "--pipeline-model-parallel-layout", "--expert-model-parallel-size",
                                  "--expert-tensor-parallel-size", "--actor-num-nodes", "--actor-num-gpus-per-node",
                                  "--num-gpus-per-node")} == {
        "--tensor-model-parallel-size": ["1"], "--pipeline-model-parallel-size": ["2"],
        "--pipeline-model-parallel-layout": ["Et*2|t*2L"], "--expert-model-parallel-size": ["2"],
        "--expert-tensor-parallel-size": ["1"], "--actor-num-nodes": ["1"], "--actor-num-gpus-per-node": ["4"],
        "--num-gpus-per-node": ["4"]}
    assert "--decoder-last-pipeline-num-layers" not in flags
    rows = {s.name: (s.cluster, s.rehearsal) for s in job.substitutions}
    assert rows["--pipeline-model-parallel-size"] == ("4", "2")
    assert rows["--expert-model-parallel-size"] == ("4", "2")
    assert rows["--pipeline-model-parallel-layout"] == ("Et*11|t*11|t*11|t*10L", "Et*2|t*2L")
    assert rows["--actor-num-gpus-per-node"] == ("8", "4")
    assert "--tensor-model-parallel-size" not in rows  # TP 1 on the cluster too
    assert rows["Ray"][1] == "local head, logical GPUs (--num-gpus 4)" and job.ray == {"num_gpus": 4, "num_cpus": 7}
    assert job.env["GLOO_SOCKET_IFNAME"] == "lo" and rows["GLOO_SOCKET_IFNAME"][1] == "lo"
    # the machine's cores shared by the 4 ranks (Ray alone would give each rank 1 thread)
    assert rows["OMP_NUM_THREADS"][1] == job.env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 4))
    assert Path(job.env["V4RL_REHEARSAL_STORE_DIR"]).parent == tmp_path / "stores"


@pytest.mark.slow
def test_miles_parse_args_accepts_the_pp2_ep2_job_and_megatron_builds_its_config(tmp_path, miles_gen2_tree,
                                                                                megatron_gen2_tree, sglang_paths):
    """Miles e9e19b223's own parse_args and Megatron-LM 6184c094a's TransformerConfig on the stage-train job at
    --layout pp2-ep2 (about 40 s): the layout string with the hash layer on stage 0 is accepted (conformance C7)."""
    import dataclasses

    from engines.presets.runs import SEED_RUN
    from engines.profiles import get_profile
    from engines.presets.runs import layout_input
    from engines.miles import MilesJob
    from engines.miles.command import MilesCommand
    from engines.upstream.miles_preflight import check_command

    job = _gen2_job(tmp_path, "train", "pp2-ep2")
    preset = dataclasses.replace(SEED_RUN, miles=dataclasses.replace(SEED_RUN.miles, generation=2,
                                                                     dsv4_impl="megatron"))
    profile = get_profile(preset.profile)
    miles_job = MilesJob(run_id="rehearsal", hf_checkpoint=str(tmp_path / "hf"), ref_load=str(tmp_path / "ref"),
                         save_dir=str(tmp_path / "save"))
    check = check_command(MilesCommand(argv=job.argv, env=job.env, miles_dir=str(miles_gen2_tree), generation=2),
                          preset, miles_job,
                          cluster=layout_input(preset, profile=profile).cluster, profile=profile,
                          miles_dir=miles_gen2_tree, megatron_dir=megatron_gen2_tree)
    assert check.accepted, check.error
    r = check.resolved
    assert (r["pipeline_model_parallel_size"], r["expert_model_parallel_size"], r["actor_num_gpus_per_node"],
            r["pipeline_model_parallel_layout"]) == (2, 2, 4, "Et*2|t*2L")
    assert check.stage == "config" and r["config"]["pipeline_model_parallel_layout"] == "Et*2|t*2L"


def test_stage_rollouts_idle_actor_stays_at_layout_1(tmp_path):
    """Miles' --debug-rollout-only resizes its idle actor to --rollout-num-gpus (1): PP 2 cannot be laid on it."""
    from engines.miles.command import parse_flags

    job = _gen2_job(tmp_path, "rollout", "pp2-ep2")
    flags = parse_flags(job.argv)
    assert (flags["--pipeline-model-parallel-size"], flags["--actor-num-gpus-per-node"]) == (["1"], ["1"])
    row = next(s for s in job.substitutions if s.name == "--layout pp2-ep2 (stage rollout)")
    assert row.rehearsal == "layout 1 (TP/PP/EP 1)" and "--rollout-num-gpus" in row.why


def test_layout_1_is_todays_single_gpu_job(tmp_path):
    from engines.miles.command import parse_flags

    job = _gen2_job(tmp_path, "train", "1")
    flags = parse_flags(job.argv)
    assert (flags["--pipeline-model-parallel-size"], flags["--expert-model-parallel-size"],
            flags["--actor-num-gpus-per-node"]) == (["1"], ["1"], ["1"])
    assert "--pipeline-model-parallel-layout" not in flags and job.ray == {"num_gpus": 2, "num_cpus": 4}
    assert "GLOO_SOCKET_IFNAME" not in job.env and "V4RL_REHEARSAL_STORE_DIR" not in job.env
    assert job.env["OMP_NUM_THREADS"] == str(os.cpu_count() or 1)  # one rank: every core while it trains


def test_an_unknown_layout_is_one_line():
    with pytest.raises(RehearsalError, match=r"^--layout pp3: not a rehearsal layout; use one of 1, pp2-ep2$"):
        rehearse(RehearsalRequest(stage="train", layout="pp3"))


def test_the_layout_option_reads_its_one_definition():
    """`v4rl rehearse --layout`: default and help are RehearsalRequest.layout's (rl/field_docs.py)."""
    import dataclasses

    from v4rl import cmd_rehearse

    default = {f.name: f.default for f in dataclasses.fields(RehearsalRequest)}["layout"]
    assert cmd_rehearse._LAYOUT[0] == default == "1" and "pp2-ep2" in cmd_rehearse._LAYOUT[1]


def test_a_request_the_engine_refuses_stops_miles_at_once_with_the_engines_reason(tmp_path):
    """Miles retries a refused /generate for a minute; the rehearsal stops it as the engine logs the refusal."""
    import time

    from engines.upstream.rehearsal.run import _run_miles
    from engines.rollout.server import REFUSAL_PREFIX

    miles = tmp_path / "miles"
    miles.mkdir()
    (miles / "train.py").write_text("import time\ntime.sleep(120)\n")  # Miles, retrying
    (tmp_path / "engine.log").write_text(f"serving ...\n{REFUSAL_PREFIX}POST /generate: HTTP 400 "
                                         '{"error": {"message": "return_routed_experts needs the server flag"}}\n')
    started = time.monotonic()
    error = _run_miles(miles, [], {}, tmp_path, timeout=60)
    assert time.monotonic() - started < 10
    assert error.startswith("v4rl's engine refused Miles' request: POST /generate: HTTP 400") and \
        "needs the server flag" in error, error


MODEL_IMPLS = [pytest.param("miles_gen2_tree", "megatron", id="gen2-megatron"),
               pytest.param("miles_gen2_tree", "miles", id="gen2-miles"),
               pytest.param("miles_tree", None, id="gen1")]
"""The Miles generations and DeepSeek-V4 implementations stages train and full run: generation 2's Megatron
attention (--dsa-kernel-backend none), generation 2's and generation 1's Miles model, whose tilelang sparse
attention and indexer run as numeric_standins.py's forward and backward interfaces (tests/test_numeric_standins.py
gradchecks them), generation 1's TileKernels mHC ops as the package's own torch references."""


@pytest.mark.slow
@pytest.mark.parametrize("generation,impl", MODEL_IMPLS)
def test_train_stage_trains_miles_megatron_actor_on_the_rollout_stages_data(generation, impl, request, sglang_paths,
                                                                          tmp_path):
    import math

    miles = request.getfixturevalue(generation)
    report = rehearse(RehearsalRequest(stage="train", miles_dir=str(miles), work_dir=str(tmp_path),
                                       dsv4_impl=impl, timeout_s=900))
    assert report.stages["rollout"]["ok"], report.stages["rollout"]["error"]
    assert report.stages["train"]["ok"], report.stages["train"]["error"]
    for rollout in ("0", "1"):
        values = report.rollouts[rollout]
        for name in ("train/loss", "train/grad_norm", "train/tis", "train/tis_clipfrac",
                     "train/train_rollout_logprob_abs_diff"):
            assert math.isfinite(values[name]), (rollout, name, values.get(name))
        assert values["train/train_rollout_logprob_abs_diff"] <= report.logprob_bound["bound"], values
    assert 0 < report.logprob_bound["bf16_noise"] < report.logprob_bound["raw_vs_processed"], report.logprob_bound
    assert {"--debug-train-only", "--load-debug-rollout-data"} <= {s.name for s in report.substitutions}


LAYOUT_IMPLS = [pytest.param("miles_gen2_tree", "megatron", "pp2-ep2", id="gen2-megatron-pp2-ep2"),
                pytest.param("miles_gen2_tree", "miles", "pp2-ep2", id="gen2-miles-pp2-ep2"),
                pytest.param("miles_tree", None, "pp2-ep2", id="gen1-pp2-ep2")]
"""The multi-rank layouts stages train and full run (job.py LAYOUTS): Miles' Megatron actor on 4 gloo ranks, PP 2 x
DP 2 and EP 2, for each model of MODEL_IMPLS."""


@pytest.mark.slow
@pytest.mark.parametrize("generation,impl,layout", LAYOUT_IMPLS)
def test_train_stage_trains_at_a_multi_rank_layout(generation, impl, layout, request, sglang_paths, tmp_path):
    """Stage train at --layout pp2-ep2: Miles' actor on 4 ranks loads v4rl's torch_dist conversion (written at no
    parallelism; Megatron reshards it to 2 stages and 2 expert ranks), trains one step per rollout, every Miles
    train metric finite, and saves."""
    import math

    miles = request.getfixturevalue(generation)
    report = rehearse(RehearsalRequest(stage="train", miles_dir=str(miles), work_dir=str(tmp_path),
                                       dsv4_impl=impl, layout=layout, timeout_s=1500))
    assert report.stages["rollout"]["ok"], report.stages["rollout"]["error"]
    assert report.stages["train"]["ok"], report.stages["train"]["error"]
    for rollout in ("0", "1"):
        values = report.rollouts[rollout]
        for name in ("train/loss", "train/grad_norm", "train/tis", "train/train_rollout_logprob_abs_diff"):
            assert math.isfinite(values[name]), (rollout, name, values.get(name))
    rows = {s.name: s.rehearsal for s in report.substitutions}
    assert rows["--pipeline-model-parallel-size"] == "2" and rows["--expert-model-parallel-size"] == "2"
    if report.generation == 2:  # generation 1 splits 4 layers evenly over 2 stages without a layout flag
        assert rows["--pipeline-model-parallel-layout"] == "Et*2|t*2L"
    assert (tmp_path / "save" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


FULL_ROLLOUT_IDS = ["0", "1", "2"]
FULL_IN_THE_DEFAULT_RUN = None
"""Stage full is `slow` in every generation: its Miles loop, kill and resume run in the default run through the
cluster path's own code, the cluster-rehearsal deployment (tests/conformance/test_cluster_rehearsal.py, which also
checks every broadcast), where stage full's generation-1 run took 2 min 46 s on the idle 2 cores."""
FULL_IMPLS = [p if p.id == FULL_IN_THE_DEFAULT_RUN else pytest.param(*p.values, id=p.id, marks=pytest.mark.slow)
              for p in MODEL_IMPLS]


@pytest.mark.parametrize("generation,impl", FULL_IMPLS)
def test_full_stage_runs_miles_loop_kill_and_resume(generation, impl, request, sglang_paths, tmp_path):
    """Stage 3, each generation and implementation: Miles' normal loop against v4rl's engine, a kill after
    rollout 1's save, the resume from --load at rollout 2; the engine equals the actor's export after every
    broadcast, and the resumed actor sends exactly what the engine had before the kill."""
    import math

    miles = request.getfixturevalue(generation)
    submitted = request.node.callspec.id == FULL_IN_THE_DEFAULT_RUN
    report = rehearse(RehearsalRequest(stage="full", miles_dir=str(miles), work_dir=str(tmp_path),
                                       dsv4_impl=impl, timeout_s=900, submit="ray-job" if submitted else "driver"))
    stage = report.stages["full"]
    assert stage["ok"], stage["error"]
    if submitted:  # both runs through ClusterRun.submit: the run directory holds each rollout and evaluation once
        import json

        rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [row["step"] for row in rows] == [1, 2, 3] and all("train/grad_norm" in row for row in rows), rows
        assert sorted(p.name for p in (tmp_path / "run" / "eval").iterdir()) == [
            f"step_{step:06d}.json" for step in range(4)]
        assert "submitted successfully" in (tmp_path / "miles-full-resume.log").read_text()
    assert sorted(report.rollouts) == FULL_ROLLOUT_IDS
    for rollout in FULL_ROLLOUT_IDS:
        values = report.rollouts[rollout]
        assert math.isfinite(values["train/grad_norm"]) and values["train/grad_norm"] > 0, values
        assert values["train/train_rollout_logprob_abs_diff"] <= report.logprob_bound["broadcast_bound"], values
    # run 1: the initial broadcast and one per trained rollout (0, 1); the resume: its initial one and rollout 2's
    assert [(c["run"], c["version"]) for c in report.weight_checks] == [
        ("run-1", 1), ("run-1", 2), ("run-1", 3), ("resume", 1), ("resume", 2)]
    assert all(c["ok"] and c["tensors_sent"] > 0 for c in report.weight_checks), report.weight_checks
    assert report.resumed_from == {"latest_checkpointed_iteration": 1, "rollout_id": 2,
                                   "export_equals_last_before_kill": True, "training_moved_the_export": True}
    assert {"pass@1", "pass@4"} <= set(report.evals[0]["datasets"]["aime"]) and len(report.evals) >= 5


@pytest.mark.slow
@pytest.mark.parametrize("generation,impl,layout", LAYOUT_IMPLS)
def test_full_stage_at_a_multi_rank_layout(generation, impl, layout, request, sglang_paths, tmp_path):
    """Stage full at --layout pp2-ep2: each pipeline stage's source rank broadcasts its layers (the experts gathered
    over EP 2) into v4rl's engine, which then equals the actor's export after every broadcast; the kill, and the
    resume from the PP 2 / EP 2 checkpoint Miles saved, as at layout 1."""
    import math

    miles = request.getfixturevalue(generation)
    report = rehearse(RehearsalRequest(stage="full", miles_dir=str(miles), work_dir=str(tmp_path),
                                       dsv4_impl=impl, layout=layout, timeout_s=1800))
    stage = report.stages["full"]
    assert stage["ok"], stage["error"]
    assert sorted(report.rollouts) == FULL_ROLLOUT_IDS
    assert all(math.isfinite(report.rollouts[r]["train/grad_norm"]) and report.rollouts[r]["train/grad_norm"] > 0
               for r in FULL_ROLLOUT_IDS), report.rollouts
    assert [(c["run"], c["version"]) for c in report.weight_checks] == [
        ("run-1", 1), ("run-1", 2), ("run-1", 3), ("resume", 1), ("resume", 2)]
    assert all(c["ok"] and c["tensors_sent"] > 0 for c in report.weight_checks), report.weight_checks
    assert report.resumed_from == {"latest_checkpointed_iteration": 1, "rollout_id": 2,
                                   "export_equals_last_before_kill": True, "training_moved_the_export": True}
    assert sorted(p.name for p in (tmp_path / "broadcasts" / "run-1").glob("broadcast-v1.*")) == [
        "broadcast-v1.json", "broadcast-v1.pp0.safetensors", "broadcast-v1.pp1.safetensors"]


def _miles_sending_zero_tid2eid(miles: Path, tmp_path: Path) -> Path:
    """A copy of Miles (from the vendored tree, patched in tmp) whose weight update converts the hash-routing
    table to zeros: the defect Miles' own weight checker caught in radixark/miles PR #2706."""
    copy = tmp_path / "miles-zero-tid2eid"
    shutil.copytree(miles, copy, ignore=shutil.ignore_patterns("tests", "docker", "*.pyc"))
    converter = copy / "miles/backends/megatron_utils/megatron_to_hf/deepseekv4.py"
    text = converter.read_text()
    sent = 'return [(f"model.layers.{layer_idx}.mlp.topk.tid2eid", param)]'
    assert text.count(sent) == 1, "Miles' converter changed: update the planted defect"
    converter.write_text(text.replace(sent, sent.replace("param)", "param.new_zeros(param.shape))")))
    return copy


@pytest.mark.slow
def test_full_stage_fails_naming_a_zeroed_hash_routing_table(miles_gen2_tree, sglang_paths, tmp_path):
    miles = _miles_sending_zero_tid2eid(miles_gen2_tree, tmp_path)
    report = rehearse(RehearsalRequest(stage="full", miles_dir=str(miles), work_dir=str(tmp_path / "work"),
                                       dsv4_impl="megatron", timeout_s=900, submit="ray-job"))
    stage = report.stages["full"]  # the engine's refusal stopped the Ray job (`ray job stop`) naming the tensor
    assert not stage["ok"] and "tid2eid" in stage["error"], stage
    assert "model.layers.0.mlp.topk.tid2eid" in stage["error"], stage["error"]
