"""Shared fixtures: a random tiny-cpu checkpoint in the native FP8 + FP4 layout (every path live).

Tests that need trained behaviour use the bootstrap asset instead; this one only needs real shapes,
real storage formats and non-trivial values.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
from pathlib import Path

# libgomp's default spin-wait makes every torch op ~10x slower on a loaded 2-core machine (measured:
# tests/test_model.py 63 s -> 12 s); must be set before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402

# One Prefect server and one S3 server for the whole session, shared by every module that names the fixture: a
# fixture imported into a test module is a separate definition there, and each started its own server.
from tests.prefect_server import prefect_server  # noqa: E402, F401
from tests.s3_server import moto_server, s3_bucket, s3_proxy  # noqa: E402, F401
from engines import TINY_BASE

# Nothing in the test suite may talk to anything but loopback, or phone home.
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # local Ray stays on 127.0.0.1 (read at import)
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Prefect reads its settings once, at import: give the test process its own home (results, cache records)
# so that no test sees ~/.prefect or a cache entry from another session.
if "PREFECT_HOME" not in os.environ:
    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="v4rl-test-prefect-")
    atexit.register(shutil.rmtree, os.environ["PREFECT_HOME"], True)


# The files that take longest (over ~40 s each in a `-n 3` run, 2026-12-03), longest first. xdist (`--dist loadfile
# --no-loadscope-reorder`, pyproject's addopts) hands each worker the next file in collection order, so these start
# first and the short files fill the gaps; in alphabetical order two of them ran last, one after the other, on one
# worker while the others idled (22 min instead of about 15). A file missing here only starts later; none is skipped.
LONGEST_FIRST = (
    "conformance/test_cluster_rehearsal.py", "conformance/test_rehearse.py", "test_kill_resume.py",
    "test_cluster_flow.py", "test_interrupt_and_lock.py",
    "test_pipeline_e2e.py", "test_fault_worker_kill.py", "test_user_reward.py", "test_fault_checkpoint_write.py",
    "conformance/test_miles_derived_jobs.py", "test_train_run.py", "test_train_stop.py", "test_secret_scan.py",
    "conformance/test_miles_model.py", "conformance/test_miles_engine_methods.py", "test_convert.py",
    "test_e2e_bench.py", "conformance/test_sglang_model.py", "conformance/test_miles_external_engine.py",
    "test_miles_pipeline.py", "test_pipeline_resume.py", "test_rehearsal_ray_job.py",
)


def pytest_collection_modifyitems(config, items):
    """Moves the tests of LONGEST_FIRST's files to the front, in its order (a stable sort: order within a file and
    among the other files is kept). Every xdist worker sorts the same way, as xdist requires."""
    tests = Path(__file__).resolve().parent
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def file_rank(item) -> int:
        try:
            name = Path(str(item.fspath)).resolve().relative_to(tests).as_posix()
        except ValueError:
            return len(rank)
        return rank.get(name, len(rank))

    items.sort(key=file_rank)


@pytest.fixture(autouse=True)
def _no_log_handler_left_on_a_closed_stream():
    """After each test, drops log handlers whose stream is closed. Prefect configures logging once per process, on
    the sys.stderr of that moment: when that moment is inside a CliRunner.invoke, its handlers keep the runner's
    stream, closed when the invoke returns, and every later record in this worker prints `--- Logging error ---`
    into the next test's stderr (seen under xdist, where file order differs: test_bad_inputs_cli got 706 lines)."""
    yield
    loggers = [logging.getLogger(), *(x for x in logging.Logger.manager.loggerDict.values()
                                      if isinstance(x, logging.Logger))]
    for logger in loggers:
        for handler in list(logger.handlers):
            if getattr(getattr(handler, "stream", None), "closed", False):
                logger.removeHandler(handler)


def write_random_tiny_checkpoint(out_dir: Path, *, seed: int = 0, **save_kwargs) -> Path:
    """A tiny-cpu model with random weights (tid2eid, sinks, ape, mHC bases live), saved natively."""
    import tempfile

    from checkpoints.hf import save_hf_checkpoint
    from engines.presets.models import tiny_cpu_model_config
    from engines.model.tokenizer import build_tokenizer
    from engines.train.hf_model import build_reference_model, native_from_reference

    cfg = tiny_cpu_model_config()
    native = native_from_reference(build_reference_model(cfg, seed=seed))
    with tempfile.TemporaryDirectory() as tok_dir:
        build_tokenizer().save_pretrained(tok_dir)
        kwargs = dict(weight_format="fp8", expert_dtype="fp4", scale_fmt="ue8m0")
        kwargs.update(save_kwargs)
        return save_hf_checkpoint(out_dir, cfg, native, tokenizer_dir=tok_dir, **kwargs)


def write_noisy_copy(checkpoint: Path, out: Path, *, seed: int, **save_kwargs) -> Path:
    """`checkpoint`'s weights plus 2% noise per floating tensor (integer tables such as tid2eid kept), saved as an
    FP8/FP4 export at `out`: a weight update whose every tensor differs from what is served."""
    import torch

    from checkpoints.hf import load_hf_checkpoint, save_hf_checkpoint

    cfg, state = load_hf_checkpoint(checkpoint)
    g = torch.Generator().manual_seed(seed)
    for name, t in state.items():
        if t.is_floating_point() and t.numel() > 1:
            state[name] = t + 0.02 * t.std() * torch.randn(t.shape, generator=g)
    return save_hf_checkpoint(out, cfg, state, tokenizer_dir=checkpoint, **save_kwargs)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """Path of a random tiny-cpu checkpoint (FP8 linears, FP4 routed experts, UE8M0 scales). Read-only."""
    return write_random_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)




@pytest.fixture(scope="session")
def tiny_base() -> Path:
    """The committed bootstrap checkpoint (`v4rl bootstrap --seed 0`): a model that already gets some answers
    right, for tests that need a learning signal. Read-only."""
    if not (TINY_BASE / "bootstrap.json").exists():
        raise FileNotFoundError(f"{TINY_BASE} is missing; rebuild it with `v4rl bootstrap --out {TINY_BASE} --seed 0`")
    return TINY_BASE
