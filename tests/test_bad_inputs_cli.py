"""Bad input at every `v4rl` command (issue 21): a table of command x plausible mistake, each answered by ONE line on
stderr that names the input and the fix, the command's exit code, no traceback, nothing left behind that would block
the corrected rerun, and, for `v4rl train`, before the run starts (no model, no Ray, no run directory). Also: preset
names are accepted in any spelling wherever a preset is taken, --input-key/--label-key reach the run, the flow and
the Miles job, and a run refused for its data writes no config.json, so the corrected rerun starts.

    .venv/bin/python -m pytest tests/test_bad_inputs_cli.py -q
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest

from rl.loop import LoopConfig

PROMPT = "Compute {a}+{b}. Answer in \\boxed{{}}."


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    """A folder of plausible mistakes: a torch_dist-looking directory, a plain file, a data file with other column
    names, a file of broken JSON lines, a directory named like a data file."""
    root = tmp_path_factory.mktemp("bad_inputs")
    torch_dist = root / "torch_dist"
    (torch_dist / "release").mkdir(parents=True)
    (torch_dist / "latest_checkpointed_iteration.txt").write_text("release")
    (torch_dist / "release" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    for name in (".metadata", "common.pt", "__0_0.distcp"):  # every file a complete one has (contents never read)
        (torch_dist / "release" / name).write_bytes(b"")
    (root / "afile").write_text("not a folder")
    _write_jsonl(root / "qa.jsonl", [{"question": PROMPT.format(a=i, b=i), "answer": 2 * i} for i in range(8)])
    (root / "broken.jsonl").write_text("{not json\n" * 5)
    (root / "folder.jsonl").mkdir()
    return root


# (command line with {B}: the bad-inputs folder, {TINY}: the committed HF base), exit code, the one line expected
CLI_CASES = {
    "train unknown preset": ("train --out {B}/run --preset tiny-gpu", 1,
                             "--preset: unknown preset 'tiny-gpu'; did you mean 'tiny-cpu'?"),
    "train cluster preset": ("train --out {B}/run --preset DSV4_flash_mi355x", 1,
                             "preset 'dsv4-flash-mi355x' trains on a GPU cluster through Miles; see `v4rl plan "
                             "--preset dsv4-flash-mi355x --launch`"),
    "train missing data": ("train --out {B}/run --train-data {B}/missing.jsonl", 1,
                           "--train-data {B}/missing.jsonl: no such file; check the path"),
    "train data folder": ("train --out {B}/run --eval-data {B}/folder.jsonl", 1,
                          "--eval-data {B}/folder.jsonl is a directory; give the data file inside it"),
    "train csv": ("train --out {B}/run --train-data {B}/afile.csv", 1, "--train-data {B}/afile.csv: unsupported "
                  "file type '.csv'; give a .jsonl, .json or .parquet file"),
    "train base torch_dist": ("train --out {B}/run --base {B}/torch_dist", 1, "--base {B}/torch_dist is a Megatron "
                              "torch_dist checkpoint, not a HF one; export it first: v4rl export {B}/torch_dist"),
    "train base missing": ("train --out {B}/run --base {B}/nope", 1, "--base {B}/nope: no such directory"),
    "train out is a file": ("train --out {B}/afile", 1, "--out {B}/afile is a file; give a directory"),
    "train unknown reward": ("train --out {B}/run --reward no_such_module:score", 1, "no_such_module"),
    "train other columns": ("train --out {B}/run --train-data {B}/qa.jsonl --no-ray --prompts-per-step 2", 1,
                            "no 'prompt' column and no 'label' column (columns: ['answer', 'question']); name the "
                            "column(s) with --input-key question --label-key answer"),
    "train broken lines": ("train --out {B}/run --train-data {B}/broken.jsonl --no-ray --prompts-per-step 2", 1,
                           "--train-data has no usable row: all 5 were dropped"),
    "convert torch_dist": ("convert {B}/torch_dist {B}/out", 1, "{B}/torch_dist is a Megatron torch_dist "
                           "checkpoint, not a HF one; export it first: v4rl export {B}/torch_dist HF_DIR"),
    "convert missing": ("convert {B}/nope {B}/out", 1, "SRC {B}/nope: no such directory"),
    "convert dst file": ("convert {TINY} {B}/afile", 1, "DST {B}/afile is a file"),
    "export hf": ("export {TINY} {B}/out --format hf-bf16", 1, "SRC {TINY} is a HF checkpoint, not a torch_dist one; "
                  "convert it first: v4rl convert {TINY} TORCH_DIST_DIR"),
    "export missing": ("export {B}/nope {B}/out --format hf-fp8", 1, "SRC {B}/nope: no such directory"),
    "export format": ("export {B}/torch_dist {B}/out --format hf-16", 1, "--format must be hf-bf16 or hf-fp8"),
    "verify hf": ("verify-ckpt {TINY}", 1, "is a HF checkpoint, not a torch_dist one; convert it first"),
    "verify json folder": ("verify-ckpt {B}/torch_dist --json {B}/nodir/x.json", 1,
                           "--json {B}/nodir/x.json: the folder {B}/nodir does not exist"),
    "score torch_dist": ("score --model {B}/torch_dist --input {B}/afile --json {B}/o.json", 1,
                         "--model {B}/torch_dist is a Megatron torch_dist checkpoint"),
    "score missing input": ("score --model {TINY} --input {B}/nope.json --json {B}/o.json", 1,
                            "--input {B}/nope.json: no such file"),
    "score bad input": ("score --model {TINY} --input {B}/afile --json {B}/o.json", 1,
                        "cannot read sequences from {B}/afile"),
    "serve missing": ("serve-rollout --model {B}/nope --port 0", 1, "--model {B}/nope: no such directory"),
    "align torch_dist as HF": ("align --model {TINY} --torch-dist {TINY} --json {B}/a.json", 2,
                               "--torch-dist {TINY} is a HF checkpoint, not a torch_dist one"),
    "align json under a file": ("align --model {TINY} --torch-dist {B}/torch_dist --json {B}/afile/a.json", 2,
                                "--json {B}/afile/a.json: {B}/afile is a file, not a folder"),
    "plan unknown preset": ("plan --preset dsv4-flash", 1, "unknown preset 'dsv4-flash'; did you mean "
                            "'dsv4-flash-mi355x'?"),
    "plan tiny launch": ("plan --preset tiny_cpu --launch", 1, "--launch: tiny-cpu runs on this machine"),
    "plan eval pair": ("plan --eval-data aime-2024.jsonl", 1, "--eval-data 'aime-2024.jsonl': give NAME=PATH"),
    "plan model config": ("plan --model-config {B}/nope.json", 1, "cannot read model config {B}/nope.json"),
    "bench unknown": ("bench nope --json {B}/b.json", 2, "NAME: unknown benchmark 'nope'; choose one of convert"),
    "bench json folder": ("bench convert --json {B}/nodir/b.json", 2, "the folder {B}/nodir does not exist"),
    "bootstrap out file": ("bootstrap --out {B}/afile", 1, "--out {B}/afile is a file"),
    "demo workdir file": ("demo --workdir {B}/afile", 1, "--workdir {B}/afile is a file"),
    "demo zero steps": ("demo --workdir {B}/demo --steps 0", 1,
                        "--steps 0: Input should be greater than or equal to 1"),
}


REACH_THE_RUN = {"train other columns", "train broken lines"}
"""Cases only the data file's content gives away: run_training reads it (tokenizer, rows) before anything starts.
Every other train case must fail before run_training is called: no torch model, no Ray, no run directory."""


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_every_command_answers_a_mistake_with_one_line(case, bad, tiny_base, monkeypatch):
    """Each command x plausible mistake: the exit code, ONE line on stderr naming the input and the fix, no
    traceback, and nothing left behind (the folder of inputs is unchanged, so the corrected rerun finds no debris)."""
    import shlex

    from typer.testing import CliRunner

    import engines.train.run as run_module
    from v4rl.cli import app

    if case not in REACH_THE_RUN:
        def started(*args, **kwargs):
            raise AssertionError(f"{case}: the run started before the mistake was found")

        monkeypatch.setattr(run_module, "run_training", started)

    line, code, expected = CLI_CASES[case]
    fill = lambda text: text.replace("{B}", str(bad)).replace("{TINY}", str(tiny_base))  # noqa: E731
    before = _listing(bad)
    result = CliRunner().invoke(app, shlex.split(fill(line)))
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), \
        f"{case}: {result.exception!r}"
    assert result.exit_code == code, (case, result.exit_code, result.output)
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), (case, result.stderr)
    assert fill(expected) in lines[0], (case, lines[0])
    assert "Traceback" not in result.output and not result.stdout.strip(), (case, result.output)
    assert _listing(bad) == before, case  # no run directory, no half-written output


def test_train_reports_every_mistake_at_once_under_its_flag(bad, monkeypatch):
    """Four mistakes on one command line: four lines, each naming the flag the user typed (not the config field:
    `rollout_expert_dtype='bf16'`), in one run, before anything starts."""
    from typer.testing import CliRunner

    import engines.train.run as run_module
    from v4rl.cli import app

    monkeypatch.setattr(run_module, "run_training", lambda *a, **k: pytest.fail("the run started"))
    result = CliRunner().invoke(app, ["train", "--out", f"{bad}/afile", "--train-data", f"{bad}/missing.jsonl",
                                      "--reward", "nope", "--rollout-expert-dtype", "bf16"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert [line.split()[1] for line in lines] == ["--out", "--train-data", "--reward='nope'",
                                                   "--rollout-expert-dtype"], lines
    assert all(line.startswith("error: ") for line in lines) and "rollout_expert_dtype" not in result.stderr


def test_the_suggested_commands_accept_every_spelling(tmp_path):
    """`v4rl train --preset tiny_cpu` and the command it points at accept the same names: the planner and the flow
    parameters normalise case and _/- exactly as `v4rl train` does."""
    from typer.testing import CliRunner

    from engines.presets.runs import preset_name
    from flows.params import PipelineParams
    from v4rl.cli import app

    assert preset_name("Tiny_CPU") == "tiny-cpu" and preset_name("dsv4_flash_mi355x_1node") == "dsv4-flash-mi355x-1node"
    result = CliRunner().invoke(app, ["plan", "--preset", "dsv4_flash_mi355x", "--launch"])
    assert result.exit_code == 0 and json.loads(result.stdout)["preset"] == "dsv4-flash-mi355x", result.output
    assert PipelineParams(preset="TINY_CPU", runs_root=str(tmp_path)).preset == "tiny-cpu"
    with pytest.raises(ValueError, match=r"unknown preset 'tiny-gpu'; did you mean 'tiny-cpu'\?"):
        PipelineParams(preset="tiny-gpu", runs_root=str(tmp_path))
    params = PipelineParams(preset="dsv4-flash-mi355x", hf_checkpoint="/data/x", input_key="question",
                            label_key="answer", runs_root=str(tmp_path))
    assert params.miles_overrides()["input_key"] == "question"
    assert params.training_fingerprint() != PipelineParams(preset="dsv4-flash-mi355x", hf_checkpoint="/data/x",
                                                           runs_root=str(tmp_path)).training_fingerprint()
    from engines.presets.runs import resolve
    from engines.miles.train_args import rollout_args

    argv = rollout_args(resolve(params.preset, params.miles_overrides())[0], params.miles_job())
    assert argv[argv.index("--input-key") + 1] == "question" and argv[argv.index("--label-key") + 1] == "answer"


def test_a_run_refused_for_its_data_writes_no_config_and_the_corrected_rerun_starts(tmp_path, tiny_base, monkeypatch):
    """run_training checks data and reward before it writes config.json: after a refusal the same directory takes
    a corrected configuration (here the next thing after config.json, starting the workers, is stopped)."""
    import engines.train.run as run_module
    from engines.train.run import TrainRunConfig, run_training
    from rl.datasets import DatasetError

    class WorkersStart(Exception):
        pass

    class _NoWorkers:
        def __init__(self, *args, **kwargs):
            raise WorkersStart

    monkeypatch.setattr(run_module, "_workers", _NoWorkers)
    run_dir = tmp_path / "run"
    loop = LoopConfig(prompts_per_step=2, n_samples=2, eval_interval=0, max_new_tokens=6, dynamic_sampling=False)
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n" * 4)
    with pytest.raises(DatasetError, match="train_data has no usable row: all 4 were dropped"):
        run_training(run_dir, TrainRunConfig(base=str(tiny_base), steps=1, use_ray=False, train_data=str(broken),
                                             loop=loop), log=lambda m: None)
    assert not (run_dir / "config.json").exists()
    fixed = _write_jsonl(tmp_path / "fixed.jsonl", [{"question": PROMPT.format(a=i, b=i), "answer": 2 * i}
                                                    for i in range(4)])
    config = TrainRunConfig(base=str(tiny_base), steps=1, use_ray=False, train_data=str(fixed), input_key="question",
                            label_key="answer", loop=loop)
    with pytest.raises(WorkersStart):
        run_training(run_dir, config, log=lambda m: None)
    written = json.loads((run_dir / "config.json").read_text())
    assert (written["train_data"], written["input_key"], written["label_key"]) == (str(fixed), "question", "answer")
    with pytest.raises(ValueError, match=r"holds a different run configuration \(fields \['train_data'\]\)"):
        run_training(run_dir, dataclasses.replace(config, train_data=str(broken)), log=lambda m: None)


def test_the_demo_refuses_an_unreachable_prefect_api_url_before_starting_anything(tmp_path, monkeypatch):
    """PREFECT_API_URL naming a closed port: one line naming the variable and both fixes, nothing written."""
    import socket

    from typer.testing import CliRunner

    from v4rl.cli import app

    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{port}/api")
    result = CliRunner().invoke(app, ["demo", "--workdir", str(tmp_path / "demo")])
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert result.exit_code == 1 and len(lines) == 1, result.output
    assert lines[0].startswith(f"error: PREFECT_API_URL=http://127.0.0.1:{port}/api: no Prefect server answers") \
        and "unset PREFECT_API_URL" in lines[0], lines
    assert not (tmp_path / "demo").exists()


@pytest.fixture
def read_only(tmp_path):
    """A folder no new file can be created in, root included (chattr +i; chmod for other users)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() == 0:
        made = subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
    else:
        folder.chmod(0o555)
        made = True
    probe = folder / "probe"
    try:
        probe.touch()
        probe.unlink()
        made = False
    except OSError:
        pass
    if not made:
        pytest.skip("cannot make a folder read-only here (no chattr +i, or a filesystem without it)")
    yield folder
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    else:
        folder.chmod(0o755)


@pytest.mark.parametrize("line", ["train --out {RO}/run", "bootstrap --out {RO}/base", "demo --workdir {RO}/demo",
                                  "convert {TINY} {RO}/td", "score --model {TINY} --input {TINY}/config.json "
                                  "--json {RO}/o.json"], ids=["train", "bootstrap", "demo", "convert", "score"])
def test_a_read_only_output_folder_is_one_line_before_anything_starts(line, read_only, tiny_base, monkeypatch):
    import shlex

    from typer.testing import CliRunner

    import engines.train.run as run_module
    from v4rl.cli import app

    monkeypatch.setattr(run_module, "run_training", lambda *a, **k: pytest.fail("the run started"))
    args = shlex.split(line.replace("{RO}", str(read_only)).replace("{TINY}", str(tiny_base)))
    result = CliRunner().invoke(app, args)
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert result.exit_code == 1 and len(lines) == 1, result.output
    assert f"cannot write in {read_only}" in lines[0] and "give a folder you can write to" in lines[0], lines
