"""/weights_checker for the embedded engine: SGLang 0.5.23's actions and reply shape over v4rl's runtime tensors.

Actions (SGLang's `utils/weight_checker.py`):
  checksum        `ranks: [{"checksums": {name: hash}, "per_gpu_checksum", "parallelism_info": [...]}]` and
                  `per_engine_checksum` (one rank: the embedded engine is one process)
  snapshot        remember the current runtime tensors (their hashes: an exact comparison needs no copy)
  reset_tensors   overwrite every runtime tensor an update rebuilds with random values
  compare         current tensors vs the snapshot, exactly; 400 naming the tensors that differ
`skip_tensor_list` leaves out names containing any of its substrings. Deliberate difference: the hashes are
sha256 of the runtime tensors under v4rl's native names (what the fidelity gate compares), where SGLang
reports 16-hex hashes of its own dequantized parameters; neither is comparable across engines.

    ok, message, extra = WeightsChecker(engine).handle(control.CheckWeights(action="checksum"))
"""

from __future__ import annotations

import hashlib
from typing import Any

from engines.rollout.control import CHECK_WEIGHTS_ACTIONS, CheckWeights
from engines.rollout.engine import RolloutEngine

MAX_NAMED = 8
PARALLELISM_INFO = {"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0,
                    "pp_size": 1, "rank": 0, "size": 1}
"""The one rank of the embedded engine, in SGLang's ParallelismInfo fields."""


def overall_checksum(checksums: dict[str, str]) -> str:
    """One hash over every (name, hash) pair, in name order."""
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(f"{name}={checksums[name]}\n".encode())
    return h.hexdigest()


class WeightsChecker:
    """Per-server checker state (the snapshot lives between a `snapshot` and its `compare`)."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine
        self._snapshot: dict[str, str] | None = None

    def handle(self, body: CheckWeights) -> tuple[bool, str, dict[str, Any]]:
        """(success, message, extra reply fields) for one request."""
        if body.action not in CHECK_WEIGHTS_ACTIONS:
            return False, f"Unsupported action={body.action!r}; use one of {', '.join(CHECK_WEIGHTS_ACTIONS)}", {}
        if body.selector == "draft":
            return False, "selector 'draft': the embedded engine has no draft (speculative) model", {}
        skip = tuple(body.skip_tensor_list or ())
        if body.action == "reset_tensors":
            count = self.engine.reset_runtime_tensors(skip)
            return True, f"Reset {count} runtime tensors to random values; an update must restore them.", {}
        sums = {n: c for n, c in self.engine.checksums().items() if not any(s in n for s in skip)}
        if body.action == "snapshot":
            self._snapshot = sums
            return True, f"Snapshot of {len(sums)} runtime tensors taken.", {}
        if body.action == "compare":
            return self._compare(sums)
        per_gpu = overall_checksum(sums)
        rank = {"checksums": sums, "per_gpu_checksum": per_gpu, "parallelism_info": [dict(PARALLELISM_INFO)]}
        return True, f"Checksummed {len(sums)} runtime tensors.", {
            "ranks": [rank], "per_engine_checksum": hashlib.sha256(per_gpu.encode()).hexdigest()}

    def _compare(self, now: dict[str, str]) -> tuple[bool, str, dict[str, Any]]:
        if self._snapshot is None:
            return False, "no snapshot to compare with: call /weights_checker {\"action\": \"snapshot\"} first", {}
        before, self._snapshot = self._snapshot, None
        differ = sorted(n for n in before.keys() | now.keys() if before.get(n) != now.get(n))
        if not differ:
            return True, f"All {len(now)} runtime tensors equal the snapshot.", {}
        shown = ", ".join(differ[:MAX_NAMED]) + (f" (+{len(differ) - MAX_NAMED} more)" if len(differ) > MAX_NAMED
                                                 else "")
        return False, f"{len(differ)} runtime tensors differ from the snapshot: {shown}", {}
