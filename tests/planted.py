"""Planted faults: known bugs and failures put into the library from the tests, to prove its real checks catch them.

The library has no switch for any of them; each is a monkeypatch applied here, undone on exit.

Model bugs (the seed's two train/rollout mismatches, in our engine; `planted(...)`, a context manager):
  hash_from_positions   hash-routed MoE layers look up `tid2eid` with the token's POSITION instead of its token id
                        (the seed's hash-routing mismatch): `Block.forward` is handed the positions as route ids.
  comb_untransposed     the mHC residual mix applies `comb @ streams` instead of `combᵀ @ streams` (the seed's mHC
                        post-mix mismatch; Sinkhorn's matrix is not symmetric, so it matters): model.py's `hc_merge`
                        is handed the transposed comb.
  While one is planted the fused kernels are bypassed (`FusedModel.usable` answers False), as the torch ops carry
  the bug. The patches are process-global, so the rollout engine's scheduler thread sees them too:

      with planted("comb_untransposed"):                   # every layer, as the seed's bug
          report = align(...)
      with planted("hash_from_positions", layers={1}):     # only layer 1 (to test localisation)

Weight-update bugs (`plant_update_bug(engine, name)`: every rebuild of that engine after its cold start):
  fp4_as_fp8            packed FP4 expert bytes decoded as FP8 values
  skip_rebuild          the runtime copy left stale (a server without post-processing)
  transposed_scales     a column-major scale read with the row-major shape

A full disk (`plant_full_disk(monkeypatch, step, limit)` in this process; `plant_in_children(monkeypatch, spec)` for
child processes and their Ray workers): checkpointing's `open` of trainer_state.pt in the save of `step` returns a
file whose writes past `limit` bytes go to /dev/full, so the OS itself raises ENOSPC mid-file after the torch_dist
files are written. Children get it from tests/plant/sitecustomize.py, which Python imports at start-up when
tests/plant is on PYTHONPATH and applies the spec named by V4RL_TESTS_PLANT; nothing in the library reads that.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

MODEL_BUGS: tuple[str, ...] = ("hash_from_positions", "comb_untransposed")
UPDATE_BUGS: tuple[str, ...] = ("fp4_as_fp8", "skip_rebuild", "transposed_scales")
PLANT_DIR = Path(__file__).resolve().parent / "plant"
PLANT_ENV = "V4RL_TESTS_PLANT"
"""Read by tests/plant/sitecustomize.py only: `full_disk:STEP[:BYTES]`."""


# ------------------------------------------------------------------------------------------------ model bugs
class _Forward(threading.local):
    """What the patched Block.forward needs that its arguments lack: the positions of the tokens being run and
    the layer whose `hc_merge` calls are running (per thread: the rollout scheduler runs the model in its own)."""

    positions: torch.Tensor | None = None
    layer: int | None = None


@contextlib.contextmanager
def planted(*bugs: str, layers: Iterable[int] | None = None) -> Iterator[None]:
    """Plant the named model bugs (optionally only in `layers`) for the duration of the block."""
    unknown = [b for b in bugs if b not in MODEL_BUGS]
    if unknown or not bugs:
        raise ValueError(f"planted() needs bug names from {MODEL_BUGS}; got {list(bugs)}")
    from engines.model import model as model_module
    from engines.model.fused_model import FusedModel

    selected = None if layers is None else frozenset(layers)
    hit = lambda layer: layer is not None and (selected is None or layer in selected)  # noqa: E731
    now = _Forward()
    Block, DeepseekV4 = model_module.Block, model_module.DeepseekV4
    block_forward, full_torch, decode_torch = Block.forward, DeepseekV4.full_torch, DeepseekV4.decode_torch
    real_hc_merge = model_module.hc_merge

    @contextlib.contextmanager
    def running(positions):
        saved, now.positions = now.positions, positions
        try:
            yield
        finally:
            now.positions = saved

    def full(model, token_ids, *args, **kwargs):  # whole sequences start at position 0
        B, S = token_ids.shape
        with running(torch.arange(S, device=token_ids.device).expand(B, S)):
            return full_torch(model, token_ids, *args, **kwargs)

    def decode(model, token_ids, batch, *args, **kwargs):  # one token per row, at the row's next position
        with running(batch.positions.view(-1, 1).to(token_ids.device)):
            return decode_torch(model, token_ids, batch, *args, **kwargs)

    def forward(block, streams, token_ids, *args, **kwargs):
        if "hash_from_positions" in bugs and hit(block.layer):
            token_ids = now.positions.expand_as(token_ids) % block.cfg.vocab_size
        saved, now.layer = now.layer, block.layer
        try:
            return block_forward(block, streams, token_ids, *args, **kwargs)
        finally:
            now.layer = saved

    def hc_merge(streams, block_out, post, comb):  # hc_merge applies combᵀ; handing it combᵀ applies comb
        if "comb_untransposed" in bugs and hit(now.layer):
            comb = comb.transpose(-1, -2)
        return real_hc_merge(streams, block_out, post, comb)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DeepseekV4, "full_torch", full)
        mp.setattr(DeepseekV4, "decode_torch", decode)
        mp.setattr(Block, "forward", forward)
        mp.setattr(model_module, "hc_merge", hc_merge)
        mp.setattr(FusedModel, "usable", lambda self: False)  # the torch ops carry the bug
        yield


# ------------------------------------------------------------------------------------------------ update bugs
def plant_update_bug(engine, bug: str) -> None:
    """Make every later runtime rebuild of this RolloutEngine (its weight updates) commit `bug`."""
    if bug not in UPDATE_BUGS:
        raise ValueError(f"plant_update_bug() needs a bug name from {UPDATE_BUGS}; got {bug!r}")
    from engines.rollout.weights import rebuild_runtime

    def rebuild() -> None:
        if bug == "skip_rebuild":
            return
        tensors = {name: _mis_decoded(t, bug) for name, t in engine.store.tensors.items()}
        rebuild_runtime(engine.model, SimpleNamespace(tensors=tensors), rocm_fnuz=engine.config.rocm_fnuz)

    engine._rebuild = rebuild


def _mis_decoded(t, bug: str):
    """The stored tensor as the buggy rebuild reads it (the real rebuild dequantizes what this returns)."""
    from checkpoints.hf import QuantizedTensor
    from checkpoints.quant import scale_to_float32

    if not isinstance(t, QuantizedTensor):
        return t
    if bug == "transposed_scales":  # the bytes of a column-major scale read with the row-major shape
        return QuantizedTensor(t.data, t.scale.t().contiguous().reshape(t.scale.shape), t.kind, t.block)
    if bug == "fp4_as_fp8" and t.kind == "fp4":  # each packed byte decoded as one E4M3 value
        values = t.data.view(torch.float8_e4m3fn).float().repeat_interleave(2, dim=1)
        return values * scale_to_float32(t.scale).repeat_interleave(t.block[1], dim=1)
    return t


# ------------------------------------------------------------------------------------------------ full disk
class _FillingFile:
    """A file on a disk with `room` bytes left: what does not fit goes to /dev/full, whose write raises ENOSPC."""

    def __init__(self, f, room: int) -> None:
        self.f, self.room = f, room

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if len(view) <= self.room:
            self.room -= len(view)
            return self.f.write(view)
        self.f.write(view[:self.room])
        self.f.flush()
        self.room = 0
        with open("/dev/full", "wb", buffering=0) as full:
            return full.write(view)  # OSError(ENOSPC) from the kernel

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()


def full_disk_open(step: int, limit: int = 1 << 20):
    """An `open` for engines/runs/checkpointing.py under which the save of `step` hits a full disk after `limit`
    bytes of trainer_state.pt (the torch_dist files of that iteration are written before it)."""
    from engines.runs.checkpointing import PARTIAL_INFIX, TRAINER_STATE

    def faulty_open(path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)
        p = Path(path)
        if p.name == TRAINER_STATE and p.parent.name.startswith(f".iter_{step:07d}{PARTIAL_INFIX}"):
            return _FillingFile(f, limit)
        return f

    return faulty_open


def plant_full_disk(monkeypatch: pytest.MonkeyPatch, step: int, limit: int = 1 << 20) -> None:
    """In this process: the checkpoint save of `step` fails with ENOSPC after `limit` bytes of trainer_state.pt."""
    from engines.runs import checkpointing

    monkeypatch.setattr(checkpointing, "open", full_disk_open(step, limit), raising=False)


def plant_in_children(monkeypatch: pytest.MonkeyPatch, spec: str) -> None:
    """Child processes started after this (and the Ray workers they start) plant `spec` at start-up
    (tests/plant/sitecustomize.py); the monkeypatch's undo stops it for later children."""
    monkeypatch.setenv(PLANT_ENV, spec)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(PLANT_DIR), os.environ.get("PYTHONPATH")) if p))


def apply_child_plant(spec: str, checkpointing) -> None:
    """Called by tests/plant/sitecustomize.py once engines.runs.checkpointing is imported in a child."""
    name, _, args = spec.partition(":")
    step, _, limit = args.partition(":")
    if name != "full_disk" or not step.isdigit() or (limit and not limit.isdigit()):
        raise ValueError(f"{PLANT_ENV}={spec!r}: expected full_disk:STEP[:BYTES] (e.g. full_disk:4:65536)")
    checkpointing.open = full_disk_open(int(step), int(limit) if limit else 1 << 20)
