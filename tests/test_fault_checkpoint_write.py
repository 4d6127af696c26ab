"""A write error during a training checkpoint save (issue 8): the disk fills up part-way through the save of
step 4, after the torch_dist files and part of trainer_state.pt are on disk: tests/planted.py's full disk, whose
writes past the limit go to /dev/full so the kernel raises ENOSPC; planted in this process by monkeypatch, in the
Ray trainer actor by tests/plant/sitecustomize.py at the child's start-up.

Checks: the run fails with CheckpointWriteError naming the step, the iteration directory and the OS error;
nothing of the failed save is left (no iteration directory, no partial directory, the marker still names step
2); a new run resumes from step 2 and ends with one continuous metric series, the same metric values and the
same fp32 master weights (torch.equal) as a run that never failed (tests/test_kill_resume.py's reference).

    .venv/bin/python -m pytest tests/test_fault_checkpoint_write.py -q
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from engines.runs import checkpointing
from engines.runs.checkpointing import (ITERATION_FILE, TRAINER_STATE, CheckpointWriteError, latest_step,
                                         load_training_checkpoint, save_training_checkpoint)
from tests.planted import plant_full_disk, plant_in_children
from tests.test_kill_resume import _assert_resumed_like, _Child, _resume, _rows, reference_run  # noqa: F401

pytestmark = pytest.mark.faults


@pytest.fixture(scope="module")
def tiny_state():
    from engines.presets.models import tiny_cpu_model_config
    from engines.train.hf_model import build_reference_model, native_from_reference

    cfg = tiny_cpu_model_config()
    native = native_from_reference(build_reference_model(cfg, seed=0))
    # An optimizer-sized trainer state, so trainer_state.pt is several MB and the fault lands mid-file.
    trainer_state = {"step": 2, "exp_avg": {k: torch.randn_like(v.float()) for k, v in native.items()}}
    return cfg, native, trainer_state


def _save(root: Path, step: int, tiny_state) -> Path:
    cfg, native, trainer_state = tiny_state
    return save_training_checkpoint(root, step, cfg, native, trainer_state=trainer_state, rng=torch.get_rng_state(),
                                    extra={"step": step})


def test_disk_full_mid_save_leaves_previous_checkpoint(tiny_state, tmp_path, monkeypatch):
    """In process: the failed save of step 4 had written the torch_dist files and 64 KiB of trainer_state.pt
    (seen just before its cleanup); afterwards only step 2 exists and loads, and step 4 saves fine later."""
    root = tmp_path / "checkpoints"
    _save(root, 2, tiny_state)
    seen: dict[str, int] = {}
    real_rmtree = shutil.rmtree

    def spy(path, *args, **kwargs):
        if ".partial-" in Path(path).name and Path(path).is_dir():
            seen.update({p.name: p.stat().st_size for p in Path(path).iterdir()})
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(checkpointing.shutil, "rmtree", spy)
    with pytest.MonkeyPatch.context() as disk:
        plant_full_disk(disk, step=4, limit=65536)
        with pytest.raises(CheckpointWriteError) as info:
            _save(root, 4, tiny_state)
    message = str(info.value)
    assert "step 4" in message and str(root / "iter_0000004") in message, message
    assert "No space left on device" in message and TRAINER_STATE in message, message
    assert f"{root / ITERATION_FILE} still names step 2" in message, message
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == 28

    assert {"__0_0.distcp", ".metadata", "common.pt"} <= seen.keys(), seen  # some files were written ...
    assert seen[TRAINER_STATE] == 65536 and "metadata.json" not in seen, seen  # ... and then the disk was full
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000002", ITERATION_FILE]
    assert latest_step(root) == 2
    assert load_training_checkpoint(root, 2, tiny_state[0])["step"] == 2

    _save(root, 4, tiny_state)  # space is back: the same step saves and commits
    assert latest_step(root) == 4


def test_partial_save_of_a_killed_process_is_ignored_and_removed(tiny_state, tmp_path):
    """A save killed before its rename leaves .iter_*.partial-*: never read, removed by the next save."""
    root = tmp_path / "checkpoints"
    _save(root, 2, tiny_state)
    stale = root / ".iter_0000004.partial-deadbeef"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"\0" * 100)
    assert latest_step(root) == 2
    _save(root, 4, tiny_state)
    assert not stale.exists() and latest_step(root) == 4


def test_first_save_failing_names_a_restart_from_step_0(tiny_state, tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    plant_full_disk(monkeypatch, step=2)
    with pytest.raises(CheckpointWriteError, match=r"does not exist \(no earlier checkpoint\), so a rerun starts "
                                                   r"from step 0"):
        _save(root, 2, tiny_state)
    assert latest_step(root) is None and list(root.iterdir()) == []


def test_disk_full_in_trainer_actor_then_resume(tiny_base, reference_run, tmp_path, monkeypatch):  # noqa: F811
    """A real run on Ray (trainer and rollout actors) whose trainer's save of step 4 hits a full disk; a new run
    without the fault resumes from step 2 and ends like the uninterrupted reference."""
    run_dir = tmp_path / "run"
    with pytest.MonkeyPatch.context() as disk:  # the child's environment; Ray's actors inherit it
        plant_in_children(disk, "full_disk:4")
        child = _Child(tmp_path, run_dir, tiny_base, use_ray=True)
    # the resumed run below has a healthy disk
    try:
        code = child.proc.wait(timeout=600)
        out = child.output()
        assert code != 0, f"the run went on after its checkpoint failed:\n{out}"
        assert re.search(r"CheckpointWriteError: writing the training checkpoint of step 4 to "
                         + re.escape(str(run_dir / "checkpoints" / "iter_0000004"))
                         + r" failed: OSError: \[Errno 28\] No space left on device", out), out
        ckpts = run_dir / "checkpoints"
        assert latest_step(ckpts) == 2
        assert not (ckpts / "iter_0000004").exists() and not list(ckpts.glob(".iter_*")), sorted(ckpts.iterdir())
        assert [r["step"] for r in _rows(run_dir)] == [1, 2, 3, 4]  # step 4 was logged, then its save failed
        leaked = child.leftovers()
        assert not leaked, f"processes of the failed run still alive: {leaked}"
    finally:
        child.cleanup()
    summary = _resume(run_dir, tiny_base, use_ray=True)
    _assert_resumed_like(reference_run, run_dir, summary, tiny_base)
