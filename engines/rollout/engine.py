"""The embedded rollout engine: continuous batching over our DeepSeek-V4 with online weight updates.

One scheduler thread owns the model. Each loop iteration runs pending control commands, admits
waiting requests up to `max_running_requests` (prefill, grouped by length, served from a prefix cache
when the same sequence was prefilled before, e.g. the n samples of a GRPO group), then runs one decode
step for every running request (row i of one `DecodeBatch` is `_running[i]`; requests at different
positions share it). Callers on other threads talk to it only through futures, so HTTP handlers, tests and
benchmarks never touch the model.

The model runs through the fused native kernels (engines/model/fused_model.py; checked once per model config
at start, engines/model/fused_check.py; the torch ops where they do not apply), and a prefill projects only its last position to
the vocabulary unless a request asks for prompt logprobs.

Sampling follows SGLang's parameters (temperature, top_p, top_k, max_new_tokens, min_new_tokens,
stop_token_ids, stop strings, ignore_eos, a per-request seed). Every request draws from its own
torch.Generator seeded from its seed, so its tokens do not depend on what else is scheduled (up to
float ties); temperature-only rows sample by inverse CDF with one uniform draw each, all rows in one native
call (sampling.py `sample_rows`). Logprobs are RAW: log_softmax of the unprocessed logits, what a trainer
recomputes (SGLang returns the same with SGLANG_RETURN_ORIGINAL_LOGPROB=1; at temperature 1 they coincide);
EngineConfig.return_original_logprob False gives SGLang's default instead, log_softmax(logits / temperature).

Routed experts (EngineConfig.enable_return_routed_experts, a request's return_routed_experts): the experts every
forwarded token was routed to, as the MoE kernel chose them, from its prefill (or the prefix-cache entry it was
served from) and each decode step; returned as SGLang's rows [start, len(sequence) - 1) (docs/rollout-server.md).

Control, with SGLang's semantics (reference/miles-sglang-megatron.md §2.2):
  pause(mode)   abort: finish everything with finish_reason abort | retract: running requests go back
                to the queue, their caches dropped and recomputed on resume | in_place: freeze them
  weight updates wait until nothing is running (new requests queue meanwhile) unless paused; inside
  a begin/end session nothing is scheduled, and `end_weight_update` rebuilds the runtime copies
  before generation resumes (weights.py; these methods live in engine_updates.py).

    engine = RolloutEngine("ckpt/", EngineConfig(dtype="float32"))
    [out] = engine.generate([RequestSpec(rid="a", input_ids=[0, 5, 9], sampling=SamplingParams(), seed=1)])
    engine.shutdown()
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from engines.model import DecodeBatch, SequenceCache, kernels
from engines.rollout.api import (  # noqa: F401  (re-exported: callers import the engine's types from here)
    DTYPES,
    PAUSE_MODES,
    EngineConfig,
    EngineStopped,
    EngineUnavailable,
    PauseMode,
    RequestOutput,
    RequestSpec,
    UpdateResult,
    weight_version_spans,
)
from engines.rollout.engine_updates import WeightUpdates
from engines.rollout.memory import WEIGHTS_RELEASED, MemoryRegions
from engines.rollout.limits import check_request_length, output_cap, scheduler_refusal
from engines.rollout.prefill import PrefixCache, PrefixEntry, stack_routes, topk_rows
from engines.rollout.sampling import UniformStream, sample_rows
from engines.rollout.weights import RawTensor, WeightStore, WeightUpdateError, prepare_runtime_model, rebuild_runtime

log = logging.getLogger("v4rl.rollout")


class _Request:
    """Scheduler-side state of one request."""

    def __init__(self, spec: RequestSpec, stop_ids: frozenset[int], future: Future,
                 progress: Callable[[RequestOutput], None] | None = None, record_routes: bool = False) -> None:
        self.spec, self.stop_ids, self.future, self.progress = spec, stop_ids, future, progress
        self.record_routes = record_routes
        self.routes: list[torch.Tensor] = []
        """int32 [tokens, layers, top_k] chunks: row p is the routing of position p when it was forwarded."""
        self.stream = UniformStream(torch.Generator().manual_seed(spec.seed % (2**63)))
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.output_top: list[list[tuple[float, int]]] = []
        self.input_logprobs: list[float | None] | None = None
        self.input_top: list[list[tuple[float, int]] | None] = []
        self.next_logits: torch.Tensor | None = None
        self.cached_tokens = 0
        self.num_retractions = 0
        self.version_changes: list[tuple[str, int]] = []
        """(weight version replaced, output tokens at that moment) for updates landing mid-request."""
        self.created = time.monotonic()

    @property
    def sequence(self) -> list[int]:
        return self.spec.input_ids + self.output_ids

    def add_prefill_routes(self, routes: torch.Tensor) -> None:
        """A prefill's routes [len(sequence), layers, top_k]. Rows a retracted request recorded before stay: row p
        routed the forward that gave token p+1 its logprob, which the request keeps (radixark/miles#3277: a
        re-prefill must not pair old logprobs with new routes); the re-prefill supplies the last row only."""
        kept = torch.cat(self.routes)[:len(routes) - 1] if self.routes else routes[:0]
        self.routes = [kept, routes[len(kept):]]


@dataclass
class _Command:
    fn: Callable[[], Any]
    future: Future
    when_idle: bool


class RolloutEngine(WeightUpdates):
    """Continuous-batching DeepSeek-V4 engine holding FP8/FP4 weights as stored (see module docstring)."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None) -> None:
        started = time.monotonic()
        self.config = config or EngineConfig()
        self.model_dir = Path(model_dir)
        self.store = WeightStore.from_dir(self.model_dir)
        self.cfg = self.store.cfg
        self.model = prepare_runtime_model(self.cfg, DTYPES[self.config.dtype])
        self.model.fused_kernels = True  # checked once per model config (engines/model/fused_check.py)
        rebuild_runtime(self.model, self.store, rocm_fnuz=self.config.rocm_fnuz)  # the cold-start path
        # The fused kernels' check runs here rather than in the first request: once per model config in a process,
        # on a synthetic model of this shape (fused_check.py), its verdict and seconds in status()'s native_kernels.
        self.model.fused.usable()
        self.tokenizer = _load_tokenizer(self.model_dir)
        eos = self.cfg.eos_token_id
        self.eos_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
        self.context_length = self.config.context_length or self.cfg.max_position_embeddings
        self.weight_version = self.config.weight_version
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._batch: DecodeBatch | None = None
        """Decode caches of `_running`, row i for request i (None when nothing runs)."""
        self._last_decode: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None
        """The last decode step's logits [B, vocab] and its rows (each running request's next_logits)."""
        self._prefix = PrefixCache(self.model, self.config.prefix_cache_entries)
        self._paused = False
        self._memory = MemoryRegions()  # released regions (memory.py); nothing runs while the weights are freed
        self._session: dict[str, RawTensor] | None = None
        self._session_version: str | None = None
        self._deferred: deque[_Command] = deque()
        self._commands: queue.Queue[_Command | None] = queue.Queue()
        self._stopping = False
        self._stats = {"generated_tokens": 0, "prefill_tokens": 0, "cached_tokens": 0, "retractions": 0,
                       "weight_updates": 0}
        self._thread = threading.Thread(target=self._loop, name="rollout-scheduler", daemon=True)
        self._thread.start()
        self.load_seconds = time.monotonic() - started
        """Seconds from construction to a running scheduler (weights read, runtime copies built)."""

    # ================================================================== thread-safe API
    def submit(self, specs: Sequence[RequestSpec], progress: Callable[[int, RequestOutput], None] | None = None
               ) -> list[Future]:
        """Queue requests; each future resolves to a RequestOutput (aborted ones included). `progress(i, output)`,
        if given, runs on the scheduler thread after every token of specs[i] but its last (a snapshot whose
        finish_reason is None), for streaming; it must return at once (hand the output to another thread)."""
        for s in specs:
            self._validate(s)
        futures: list[Future] = [Future() for _ in specs]
        pending = [_Request(s, self._stop_ids(s), f, None if progress is None else partial(progress, i),
                            s.return_routed_experts and self.config.enable_return_routed_experts)
                   for i, (s, f) in enumerate(zip(specs, futures))]

        def failed(cmd: Future) -> None:  # engine stopped before the requests were queued
            if cmd.exception() is not None:
                for f in futures:
                    if not f.done():
                        f.set_exception(cmd.exception())

        self._call(lambda: self._admit(pending)).add_done_callback(failed)
        return futures

    def generate(self, specs: Sequence[RequestSpec], timeout: float | None = None) -> list[RequestOutput]:
        return [f.result(timeout) for f in self.submit(specs)]

    def abort(self, rid: str | Sequence[str] | None = None, *, abort_all: bool = False) -> int:
        """Finish the requests with these rids (or all) with finish_reason abort; returns how many."""
        rids = {rid} if isinstance(rid, str) else set(rid or ())
        return self._call(lambda: self._abort_where(lambda r: abort_all or r.spec.rid in rids,
                                                    "Abort requested")).result()

    def pause(self, mode: PauseMode = "abort") -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}; got {mode!r}")
        self._call(lambda: self._pause(mode)).result()

    def resume(self) -> None:
        self._call(lambda: setattr(self, "_paused", False)).result()

    def flush_cache(self) -> bool:
        """Drop the prefix cache; refused (False) while requests hold KV (running, or paused in_place).
        Retracted and queued requests hold none, so pause(retract) + flush works, as Miles relies on."""
        return self._call(self._flush_cache).result()

    def set_weight_version(self, version: str, *, abort_all_requests: bool = False) -> None:
        if abort_all_requests:
            self.abort(abort_all=True)
        self._call(lambda: self._set_version(str(version))).result()

    def status(self) -> dict[str, Any]:
        def snapshot() -> dict[str, Any]:
            return {"num_running_reqs": len(self._running), "num_waiting_reqs": len(self._waiting),
                    "paused": self._paused, "weight_update_session": self._session is not None,
                    "memory_released": sorted(self._memory.released), "weights_freed": self._memory.weights_freed,
                    "weight_version": self.weight_version, "prefix_cache_entries": len(self._prefix),
                    "stored_tensors": self.store.storage_summary(), "native_kernels": kernels.status(),
                    **self._stats}
        return self._call(snapshot).result()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the scheduler; pending requests and commands fail with EngineStopped."""
        if not self._thread.is_alive():
            return
        self._stopping = True
        self._commands.put(None)
        self._thread.join(timeout)

    # ================================================================== plumbing
    def _call(self, fn: Callable[[], Any], *, when_idle: bool = False) -> Future:
        fut: Future = Future()
        if self._stopping or not self._thread.is_alive():
            fut.set_exception(EngineStopped("the rollout engine is shut down"))
            return fut
        self._commands.put(_Command(fn, fut, when_idle))
        return fut

    @staticmethod
    def _guarded(fut: Future, timeout: float | None) -> UpdateResult:
        try:
            return fut.result(timeout)
        except (WeightUpdateError, ValueError) as exc:
            return UpdateResult(False, str(exc))

    def _validate(self, s: RequestSpec) -> None:
        n = len(s.input_ids)
        if n == 0:
            raise ValueError(f"request {s.rid}: input_ids is empty; a prompt needs at least one token (e.g. BOS)")
        bad = [t for t in s.input_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"request {s.rid}: token ids {bad[:5]} are outside the vocabulary [0, {self.cfg.vocab_size})")
        check_request_length(prompt_tokens=n, max_new_tokens=None, context_length=self.context_length)
        if not -1 <= s.logprob_start_len <= n:
            raise ValueError(f"request {s.rid}: logprob_start_len {s.logprob_start_len} must be -1 or in [0, {n}]")
        if s.return_routed_experts and not 0 <= s.routed_experts_start_len <= n:
            raise ValueError(f"request {s.rid}: routed_experts_start_len {s.routed_experts_start_len} must be in "
                             f"[0, {n}] (the prompt's length)")
        if s.stop_strings and self.tokenizer is None:
            raise ValueError(f"request {s.rid}: stop strings need a tokenizer, and {self.model_dir} has none; "
                             "use stop_token_ids")

    def _stop_ids(self, s: RequestSpec) -> frozenset[int]:
        """The tokens min_new_tokens bans (with ignore_eos too, as SGLang's penalizer) and that end a request
        unless ignore_eos."""
        return frozenset(s.sampling.stop_token_ids) | self.eos_ids

    # ================================================================== scheduler thread
    def _loop(self) -> None:
        if self.config.threads is not None:
            torch.set_num_threads(self.config.threads)
        while True:
            idle = not (self._schedulable and (self._waiting or self._running))
            try:
                first = self._commands.get(timeout=0.5) if idle else self._commands.get_nowait()
            except queue.Empty:
                first = False
            commands = [] if first is False else [first]
            while not self._commands.empty():
                commands.append(self._commands.get_nowait())
            if None in commands:
                self._stop(commands)
                return
            for c in commands:
                (self._deferred.append(c) if c.when_idle else self._run(c))
            while self._deferred and (self._paused or self._session is not None or not self._running):
                self._run(self._deferred.popleft())
            if self._schedulable:
                self._step()

    @property
    def _schedulable(self) -> bool:
        return not self._paused and self._session is None and not self._memory.weights_freed

    def _admit(self, pending: list[_Request]) -> None:
        if self._memory.weights_freed:  # at once: queued, a router's request or health probe would hang till resume
            for r in pending:
                r.future.set_exception(EngineUnavailable(WEIGHTS_RELEASED))
            return
        self._waiting.extend(pending)

    @staticmethod
    def _run(c: _Command) -> None:
        try:
            c.future.set_result(c.fn())
        except BaseException as exc:  # delivered to the caller, the scheduler keeps going
            c.future.set_exception(exc)

    def _step(self) -> None:
        admitted: list[_Request] = []
        try:
            room = self.config.max_running_requests - len(self._running)
            while self._waiting and room > 0 and not self._deferred:
                r = self._waiting.popleft()
                refused = scheduler_refusal(len(r.spec.input_ids), self.context_length)
                if refused is None:
                    admitted.append(r)
                    room -= 1
                else:
                    self._finish(r, refused)
            if admitted:
                self._prefill(admitted)
            if self._running:
                self._decode_step()
        except Exception as exc:  # a model error fails the requests in flight, not the server
            log.exception("rollout engine step failed")
            for r in {id(r): r for r in admitted + self._running}.values():
                if not r.future.done():
                    r.future.set_exception(RuntimeError(f"rollout engine step failed: {exc!r}"))
            self._running, self._batch = [], None

    def _stop(self, commands: list[_Command | None]) -> None:
        self._stopping = True
        err = EngineStopped("the rollout engine was shut down")
        while not self._commands.empty():
            commands.append(self._commands.get_nowait())
        for c in list(self._deferred) + [c for c in commands if c is not None]:
            c.future.set_exception(err)
        for r in list(self._waiting) + self._running:
            r.future.set_exception(err)

    # ------------------------------------------------------------------ prefill
    @torch.inference_mode()
    def _prefill(self, reqs: list[_Request]) -> None:
        hits: dict[tuple[int, ...], PrefixEntry] = {}
        tops: dict[tuple[int, ...], int] = {}
        scored: set[tuple[int, ...]] = set()
        for r in reqs:
            key = tuple(r.sequence)
            wants_top = r.spec.top_logprobs_num if r.input_logprobs is None else 0
            wants_logprobs = r.input_logprobs is None and _wants_prompt_logprobs(r.spec)
            cached = None if wants_top else self._prefix.hit(key, needs_logprobs=wants_logprobs)
            if cached is not None:
                hits[key] = cached
            else:
                tops[key] = max(tops.get(key, 0), wants_top)
                if wants_logprobs or wants_top:
                    scored.add(key)
        fresh, prefilled = self._prefix.prefill(tops, scored)
        self._stats["prefill_tokens"] += prefilled
        seen: set[tuple[int, ...]] = set()
        started: list[tuple[_Request, SequenceCache]] = []
        for r in reqs:
            key = tuple(r.sequence)
            entry, top = fresh[key] if key in fresh else (hits[key], None)
            if key in hits or key in seen:
                r.cached_tokens = len(key)
                self._stats["cached_tokens"] += len(key)
            seen.add(key)
            r.next_logits = entry.last_logits
            if r.record_routes:
                r.add_prefill_routes(entry.routes)
            if r.input_logprobs is None:
                self._set_input_logprobs(r, entry.token_logprobs, top)
            if r.spec.sampling.max_new_tokens == 0:
                self._finish(r, {"type": "length", "length": 0})
            else:
                started.append((r, entry.cache))
        if started:  # from_caches copies: decoding never writes into the prefix cache
            rows = DecodeBatch.from_caches(self.cfg, [cache for _, cache in started])
            if self._batch is None:
                self._batch = rows
            else:
                self._batch.extend(rows)
            self._running.extend(r for r, _ in started)

    def _set_input_logprobs(self, r: _Request, token_lp: list[float] | None, top: list | None) -> None:
        n = len(r.spec.input_ids)
        if not r.spec.return_logprob:
            r.input_logprobs = []
            return
        start = r.spec.logprob_start_len if r.spec.logprob_start_len >= 0 else n
        if start >= n:  # output tokens only
            r.input_logprobs, r.input_top = [], []
            return
        r.input_logprobs = [None] + (token_lp[start:n - 1] if start < n - 1 else [])
        if r.spec.top_logprobs_num:
            r.input_top = [None] + (top[start:n - 1] if top is not None else [])

    # ------------------------------------------------------------------ decode
    @torch.inference_mode()
    def _decode_step(self) -> None:
        rows = self._running
        last = self._last_decode
        if last is not None and len(last[1]) == len(rows) and all(r.next_logits is v for r, v in zip(rows, last[1])):
            logits = last[0]  # every row continues from the last step, in order: no per-row gather
        else:
            logits = torch.stack([r.next_logits for r in rows])
        banned = {i: sorted(r.stop_ids) for i, r in enumerate(rows)
                  if len(r.output_ids) < r.spec.min_new_tokens and r.stop_ids}
        tokens, token_logprobs = sample_rows(logits, [r.spec.sampling for r in rows], [r.stream for r in rows], banned)
        self._stats["generated_tokens"] += len(rows)
        keep: list[_Request] = []
        for i, (r, tok) in enumerate(zip(rows, tokens)):
            r.output_ids.append(tok)
            r.output_logprobs.append(token_logprobs[i])
            temperature = r.spec.sampling.temperature
            processed = not self.config.return_original_logprob and temperature > 0 and temperature != 1
            if r.spec.top_logprobs_num or processed:
                row = logits[i:i + 1].float()
                lp = torch.log_softmax(row / temperature if processed else row, dim=-1)
                if r.spec.top_logprobs_num:
                    r.output_top.append(topk_rows(lp, r.spec.top_logprobs_num)[0])
                # one tensor for both, as SGLang: a sampled top-k token shows the same logprob in each list
                # (the sampler's own logprob can differ from this row's in the last float32 bit)
                r.output_logprobs[-1] = float(lp[0, tok])
            reason = self._finish_reason(r, tok)
            if reason is None:
                keep.append(r)
                if r.progress is not None:
                    r.progress(self._output(r, None))
            else:
                self._finish(r, reason)
        self._keep_running(keep)
        self._last_decode = None
        if keep:
            routes = [] if any(r.record_routes for r in keep) else None
            nxt = self.model.decode(torch.tensor([r.output_ids[-1] for r in keep]), self._batch, routes)
            views = nxt.unbind(0)
            for r, v in zip(keep, views):
                r.next_logits = v
            if routes is not None:
                for r, row in zip(keep, stack_routes(routes, len(keep))):
                    if r.record_routes:
                        r.routes.append(row)
            self._last_decode = (nxt, views)

    def _keep_running(self, keep: list[_Request]) -> None:
        """Shrink `_running` (and its decode rows) to `keep`, a subsequence of it."""
        if len(keep) == len(self._running):
            return
        if not keep:
            self._running, self._batch = [], None
            return
        position = {id(r): i for i, r in enumerate(self._running)}
        self._batch.select([position[id(r)] for r in keep])
        self._running = keep

    def _finish_reason(self, r: _Request, tok: int) -> dict[str, Any] | None:
        """SGLang 0.5.23's order (limits.py): stop strings (min_new_tokens does not hold them back), then stop
        tokens (banned below min_new_tokens; ignored with ignore_eos), then the length cap."""
        if r.spec.stop_strings:
            text = self.tokenizer.decode(r.output_ids)
            for s in r.spec.stop_strings:
                if s in text:
                    return {"type": "stop", "matched": s}
        if tok in r.stop_ids and not r.spec.sampling.ignore_eos:
            return {"type": "stop", "matched": tok}
        cap = output_cap(len(r.spec.input_ids), r.spec.sampling.max_new_tokens, self.context_length)
        if len(r.output_ids) >= cap:
            return {"type": "length", "length": cap}
        return None

    def _output(self, r: _Request, reason: dict[str, Any] | None) -> RequestOutput:
        """The request's result so far; a snapshot (list copies) while it runs, its own lists once finished."""
        spans = weight_version_spans(r.version_changes, self.weight_version, len(r.output_ids))
        copy = list if reason is None else (lambda x: x)
        return RequestOutput(
            rid=r.spec.rid, input_ids=r.spec.input_ids, output_ids=copy(r.output_ids), finish_reason=reason,
            output_logprobs=copy(r.output_logprobs), output_top_logprobs=copy(r.output_top),
            input_logprobs=r.input_logprobs or [], input_top_logprobs=r.input_top,
            cached_tokens=r.cached_tokens, num_retractions=r.num_retractions,
            weight_version=spans[-1]["version"],  # the weights of its last tokens (SGLang's meta_info)
            e2e_latency=time.monotonic() - r.created, weight_versions=spans,
            routed_experts=self._routed_experts(r) if reason is not None and r.record_routes else None)

    @staticmethod
    def _routed_experts(r: _Request) -> torch.Tensor:
        """SGLang's rows [start, len(sequence) - 1): every forwarded token but the last one (whose forward, if it
        ran, feeds no returned logprob)."""
        rows = torch.cat(r.routes) if r.routes else torch.empty(0, dtype=torch.int32)
        return rows[r.spec.routed_experts_start_len:len(r.sequence) - 1]

    def _finish(self, r: _Request, reason: dict[str, Any]) -> None:
        r.next_logits = None
        if not r.future.done():
            r.future.set_result(self._output(r, reason))

    # ------------------------------------------------------------------ control (scheduler thread)
    def _abort_where(self, match: Callable[[_Request], bool], message: str) -> int:
        hit = [r for r in list(self._waiting) + self._running if match(r)]
        ids = {id(r) for r in hit}
        self._waiting = deque(r for r in self._waiting if id(r) not in ids)
        self._keep_running([r for r in self._running if id(r) not in ids])
        for r in hit:
            self._finish(r, {"type": "abort", "message": message, "status_code": None, "err_type": None})
        return len(hit)

    def _pause(self, mode: str) -> None:
        if mode == "abort":
            self._abort_where(lambda r: True, "Abort: generation paused (pause_generation mode=abort)")
        elif mode == "retract":
            for r in self._running:
                r.next_logits = None
                r.num_retractions += 1
                self._stats["retractions"] += 1
            self._waiting.extendleft(reversed(self._running))
            self._running, self._batch = [], None
        self._paused = True

    def _flush_cache(self) -> bool:
        if self._running:
            return False
        self._prefix.clear()
        return True

    def _rebuild(self) -> None:
        rebuild_runtime(self.model, self.store, rocm_fnuz=self.config.rocm_fnuz)

    def _set_version(self, version: str) -> None:
        """Switch the weight version, noting it on every request that already has output (its spans)."""
        if version == self.weight_version:
            return
        for r in list(self._waiting) + self._running:
            if r.output_ids:
                r.version_changes.append((self.weight_version, len(r.output_ids)))
        self.weight_version = version


def _wants_prompt_logprobs(spec: RequestSpec) -> bool:
    """Whether a request returns any prompt-token logprob (SGLang: from logprob_start_len; -1 means none)."""
    return spec.return_logprob and 0 <= spec.logprob_start_len < len(spec.input_ids) - 1


def _load_tokenizer(model_dir: Path):
    """The checkpoint's tokenizer, if it ships one (needed for `text` inputs and stop strings)."""
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
