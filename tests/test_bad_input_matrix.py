"""Bad input as a class (issue 40): every `v4rl` command and flow parameter that takes a path or a checkpoint,
crossed with the inputs a user hands by mistake (missing, empty, a file where a folder belongs and the reverse, a
run directory, another model's checkpoint, an export, a checkpoint cut short or partly written, unreadable, on a
read-only place or a full disk). Each case asserts the exit code (1 or 2, never a crash), no traceback, and ONE
`error:` line naming the input and the fix. The same from inside Ray actors: a training checkpoint damaged on disk
when a run resumes is one line naming it and the way to resume. And `v4rl export` gives its output the tokenizer of
the checkpoint it came from, so the rollout engine takes text prompts.

Cheap by construction: one real 2-step run (in-process, no Ray) and one export are the shared fixtures; the
commands run in-process (typer's CliRunner); unreadable files and full disks run in ONE subprocess that drops
root's CAP_DAC_OVERRIDE and mounts small tmpfs disks in its own mount namespace (skipped, with the reason, where
that is not allowed); one subprocess starts Ray. Combinations tests/test_bad_inputs_cli.py already covers are
left out (DUPLICATES).

    .venv/bin/python -m pytest tests/test_bad_input_matrix.py -q             # default cases, under a minute
    .venv/bin/python -m pytest tests/test_bad_input_matrix.py -q -m slow     # + a failing rollout actor, no-Ray
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_bad_inputs_cli import read_only  # noqa: F401 - the read-only folder fixture (chattr +i as root)

REPO = Path(__file__).resolve().parent.parent
RUN_ARGS = "--no-ray --steps 1 --eval-interval 0 --prompts-per-step 1 --n-samples 2"
"""Appended to every `train` case: should a bad input ever get through, the run costs seconds, not an hour."""


# ============================================================================================== the inputs


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _invoke(argv: list[str]) -> dict:
    """One `v4rl` command in this process: exit code, stdout, stderr, and an exception that is not an exit."""
    from typer.testing import CliRunner

    from v4rl.cli import app

    result = CliRunner().invoke(app, argv)
    crash = result.exception if not isinstance(result.exception, SystemExit) else None
    return {"code": result.exit_code, "stdout": result.stdout, "stderr": result.stderr,
            "exception": None if crash is None else repr(crash)}


def _params(fields: dict) -> dict:
    """PipelineParams(**fields) as a command would answer it: exit 1 and each validation message as a line."""
    from pydantic import ValidationError

    from flows.params import PipelineParams

    try:
        PipelineParams(**fields)
    except ValidationError as exc:
        return {"code": 1, "stdout": "", "stderr": "".join(f"error: {e['msg']}\n" for e in exc.errors()),
                "exception": None}
    except Exception as exc:  # noqa: BLE001 - a validator that crashes: the case fails, naming it
        return {"code": 1, "stdout": "", "stderr": "", "exception": repr(exc)}
    return {"code": 0, "stdout": "", "stderr": "", "exception": None}


def _run_case(case: dict) -> dict:
    return _params(case["fields"]) if "fields" in case else _invoke(case["argv"])


@pytest.fixture(scope="module")
def made(tmp_path_factory, tiny_base):
    """The inputs, once for the module: a real `v4rl train` run of 2 steps (checkpoints of steps 1 and 2,
    weights/current), its export, and the damaged, empty, foreign and misplaced things a user hands instead."""
    from safetensors.numpy import save_file

    b = tmp_path_factory.mktemp("matrix")
    run = b / "run"
    res = _invoke(["train", "--out", str(run), *shlex.split(RUN_ARGS), "--steps", "2", "--save-interval", "1"])
    assert res["code"] == 0 and (run / "checkpoints" / "iter_0000002").is_dir(), res
    res = _invoke(["export", str(run / "checkpoints"), str(b / "export"), "--format", "hf-fp8", "--workers", "1",
                   "--no-progress"])
    assert res["code"] == 0, res
    (b / "empty").mkdir()
    (b / "afile").write_text("not a folder")
    (b / "folder.jsonl").mkdir()
    (b / "seqs.json").write_text(json.dumps([{"prompt_ids": [1, 2, 3], "response_ids": [4, 5]}]))
    other = b / "llama"  # another model: a config.json and weights of its own
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                   "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 128}))
    import numpy as np

    save_file({"model.embed_tokens.weight": np.zeros((128, 64), dtype=np.float32)}, str(other / "model.safetensors"))
    shutil.copytree(tiny_base, b / "other_shape")  # DeepSeek-V4, but its config says another shape than its weights
    config = json.loads((b / "other_shape" / "config.json").read_text())
    (b / "other_shape" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    shutil.copytree(tiny_base, b / "cut")
    _truncate(next((b / "cut").glob("*.safetensors")))
    shutil.copytree(tiny_base, b / "no_shard")
    next((b / "no_shard").glob("*.safetensors")).unlink()
    shutil.copytree(tiny_base, b / "bad_config")
    (b / "bad_config" / "config.json").write_text('{"model_type": "deepseek_v4", ')
    shutil.copytree(run / "checkpoints", b / "td_no_metadata")  # a save that never finished its metadata
    (b / "td_no_metadata" / "iter_0000002" / ".metadata").unlink()
    shutil.copytree(run / "checkpoints", b / "td_cut")
    _truncate(b / "td_cut" / "iter_0000002" / "__0_0.distcp")
    return b


# ============================================================================================== the table
# Each role: (id, command line with {X} for the input under test, or PipelineParams fields) and the kinds it is
# crossed with, each kind's expected words (the fix). {B} is the folder of inputs, {TINY} the committed base,
# {TD} the run's training checkpoints (a good torch_dist), {RO} a read-only folder.

HF_ROLES = {
    "train --base": "train --out {B}/new --base {X} " + RUN_ARGS,
    "score --model": "score --model {X} --input {B}/seqs.json --json {B}/o.json",
    "serve-rollout --model": "serve-rollout --model {X} --port 0",
    "convert SRC": "convert {X} {B}/new --no-progress",
    "export --like": "export {TD} {B}/new --format hf-fp8 --like {X} --no-progress",
    "verify-ckpt --against": "verify-ckpt {TD} --against {X} --no-progress",
    "align --model": "align --model {X} --torch-dist {TD} --json {B}/a.json --prompts 1",
    "hf_checkpoint": {"hf_checkpoint": "{X}", "runs_root": "{B}/runs"},
}
HF_KINDS = {  # kind: (the path handed, words the line must hold)
    "missing": ("{B}/nope", "no such directory"),
    "empty": ("{B}/empty", "is empty; give the directory of a HF DeepSeek-V4 checkpoint"),
    "file": ("{B}/afile", "is a file, not a directory"),
    "run": ("{B}/run", "is a `v4rl train` run directory, not a HF checkpoint; give its latest weights {B}/run/weights"),
    "torch_dist": ("{B}/run/checkpoints", "export it first: v4rl export"),
    "other model": ("{B}/llama", "holds a 'llama' model (config.json model_type), not DeepSeek-V4"),
    "other shape": ("{B}/other_shape", ("unknown tensor 'layers.1.", "holds a different model than")),
    "cut shard": ("{B}/cut", "is truncated: tensor"),
    "missing shard": ("{B}/no_shard", "which is missing from {B}/no_shard: the checkpoint is partly written"),
    "bad config": ("{B}/bad_config", "config.json is not valid JSON"),
}

TD_ROLES = {
    "export SRC": "export {X} {B}/new --format hf-fp8 --no-progress",
    "verify-ckpt CKPT": "verify-ckpt {X} --no-progress",
    "align --torch-dist": "align --model {TINY} --torch-dist {X} --json {B}/a.json --prompts 1",
}
TD_KINDS = {
    "missing": ("{B}/nope", "no such directory; give a torch_dist checkpoint"),
    "empty": ("{B}/empty", "is empty: it has neither metadata.json nor"),
    "file": ("{B}/afile", "is a file; give a torch_dist checkpoint directory"),
    "run": ("{B}/run", "is a `v4rl train` run directory, not a torch_dist checkpoint; give its training checkpoints"),
    "export": ("{B}/export", "is a HF checkpoint, not a torch_dist one; convert it first"),
    "no .metadata": ("{B}/td_no_metadata", "iter_0000002/.metadata is missing: the checkpoint is partly written"
                                           "{_}To resume from the earlier checkpoint of step 1, write 1 into"),
    "cut chunk file": ("{B}/td_cut", "__0_0.distcp is truncated"),
}

FILE_ROLES = {
    "train --train-data": "train --out {B}/new --train-data {X} " + RUN_ARGS,
    "score --input": "score --model {TINY} --input {X} --json {B}/o.json",
    "plan --model-config": "plan --preset tiny-cpu --model-config {X}",
    "train_data": {"train_data": "{X}", "runs_root": "{B}/runs"},
    "eval_data": {"eval_data": "{X}", "runs_root": "{B}/runs"},
}
FILE_KINDS = {
    "missing": ("{B}/nope.jsonl", ("no such file", "does not exist", "cannot read model config")),
    "folder": ("{B}/folder.jsonl", ("is a directory", "{B}/folder.jsonl/config.json: [Errno 2]")),
    "other model": ("{B}/llama/config.json", ("is 'llama', not 'deepseek_v4'", "expected a JSON list of",
                                              "no 'prompt' column and no 'label' column")),
}

DIR_OUT_ROLES = {
    "train --out": "train --out {X} " + RUN_ARGS,
    "bootstrap --out": "bootstrap --out {X} --max-steps 1",
    "demo --workdir": "demo --workdir {X} --steps 1",
    "convert DST": "convert {TINY} {X} --no-progress",
    "export DST": "export {TD} {X} --format hf-fp8 --no-progress",
    "bench --work-dir": "bench learning --json {B}/b.json --work-dir {X} --steps 1",
    "rehearse --work-dir": "rehearse --work-dir {X} --miles-dir {B}/empty",
    "runs_root": {"runs_root": "{X}"},
}
DIR_OUT_KINDS = {
    "file": ("{B}/afile", "is a file; give a directory"),
    "under a file": ("{B}/afile/sub", "{B}/afile is a file, not a folder"),
    "read-only": ("{RO}/sub", "cannot write in {RO} "),
    "checkpoint": ("{B}/cut", ("is a HF checkpoint; give a new directory", "already holds a HF checkpoint",
                                  "already exists and holds")),
    "run": ("{B}/run", ("is a `v4rl train` run directory; give a new directory",
                        "already holds a `v4rl train` run directory, which this command would replace whole",
                        "already exists and holds")),
}
DIR_OUT_TAKES = {  # what each command takes as it is: a run resumes, a checkpoint is replaced, a work dir reused
    ("train --out", "run"), ("bootstrap --out", "checkpoint"), ("bench --work-dir", "run"),
    ("rehearse --work-dir", "checkpoint"), ("rehearse --work-dir", "run"), ("bench --work-dir", "checkpoint"),
    ("runs_root", "checkpoint"), ("runs_root", "run"),
    ("train_data", "other model"), ("eval_data", "other model"),  # a .json file: preflight reads its rows
    ("hf_checkpoint", "other shape"),  # validation imports no torch: the flow's preflight reads the tensors
}

FILE_OUT_ROLES = {
    "score --json": "score --model {TINY} --input {B}/seqs.json --json {X}",
    "verify-ckpt --json": "verify-ckpt {TD} --json {X} --no-progress",
    "align --json": "align --model {TINY} --torch-dist {TD} --json {X} --prompts 1",
    "bench --json": "bench convert --json {X}",
    "rehearse --json": "rehearse --json {X} --miles-dir {B}/empty",
}
FILE_OUT_KINDS = {
    "folder": ("{B}/empty", "is a directory; give a file name"),
    "under a file": ("{B}/afile/o.json", "{B}/afile is a file, not a folder"),
    "no folder": ("{B}/nodir/o.json", "the folder {B}/nodir does not exist"),
    "read-only": ("{RO}/o.json", "cannot write in {RO} "),
}

SOURCE_ROLES = {
    "convert --miles-dir": "convert {TINY} {B}/new --miles-dir {X}",
    "plan --miles-dir": "plan --preset dsv4-flash-mi355x --miles-dir {X}",
    "plan --sglang-dir": "plan --preset dsv4-flash-mi355x --sglang-dir {X}",
    "rehearse --miles-dir": "rehearse --miles-dir {X} --work-dir {B}/rehearsal",
    "miles_check_dir": {"preset": "dsv4-flash-mi355x", "miles_check_dir": "{X}", "runs_root": "{B}/runs"},
}
SOURCE_KINDS = {
    "missing": ("{B}/nope", ("does not exist", "no such directory", "holds no sglang")),
    "file": ("{B}/afile", ("is a file", "holds no sglang", "no such directory on this host")),
    "checkpoint": ("{B}/export", ("not a Miles checkout", "holds no sglang")),
}

DUPLICATES = {  # (role, kind) cases tests/test_bad_inputs_cli.py and tests/test_bad_inputs.py already make
    ("train --base", "missing"), ("train --base", "torch_dist"), ("score --model", "torch_dist"),
    ("serve-rollout --model", "missing"), ("convert SRC", "missing"), ("convert SRC", "torch_dist"),
    ("export SRC", "missing"), ("verify-ckpt CKPT", "export"), ("align --torch-dist", "export"),
    ("hf_checkpoint", "missing"), ("train --train-data", "missing"), ("score --input", "missing"),
    ("plan --model-config", "missing"), ("train_data", "missing"), ("train --out", "file"), ("convert DST", "file"),
    ("bootstrap --out", "file"), ("demo --workdir", "file"), ("runs_root", "file"), ("train --out", "read-only"),
    ("bootstrap --out", "read-only"), ("demo --workdir", "read-only"), ("convert DST", "read-only"),
    ("score --json", "read-only"), ("verify-ckpt --json", "no folder"), ("align --json", "under a file"),
    ("bench --json", "no folder"), ("convert --miles-dir", "missing"), ("miles_check_dir", "missing"),
    ("miles_check_dir", "checkpoint"),
}

MATRIX = {f"{role} <- {kind}": (roles[role], kinds[kind])
          for roles, kinds in ((HF_ROLES, HF_KINDS), (TD_ROLES, TD_KINDS), (FILE_ROLES, FILE_KINDS),
                               (DIR_OUT_ROLES, DIR_OUT_KINDS), (FILE_OUT_ROLES, FILE_OUT_KINDS),
                               (SOURCE_ROLES, SOURCE_KINDS))
          for role in roles for kind in kinds
          if (role, kind) not in DUPLICATES and (role, kind) not in DIR_OUT_TAKES
          and not (role == "align --json" and kind == "no folder")}  # align makes the folder: not a mistake


def _fill(text: str, where: dict[str, str]) -> str:
    for key, value in where.items():
        text = text.replace("{" + key + "}", value)
    return text


def _runnable(role: str | dict, where: dict[str, str]) -> dict:
    """A command line or PipelineParams fields, placeholders filled: what _run_case takes."""
    if isinstance(role, dict):
        return {"fields": {k: _fill(v, where) for k, v in role.items()}}
    return {"argv": shlex.split(_fill(role, where))}


def _case(role, kind_spec, where: dict[str, str]) -> tuple[dict, str, tuple[str, ...]]:
    """(the case to run, the path handed, the accepted fix wordings) of one table cell, placeholders filled."""
    handed = _fill(kind_spec[0], where)
    where = {**where, "X": handed}
    fixes = kind_spec[1] if isinstance(kind_spec[1], tuple) else (kind_spec[1],)
    return _runnable(role, where), handed, tuple(_fill(f, where) for f in fixes)


def assert_one_line(case_id: str, res: dict, handed: str, fixes: tuple[str, ...], flag: str = "") -> str:
    """Exit 1 or 2, no traceback anywhere, exactly one `error:` line, naming the input (its path, or `flag`) and
    holding a fix."""
    assert res["exception"] is None, f"{case_id}: crashed: {res['exception']}\n{res['stderr']}"
    assert res["code"] in (1, 2), f"{case_id}: exit {res['code']}\n{res['stdout']}\n{res['stderr']}"
    text = res["stdout"] + res["stderr"]
    assert "Traceback" not in text and '  File "' not in text, f"{case_id}: traceback\n{text}"
    errors = [line for line in res["stderr"].splitlines() if line.startswith("error")]
    assert len(errors) == 1, f"{case_id}: {len(errors)} error lines\n{res['stderr']}"
    line = errors[0]
    stem = handed.split("{_}")[0]
    assert stem in line or str(Path(stem).resolve()) in line or (flag and f"{flag} " in line), \
        f"{case_id}: the line names neither {stem} nor {flag or 'its flag'}: {line}"
    for fix in fixes:
        if all(part in line for part in fix.split("{_}")):
            return line
    raise AssertionError(f"{case_id}: none of {fixes} in: {line}")


@pytest.mark.parametrize("case_id", sorted(MATRIX))
def test_each_path_taking_input_answers_each_mistake_with_one_line(case_id, made, tiny_base, request):
    role, kind_spec = MATRIX[case_id]
    where = {"B": str(made), "TINY": str(tiny_base), "TD": str(made / "run" / "checkpoints")}
    if "{RO}" in kind_spec[0]:
        where["RO"] = str(request.getfixturevalue("read_only"))
    case, handed, fixes = _case(role, kind_spec, where)
    flag = case_id.split(" <- ")[0].split()[-1]
    assert_one_line(case_id, _run_case(case), handed, fixes, flag if flag.startswith("--") else "")
    assert not (made / "new").exists(), f"{case_id}: left {made / 'new'} behind"


# ============================================================================================== unreadable, full disk
# One subprocess for all of them: it drops CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH (root reads chmod-000 files with
# them) and mounts two tmpfs disks in a mount namespace of its own: `full` (filled to the last byte: the up-front
# check) and `small` (2 MiB: a conversion runs out of space while it writes).

MACHINE_CASES = {
    "train --base <- unreadable": ("train --out {B}/new --base {U}/ckpt " + RUN_ARGS, "{U}/ckpt",
                                   "permission denied; make it readable (chmod -R u+rX"),
    "score --model <- unreadable shard": ("score --model {U}/shard --input {B}/seqs.json --json {B}/o.json",
                                          "{U}/shard", "permission denied; make it readable"),
    "export SRC <- unreadable": ("export {U}/td {B}/new --format hf-fp8", "{U}/td", "permission denied"),
    "train --train-data <- unreadable": ("train --out {B}/new --train-data {U}/data.jsonl " + RUN_ARGS,
                                         "{U}/data.jsonl", "permission denied"),
    "score --input <- unreadable": ("score --model {TINY} --input {U}/seqs.json --json {B}/o.json", "{U}/seqs.json",
                                    "permission denied"),
    "hf_checkpoint <- unreadable": ({"hf_checkpoint": "{U}/ckpt", "runs_root": "{B}/runs"}, "{U}/ckpt",
                                    "permission denied"),
    "train --out <- full disk": ("train --out {FULL}/run " + RUN_ARGS, "{FULL}/run", "is full"),
    "bootstrap --out <- full disk": ("bootstrap --out {FULL}/base --max-steps 1", "{FULL}/base", "is full"),
    "score --json <- full disk": ("score --model {TINY} --input {B}/seqs.json --json {FULL}/o.json", "{FULL}/o.json",
                                  "is full (0 KiB free); free space there"),
    "verify-ckpt --json <- full disk": ("verify-ckpt {TD} --json {FULL}/v.json", "{FULL}/v.json", "is full"),
    "runs_root <- full disk": ({"runs_root": "{FULL}/runs"}, "{FULL}/runs", "is full"),
    "convert DST <- disk full while writing": ("convert {TINY} {SMALL}/td --no-progress --workers 1", "{SMALL}/td",
                                               "No space left on device; check free space"),
    "export DST <- disk full while writing": ("export {TD} {SMALL}/hf --format hf-fp8 --no-progress --workers 1",
                                              "{SMALL}/hf", "No space left on device; check free space"),
}


def drive(spec_path: str) -> None:
    """In the subprocess: mark whether chmod 000 still denies, run every case, write the results beside the spec."""
    spec = json.loads(Path(spec_path).read_text())
    Path(spec_path).with_suffix(".started").touch()  # the namespace and the disks are there
    canary = Path(spec["canary"])
    try:
        canary.read_bytes()
        denies = False
    except PermissionError:
        denies = True
    results = {"denies": denies, "cases": {cid: _run_case(case) for cid, case in spec["cases"].items()
                                           if denies or "unreadable" not in cid}}
    Path(spec_path).with_suffix(".out.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def machine_results(made, tiny_base, tmp_path_factory):
    """Runs MACHINE_CASES in one subprocess; skips (with the reason) where namespaces or mounts are not allowed."""
    if not all(shutil.which(tool) for tool in ("unshare", "setpriv", "mount")):
        pytest.skip("unshare, setpriv or mount missing: cannot simulate unreadable files and full disks here")
    root = tmp_path_factory.mktemp("machine")
    u, full, small = root / "u", root / "full", root / "small"
    for d in (u, full, small):
        d.mkdir()
    shutil.copytree(tiny_base, u / "ckpt")
    shutil.copytree(tiny_base, u / "shard")
    shutil.copytree(made / "run" / "checkpoints", u / "td")
    (u / "data.jsonl").write_text('{"prompt": "Compute 1+1.", "label": "2"}\n')
    (u / "seqs.json").write_text((made / "seqs.json").read_text())
    (u / "canary").write_text("root reads this unless CAP_DAC_OVERRIDE is gone")
    for p in (u / "ckpt", next((u / "shard").glob("*.safetensors")), u / "td", u / "data.jsonl", u / "seqs.json",
              u / "canary"):
        p.chmod(0)
    where = {"B": str(made), "TINY": str(tiny_base), "TD": str(made / "run" / "checkpoints"), "U": str(u),
             "FULL": str(full), "SMALL": str(small)}
    cases = {cid: _runnable(line, where) for cid, (line, _, _) in MACHINE_CASES.items()}
    spec = root / "spec.json"
    spec.write_text(json.dumps({"canary": str(u / "canary"), "cases": cases}))
    script = (f"mount -t tmpfs -o size=1m tmpfs {full} && mount -t tmpfs -o size=2m tmpfs {small} && "
              f"(dd if=/dev/zero of={full}/fill bs=4k 2>/dev/null; true) && "
              f"exec {sys.executable} -c 'from tests.test_bad_input_matrix import drive; drive(\"{spec}\")'")
    namespace = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-r", "-m"]
    drop = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all"]
    proc = subprocess.run([*namespace, *drop, "sh", "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=180, env={**os.environ, "PYTHONPATH": str(REPO)})
    for p in (u / "ckpt", u / "td"):  # let pytest remove them later
        p.chmod(0o755)
    out = spec.with_suffix(".out.json")
    if not spec.with_suffix(".started").exists():
        pytest.skip(f"cannot make a mount namespace with small disks here: {proc.stderr.strip()[-300:]}")
    assert out.exists(), f"the driver of the cases died:\n{proc.stderr[-3000:]}"
    return json.loads(out.read_text()), where


@pytest.mark.parametrize("case_id", sorted(MACHINE_CASES))
def test_unreadable_inputs_and_full_disks_are_one_line(case_id, machine_results):
    results, where = machine_results
    if case_id not in results["cases"]:
        pytest.skip("chmod 000 does not deny here even without CAP_DAC_OVERRIDE (a filesystem that ignores modes)")
    _, handed, fix = MACHINE_CASES[case_id]
    assert_one_line(case_id, results["cases"][case_id], _fill(handed, where), (_fill(fix, where),))


# ============================================================================================== resume, Ray actors


RESUME_ARGS = RUN_ARGS + " --steps 3 --save-interval 1"
"""The fixture run's settings, one step further: the resumed run reads its checkpoint of step 2."""


def _damaged_run(made: Path, tmp_path: Path, damage) -> Path:
    run = tmp_path / "run"
    shutil.copytree(made / "run", run)
    damage(run)
    return run


def _cli(args: str, timeout: float = 300) -> dict:
    """The real `v4rl` entry point in a subprocess (Ray starts there; a traceback printed at exit shows)."""
    proc = subprocess.run([sys.executable, "-m", "v4rl.cli", *shlex.split(args)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
    return {"code": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr, "exception": None}


@pytest.mark.parametrize("damage,fix", [
    (lambda run: (run / "checkpoints" / "iter_0000002" / ".metadata").unlink(),
     "iter_0000002/.metadata is missing{_}write 1 into"),
    (lambda run: (run / "checkpoints" / "iter_0000002" / "metadata.json").unlink(),
     "iter_0000002/metadata.json is missing{_}write 1 into"),
    (lambda run: _truncate(next((run / "weights" / "current").glob("*.safetensors"))),
     "is truncated{_}delete {RUN}/weights/current and run again"),
], ids=["no .metadata", "no metadata.json", "served weights cut"])
def test_a_checkpoint_damaged_on_disk_is_found_before_the_run_resumes(damage, fix, made, tmp_path):
    run = _damaged_run(made, tmp_path, damage)
    res = _invoke(["train", "--out", str(run), *shlex.split(RESUME_ARGS)])
    assert_one_line("resume", res, str(run), (fix.replace("{RUN}", str(run)),))
    assert not (run / "checkpoints" / "iter_0000003").exists()


def test_a_checkpoint_cut_short_at_resume_is_one_line_from_the_ray_trainer(made, tmp_path):
    """The trainer actor reads the checkpoint (Ray): its TorchDistError reaches the CLI as the library's line,
    naming the file and how to resume from step 1, not Ray's remote traceback (and no traceback at exit)."""
    run = _damaged_run(made, tmp_path, lambda run: _truncate(run / "checkpoints" / "iter_0000002" / "__0_0.distcp"))
    res = _cli(f"train --out {run} " + RESUME_ARGS.replace("--no-ray ", ""))
    marker = run / "checkpoints" / "latest_checkpointed_iteration.txt"
    line = assert_one_line("ray resume", res, str(run / "checkpoints" / "iter_0000002" / "__0_0.distcp"),
                           (f"is truncated{{_}}write 1 into {marker}",))
    assert "ray::" not in line and "pid=" not in line, line


def test_served_weights_of_another_shape_are_one_line_before_any_actor_starts(made, tmp_path):
    """weights/current whose config.json names another shape than its tensors: the driver reads its headers before
    the rollout actor would load it (an actor's __init__ that raises has Ray print its traceback)."""
    def other_shape(run: Path) -> None:
        config = run / "weights" / "current" / "config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "num_hidden_layers": 1}))

    run = _damaged_run(made, tmp_path, other_shape)
    res = _invoke(["train", "--out", str(run), *shlex.split(RESUME_ARGS.replace("--no-ray", "--ray"))])
    assert_one_line("served weights", res, str(run / "weights" / "current"),
                    (f"unknown tensor{{_}}delete {run / 'weights' / 'current'} and run again",))


def test_an_actor_whose_init_raised_is_its_own_last_line():
    """What Ray hands the driver when an actor's __init__ raised: only the text of the remote traceback (the
    exception object is gone); the line is that traceback's last line, the library's message."""
    from ray.exceptions import ActorDiedError, RayTaskError

    from checkpoints.hf import CheckpointError
    from v4rl.errors import is_run_failure, one_line_error

    remote = ('Traceback (most recent call last):\n  File "/x/engines/rollout/engine.py", line 125, in __init__\n'
              '    self.store = WeightStore.from_dir(self.model_dir)\ncheckpoints.hf.CheckpointError: /r/weights/'
              "current: unknown tensor 'layers.1.attn.attn_sink'; not a tensor of this model config")
    died = ActorDiedError(cause=RayTaskError("RolloutWorker.__init__", remote, CheckpointError("x")))
    assert one_line_error(died) == ("/r/weights/current: unknown tensor 'layers.1.attn.attn_sink'; not a tensor of "
                                    "this model config")
    assert is_run_failure(died)
    bug = ActorDiedError(cause=RayTaskError("f", remote.replace("checkpoints.hf.CheckpointError", "AttributeError"),
                                            AttributeError("x")))
    assert not is_run_failure(bug)  # a bug in an actor keeps its traceback


@pytest.mark.slow
def test_a_checkpoint_cut_short_at_resume_is_one_line_without_ray(made, tmp_path):
    run = _damaged_run(made, tmp_path, lambda run: _truncate(run / "checkpoints" / "iter_0000002" / "__0_0.distcp"))
    res = _invoke(["train", "--out", str(run), *shlex.split(RESUME_ARGS)])
    assert_one_line("resume", res, str(run), ("is truncated{_}write 1 into",))


# ============================================================================================== export's tokenizer


def test_an_export_carries_the_tokenizer_so_the_engine_takes_text_prompts(made, tiny_base, tmp_path):
    """`v4rl export` of a run's training checkpoints: the output has the base's tokenizer, and the rollout engine
    built on it parses a text prompt into the ids the base's tokenizer gives (before: 'this model directory has no
    tokenizer; send input_ids')."""
    from transformers import AutoTokenizer

    from checkpoints.paths import tokenizer_dir_of
    from engines.rollout.engine import EngineConfig, RolloutEngine
    from engines.rollout.protocol import parse_generate

    engine = RolloutEngine(made / "export", EngineConfig())
    specs, _, _ = parse_generate({"text": "Compute 12+30.", "sampling_params": {"max_new_tokens": 2}},
                                 engine.tokenizer, engine.context_length)
    assert specs[0].input_ids == AutoTokenizer.from_pretrained(tiny_base)("Compute 12+30.").input_ids
    # where the tokenizer of a torch_dist comes from: beside it, or the HF checkpoint its conversion record names
    converted = tmp_path / "td"
    (converted / "release").mkdir(parents=True)
    (converted / "latest_checkpointed_iteration.txt").write_text("release")
    (converted / "v4rl_conversion.json").write_text(json.dumps({"source": str(tiny_base)}))
    assert tokenizer_dir_of(converted) == tiny_base and tokenizer_dir_of(converted / "release") == tiny_base
    shutil.copy2(tiny_base / "tokenizer.json", converted / "tokenizer.json")
    assert tokenizer_dir_of(converted / "release") == converted
