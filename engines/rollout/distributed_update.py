"""SGLang's distributed weight update on the CPU engine: a torch.distributed group with the trainer, over gloo.

The protocol and its order are SGLang 0.5.23's (`model_executor/model_runner_components/weight_updater.py`,
`managers/scheduler_components/weight_updater.py`; Miles drives it from `update_weight_from_distributed/broadcast.py`):
  1. POST /init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name, backend}:
     the engine joins a process group by TCP rendezvous at master_address:master_port as rank `rank_offset` (its
     one rank), keys prefixed by `group_name` (the trainer, rank 0, joins the same way); the reply comes once every
     rank has joined. The CPU engine runs `backend` "nccl" (what Miles and SGLang send) as gloo: NCCL needs GPUs,
     and the trainer side of a CPU run opens its group with gloo too.
  2. between /begin_weight_update and /end_weight_update, per bucket: POST /update_weights_from_distributed
     {names, dtypes, shapes, group_name, flush_cache, weight_version, ...}; the engine allocates each tensor from
     the announced dtype and shape and receives it by broadcast from rank 0, in the announced order (float8 as its
     bytes: gloo has no float8 type, `launcher.wire_view`). Refused outside a session, as SGLang does.
     With `load_format: "flattened_bucket"` the whole bucket is ONE uint8 broadcast: the tensors' bytes
     concatenated in the announced order (SGLang's `weight_sync/tensor_bucket.py` `FlattenedTensorBucket`, received
     by `_receive_bucketed_weights_from_distributed`); each tensor must start at a byte offset its dtype's size
     divides, else the bucket is refused (SGLang's "Unaligned received tensor"). Float8 then travels as bytes
     under its own dtype name. Any other load_format is refused.
  3. POST /destroy_weights_update_group {group_name}.
The received tensors carry SGLang's HF names (`model.layers.N....weight`, `...weight_scale_inv`, `wo_a.scale`) and
go through the disk update's path: paired with their scales into the stored FP8/FP4 form, validated against the
held tensors (`WeightStore.check_update`), staged, applied and rebuilt at /end_weight_update, so the fidelity gate
sees exactly what a disk update of the same files gives. A quantized weight and its scale may come in different
buckets (held until its partner arrives; /end_weight_update refuses a session that ends with one missing); both
halves of one of SGLang's fused pairs must come in ONE bucket, which SGLang's loader requires (fused_pairs.py), so
a bucket that splits one is refused here too, with the pair named, instead of passing on CPU and failing on GPUs.

    groups = WeightUpdateGroups(engine)
    ok, message = groups.init(body)              # body: control.InitWeightsUpdateGroup
    ok, message = groups.receive_bucket(body)    # body: control.UpdateWeightsFromDistributed
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from checkpoints.hf import CheckpointError, pair_stored_tensors
from engines.rollout import control
from engines.rollout.engine import RolloutEngine
from engines.rollout.fused_pairs import SplitPairError, pair_units
from engines.rollout.launcher import init_weight_sync_group, receive_bucket

log = logging.getLogger("v4rl.rollout")
CPU_BACKENDS = ("nccl", "gloo")
"""Backends a trainer may name; the CPU engine runs either as gloo."""
FLATTENED_BUCKET = "flattened_bucket"
"""The load_format under which a bucket arrives as one flattened uint8 broadcast (SGLang 0.5.23)."""
JOIN_TIMEOUT_S = 600.0
"""How long the rendezvous waits for the other ranks (torch's default process-group timeout is 10 min)."""


class WeightUpdateGroups:
    """The engine's weight-update process groups by name, and the halves of quantized pairs still in flight."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine
        self.groups: dict[str, Any] = {}
        self._pending: list[tuple[str, str, torch.Tensor]] = []
        self._lock = threading.Lock()

    def init(self, body: control.InitWeightsUpdateGroup) -> tuple[bool, str]:
        if body.backend not in CPU_BACKENDS:
            return False, (f"backend {body.backend!r}: the CPU engine joins weight-update groups with gloo; send "
                           f"backend one of {list(CPU_BACKENDS)} (nccl runs as gloo here)")
        if not body.group_name:
            return False, "Group name cannot be empty"  # SGLang's assertion
        if body.group_name in self.groups:
            return False, (f"group {body.group_name!r} already exists; /destroy_weights_update_group it first")
        rank = body.rank_offset  # one engine rank (tp_size 1)
        log.info("joining weight-update group %s at %s:%s as rank %d of %d (gloo)", body.group_name,
                 body.master_address, body.master_port, rank, body.world_size)
        try:
            self.groups[body.group_name] = init_weight_sync_group(
                backend="gloo", master_address=body.master_address, master_port=body.master_port,
                world_size=body.world_size, rank=rank, group_name=body.group_name, timeout_s=JOIN_TIMEOUT_S)
        except Exception as exc:  # SGLang answers a failed join the same way, the server keeps running
            return False, f"Failed to initialize custom process group: {exc}."
        return True, "Succeeded to initialize custom process group."

    def destroy(self, group_name: str) -> tuple[bool, str]:
        group = self.groups.pop(group_name, None)
        if group is None:
            return False, "The group to be destroyed does not exist."
        try:
            torch.distributed.destroy_process_group(group)
        except Exception as exc:
            return False, f"Failed to destroy custom process group: {exc}."
        return True, "Succeeded to destroy custom process group."

    def receive_bucket(self, body: control.UpdateWeightsFromDistributed) -> tuple[bool, str]:
        """Receive one announced bucket (the caller checked a session is open) and stage it in the engine."""
        group = self.groups.get(body.group_name)
        if group is None:
            return False, (f"Failed to receive weights: Group {body.group_name} not in {list(self.groups)}. "
                           "Please call `init_weights_update_group` first.")
        problem = _announcement_problem(body)
        if problem:
            return False, problem
        # the broadcast is already on its way from rank 0: receive it before refusing anything about its content,
        # or the trainer blocks in its send
        announced = {"names": body.names, "dtypes": body.dtypes, "shapes": body.shapes}
        if body.load_format == FLATTENED_BUCKET:
            named, problem = receive_flattened_bucket(group, announced)
            if problem:
                return False, f"Failed to receive weights: {problem}"
        else:
            named = [(name, _fp8_from_bytes(name, t)) for name, t in receive_bucket(group, announced)]
        try:
            for _ in pair_units(named):
                pass
        except SplitPairError as exc:
            return False, f"Failed to update weights: {exc}"
        with self._lock:
            items = self._pending + [(f"bucket of {body.group_name}", name, t) for name, t in named]
            try:
                stored, _, self._pending = pair_stored_tensors(items, fp8_block=self.engine.store.fp8_block,
                                                               specs=self.engine.store.specs, where="this session",
                                                               partial=True)
            except CheckpointError as exc:
                self._pending = []
                return False, f"Failed to update weights: {exc}"
        if not stored:
            return True, f"Received {len(named)} tensors; their scales or weights come in a later bucket."
        res = self.engine.update_weights_from_tensors(
            stored, source=f"/update_weights_from_distributed ({body.group_name})",
            weight_version=body.weight_version, abort_all_requests=body.abort_all_requests)
        return res.success, "Succeeded to update parameter online." if res.success else res.message

    def unpaired(self) -> str | None:
        """Why the session cannot end: quantized weights or scales whose partner never arrived (else None)."""
        with self._lock:
            names, self._pending = [name for _, name, _ in self._pending], []
        if not names:
            return None
        return (f"{len(names)} tensors arrived without their weight or scale partner (e.g. {names[0]}); send each "
                "FP8/FP4 weight together with its weight_scale_inv in the same session")

    def close(self) -> None:
        for name in list(self.groups):
            self.destroy(name)


def flattened_layout(dtypes: list[str], shapes: list[list[int]]) -> tuple[list[tuple[int, int]], int, int | None]:
    """(start, end) byte ranges of each tensor in a flattened bucket, its total bytes, and the index of the first
    tensor whose start its dtype's size does not divide (None when all are aligned), as SGLang's
    `FlattenedTensorBucket.empty` lays them out."""
    spans, offset, unaligned = [], 0, None
    for i, (dtype, shape) in enumerate(zip(dtypes, shapes)):
        itemsize = getattr(torch, dtype).itemsize
        if offset % itemsize and unaligned is None:
            unaligned = i
        size = torch.Size(shape).numel() * itemsize
        spans.append((offset, offset + size))
        offset += size
    return spans, offset, unaligned


def receive_flattened_bucket(group: Any, announced: dict[str, list]) -> tuple[list[tuple[str, torch.Tensor]], str | None]:
    """Receive one flattened bucket (a single uint8 broadcast from rank 0) and cut it into the announced tensors;
    the second item is why the bucket is refused (after its bytes were received, so rank 0 is not left blocked)."""
    import torch.distributed as dist

    names, dtypes, shapes = announced["names"], announced["dtypes"], announced["shapes"]
    if not names:
        return [], "Cannot create empty tensor bucket"  # SGLang's message; rank 0 cannot flatten nothing either
    if any(d < 0 for shape in shapes for d in shape):
        return [], f"Negative dimension in announced shapes {shapes}"  # nothing is sent for such a bucket
    spans, total, unaligned = flattened_layout(dtypes, shapes)
    flat = torch.empty(total, dtype=torch.uint8)
    dist.broadcast(flat, src=0, group=group)
    if unaligned is not None:
        return [], (f"Unaligned received tensor {names[unaligned]}: byte offset {spans[unaligned][0]}, dtype "
                    f"{dtypes[unaligned]} (order a flattened bucket so every tensor starts at a multiple of its "
                    "dtype's size)")
    return [(name, flat[start:end].view(getattr(torch, dtype)).reshape(shape))
            for name, dtype, shape, (start, end) in zip(names, dtypes, shapes, spans)], None


def _fp8_from_bytes(name: str, t: torch.Tensor) -> torch.Tensor:
    """gloo has no float8 type ("Invalid scalar type"), so a CPU trainer sends E4M3 weights as their bytes,
    announced as uint8: a uint8 `.weight` is read back as float8_e4m3fn (UE8M0 scales are accepted as uint8)."""
    return t.view(torch.float8_e4m3fn) if t.dtype == torch.uint8 and name.endswith(".weight") else t


def _announcement_problem(body: control.UpdateWeightsFromDistributed) -> str | None:
    if not len(body.names) == len(body.dtypes) == len(body.shapes):
        return (f"names, dtypes and shapes must have one entry per tensor; got {len(body.names)}, "
                f"{len(body.dtypes)}, {len(body.shapes)}")
    bad = [d for d in body.dtypes if not isinstance(getattr(torch, d, None), torch.dtype)]
    if bad:
        return f"dtypes {bad[:3]} are not torch dtype names (e.g. 'bfloat16', 'float8_e4m3fn')"
    if body.load_format not in (None, FLATTENED_BUCKET):
        return (f"load_format {body.load_format!r}: SGLang's distributed update takes no load_format (tensor by "
                f"tensor) or {FLATTENED_BUCKET!r} (one broadcast per bucket); send one of those")
    return None
