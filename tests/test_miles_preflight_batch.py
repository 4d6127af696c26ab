"""The preflight's batched probe (engines/upstream/miles_preflight.py check_requests, probes/parse_args_probe.py),
against a stand-in Miles + Megatron + torch written to tmp_path: each argv of one probe process gets its own
answer, what one parse sets in os.environ does not reach the next, a refused or failing argv does not spoil the
others, and a process that dies on an argv answers that argv with its exit while the rest go to a fresh one.
About 2 s (no real Miles import).

    .venv/bin/python -m pytest tests/test_miles_preflight_batch.py -q
"""

from __future__ import annotations

import textwrap

FAKE_TORCH = """
import types
cuda = types.SimpleNamespace()
_deterministic = [False, False]
def use_deterministic_algorithms(on, warn_only=False):
    _deterministic[:] = [on, warn_only]
def are_deterministic_algorithms_enabled():
    return _deterministic[0]
def is_deterministic_algorithms_warn_only_enabled():
    return _deterministic[1]
"""
FAKE_MILES_ARGUMENTS = """
import argparse, os, sys, types
import torch

def parse_args():
    argv = sys.argv[1:]
    assert "V4RL_TEST_LEAK" not in os.environ, "a previous parse's os.environ reached this one"
    assert not torch.are_deterministic_algorithms_enabled(), "a previous parse's torch state reached this one"
    os.environ["V4RL_TEST_LEAK"] = "1"  # what Megatron's --deterministic-mode does to NCCL_ALGO and friends
    torch.use_deterministic_algorithms(True)
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-rollout", type=int, required=True)
    parser.add_argument("--fail", action="store_true")
    parser.add_argument("--die", action="store_true")
    args = parser.parse_args(argv)
    print("Miles log line of", argv, file=sys.stderr)
    if args.die:
        os._exit(7)
    assert not args.fail, f"num_rollout {args.num_rollout} refused"
    return args
"""
FAKE_MEGATRON_ARGUMENTS = """
import types
def core_transformer_config_from_args(args):
    return types.SimpleNamespace(num_layers=args.num_rollout)
"""


def _stand_ins(root):
    for rel, text in {"torch/__init__.py": FAKE_TORCH, "miles/__init__.py": "", "miles/utils/__init__.py": "",
                      "miles/utils/arguments.py": FAKE_MILES_ARGUMENTS, "megatron/__init__.py": "",
                      "megatron/training/__init__.py": "", "megatron/training/arguments.py": FAKE_MEGATRON_ARGUMENTS
                      }.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_each_argv_of_one_probe_process_is_answered_on_its_own(tmp_path, monkeypatch):
    from engines.presets.runs import SEED_RUN, layout_input
    from engines.profiles import get_profile
    from engines.miles import MilesJob
    from engines.miles.command import MilesCommand
    from engines.upstream import miles_preflight as preflight
    from engines.upstream import sources

    processes = []
    real = sources.engine_python

    def counted(*args, **kwargs):
        processes.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(sources, "engine_python", counted)
    hf = tmp_path / "hf"
    hf.mkdir()  # a local checkpoint directory: the argv goes as given
    job = MilesJob(run_id="r", hf_checkpoint=str(hf), ref_load="/ref", save_dir=str(tmp_path / "save"))
    argvs = [["--num-rollout", "1"], ["--num-rollout", "2", "--fail"], ["--num-rollout", "3", "--bogus"],
             ["--num-rollout", "4", "--die"], ["--num-rollout", "5"], ["--num-rollout", "6"]]
    profile = get_profile(SEED_RUN.profile)
    cluster = layout_input(SEED_RUN, profile=profile).cluster
    requests = [preflight.CheckRequest(MilesCommand(argv=a, env={}, miles_dir="/m"), SEED_RUN, job, cluster, profile)
                for a in argvs]
    answers = preflight._probe(requests, [_stand_ins(tmp_path / "engines")], preflight.DEVICES["mi355x"], {}, 60)

    assert len(answers) == len(argvs) and len(processes) == 2  # the argvs after the one it died on: a fresh one
    assert [a["accepted"] for a in answers] == [True, False, False, False, True, True]
    assert [a["resolved"]["num_rollout"] for a in answers if a["accepted"]] == [1, 5, 6]
    assert answers[0]["resolved"]["config"]["num_layers"] == 1 and answers[0]["stage"] == "config"
    assert answers[1]["stage"] == "validate" and "num_rollout 2 refused" in answers[1]["error"]
    assert "Miles log line of ['--num-rollout', '1']" not in answers[1]["error"]  # its own stderr only
    assert answers[2]["rejected"] == ["--bogus"] and answers[2]["stage"] == "parse"
    assert answers[3]["error"].startswith("the Miles probe exited 7 without an answer")
    assert "Miles log line of ['--num-rollout', '4', '--die']" in answers[3]["error"]
