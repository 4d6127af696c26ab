"""The rollout engine's weight updates and memory occupation, as SGLang serves them (a mixin of RolloutEngine).

Every method here runs its work on the scheduler thread through `_call` (engine.py): disk and in-memory updates
(a broadcast bucket), the begin/end staging session, memory release/resume (memory.py), and the weights
checker's reset and checksums. Updates wait until nothing runs (or the engine is paused); `_commit` applies
stored tensors and rebuilds the runtime copies through the engine's `_rebuild`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from engines.rollout import memory
from engines.rollout.api import UpdateResult
from engines.rollout.weights import RawTensor, WeightUpdateError, randomize_runtime, read_weight_dir, runtime_checksums


class WeightUpdates:
    """Weight-update and memory methods of RolloutEngine (which provides the state and `_call`/`_guarded`)."""

    def update_weights_from_disk(self, path: str | Path, *, weight_version: str | None = None,
                                 abort_all_requests: bool = False, keep_pause: bool = False,
                                 timeout: float | None = None) -> UpdateResult:
        """Load a whole checkpoint or one bucket from a HF-layout directory.

        Inside a begin/end session the tensors are staged and applied at end_weight_update. Outside
        one, this is begin + load + end in one step: it waits until nothing runs (or the engine is
        paused), applies, rebuilds the runtime copies, and resumes generation unless keep_pause.
        """
        path = Path(path)
        try:
            cfg, tensors = read_weight_dir(path, fp8_block=self.store.fp8_block)  # off the scheduler thread
        except (OSError, ValueError) as exc:
            return UpdateResult(False, f"cannot read weights from {path}: {exc}")
        return self.update_weights_from_tensors(tensors, source=str(path), cfg=cfg, weight_version=weight_version,
                                                abort_all_requests=abort_all_requests, keep_pause=keep_pause,
                                                timeout=timeout)

    def update_weights_from_tensors(self, tensors: Mapping[str, RawTensor], *, source: str, cfg=None,
                                    weight_version: str | None = None, abort_all_requests: bool = False,
                                    keep_pause: bool = False, timeout: float | None = None) -> UpdateResult:
        """The disk update's path for tensors already in memory (native names, stored form: a broadcast bucket)."""
        num_aborted = self.abort(abort_all=True) if abort_all_requests else 0

        def apply() -> UpdateResult:
            update = self.store.check_update(tensors, source=source, cfg=cfg)
            if self._session is not None:
                self._session.update(update)
                if weight_version is not None:
                    self._session_version = str(weight_version)
                return UpdateResult(True, f"Staged {len(update)} tensors from {source}; they take effect at "
                                          "/end_weight_update.", num_aborted)
            self._commit(update, weight_version)
            if not keep_pause:
                self._paused = False
            return UpdateResult(True, f"Succeeded to update model weights from {source} ({len(update)} tensors).",
                                num_aborted)

        return self._guarded(self._call(apply, when_idle=True), timeout)

    def begin_weight_update(self, timeout: float | None = None) -> UpdateResult:
        """Open a staging session (waits until nothing runs); nothing is scheduled until it ends."""
        def begin() -> UpdateResult:
            if self._session is not None:
                raise WeightUpdateError("a weight update session is already open; call /end_weight_update first")
            self._session, self._session_version = {}, None
            return UpdateResult(True, "Weight update session opened; generation is held until /end_weight_update.")

        return self._guarded(self._call(begin, when_idle=True), timeout)

    def end_weight_update(self, timeout: float | None = None) -> UpdateResult:
        """Apply the staged tensors, rebuild every runtime copy, close the session, resume scheduling."""
        def end() -> UpdateResult:
            if self._session is None:
                raise WeightUpdateError("no weight update session is open; call /begin_weight_update first")
            staged, version = self._session, self._session_version
            self._session = self._session_version = None
            self._commit(staged, version)
            return UpdateResult(True, f"Weight update session closed: {len(staged)} tensors applied, runtime "
                                      "copies rebuilt.")

        return self._guarded(self._call(end), timeout)

    def release_memory_occupation(self, tags: Sequence[str] | None, *, free_weights: bool) -> int:
        """SGLang's memory release (memory.py): refused unless idle; returns the bytes freed."""
        return self._call(lambda: self._memory.release(memory.normalize_tags(tags), self.model, self._prefix,
                                                       free_weights, busy=bool(self._running))).result()

    def resume_memory_occupation(self, tags: Sequence[str] | None) -> None:
        self._call(lambda: self._memory.resume(memory.normalize_tags(tags), self.model, self._rebuild)).result()

    def reset_runtime_tensors(self, skip: Sequence[str] = ()) -> int:
        """Overwrite every runtime tensor a weight update rebuilds with random values (SGLang's weights_checker
        `reset_tensors`: a later update must restore them all); names containing a `skip` entry are kept."""
        return self._call(lambda: randomize_runtime(self.model, skip)).result()

    def checksums(self) -> dict[str, str]:
        """sha256 of every runtime parameter and buffer (what the engine computes with)."""
        return self._call(lambda: runtime_checksums(self.model)).result()

    def _commit(self, update: Mapping[str, RawTensor], version: str | None) -> None:
        """Apply stored tensors, rebuild every runtime copy, drop KV computed with the old weights."""
        self.store.apply(update)
        if not self._memory.weights_freed:  # released weights are rebuilt from the store at resume
            self._rebuild()
        self._prefix.clear()
        self._stats["weight_updates"] += 1
        if version is not None:
            self._set_version(str(version))
