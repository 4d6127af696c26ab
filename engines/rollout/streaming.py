"""SGLang 0.5.23's streamed /generate (`"stream": true`): server-sent events as its http_server.py writes them.

Read from SGLang's source (`entrypoints/http_server.py` `serve_generate_request`, `managers/tokenizer_manager.py`
`_handle_batch_output` / `_wait_one_response` / `_stream_batch_responses`, `scheduler_components/output_streamer.py`):
  - HTTP 200, `text/event-stream`; each event is `data: <compact JSON>` and a blank line, the last `data: [DONE]`;
  - a chunk is the same `{"text", "output_ids", "meta_info"}` as the unstreamed answer, CUMULATIVE (SGLang's
    default; its `--incremental-streaming-output` deltas are not offered, /server_info says false): the text and
    output_ids so far, logprobs so far, `finish_reason` null until the last chunk, which equals the unstreamed
    answer (stop trimming applied there only); `e2e_latency` only in the last;
  - a batch (or n > 1) streams every sample's chunks interleaved as they come, each with `"index"`: its position
    in the unstreamed answer's list;
  - a chunk goes out after every token (sampling_params.stream_interval k > 1: the first token at once, then
    every k tokens), except while the text so far ends in a possible start of a stop string; chunks queued
    while the client was slow are coalesced into the newest (SGLang sends the last of its queued outputs);
  - a request SGLang refuses after its schema check (e.g. a prompt over the context length) still answers 200:
    one `data: {"error": {"message", "type": "invalid_request_error", "code": 400, "retryable": false}}` event,
    then `data: [DONE]`; a schema error (unknown sampling key) stays a plain 400;
  - a client that disconnects has its unfinished samples aborted.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import Future
from typing import Any

from fastapi.responses import StreamingResponse

from engines.rollout.engine import EngineUnavailable, RequestOutput, RequestSpec, RolloutEngine
from engines.rollout.protocol import ContractError, RequestError, parse_generate, response_item

DONE = b"data: [DONE]\n\n"


def event(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def error_event(message: str, code: int = 400) -> bytes:
    """SGLang's in-stream error (a ValueError raised while the request is handled)."""
    return event({"error": {"message": message, "type": "invalid_request_error", "code": code, "retryable": False}})


def _sse(chunks) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream")


def refused(message: str) -> StreamingResponse:
    async def chunks():
        yield error_event(message)
        yield DONE

    return _sse(chunks())


def stream_generate(engine: RolloutEngine, body: dict[str, Any]) -> StreamingResponse:
    """The streamed answer to a /generate body with `stream` set (call from the event loop)."""
    try:
        specs, batched, options = parse_generate(body, engine.tokenizer, engine.context_length)
        intervals = [_stream_interval(sample) for sample in options["samples"]]
    except ContractError:
        raise  # SGLang's schema gate answers before streaming starts
    except RequestError as exc:
        return refused(str(exc))
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[tuple[int, RequestOutput | Future]] = asyncio.Queue()

    def progress(i: int, out: RequestOutput) -> None:  # scheduler thread
        loop.call_soon_threadsafe(events.put_nowait, (i, out))

    try:
        futures = engine.submit(specs, progress)
    except ValueError as exc:
        return refused(str(exc))
    for i, f in enumerate(futures):
        f.add_done_callback(lambda f, i=i: loop.call_soon_threadsafe(events.put_nowait, (i, f)))
    chunker = _Chunker(engine, specs, options, intervals, batched)
    return _sse(chunker.run(events))


def _stream_interval(sample: dict[str, Any]) -> int:
    value = sample.get("stream_interval")
    if value is None:
        return 1  # SGLang's --stream-interval default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError(f"sampling_params.stream_interval must be a positive integer; got {value!r}")
    return value


class _Chunker:
    """Turns the engine's per-token snapshots and final outputs into SGLang's chunks, in arrival order."""

    def __init__(self, engine: RolloutEngine, specs: list[RequestSpec], options: dict[str, Any],
                 intervals: list[int], batched: bool) -> None:
        self.engine, self.specs, self.options, self.intervals, self.batched = engine, specs, options, intervals, batched
        self.sent = [0] * len(specs)
        """Output tokens each sample's last chunk carried."""
        self.open = set(range(len(specs)))

    async def run(self, events: asyncio.Queue):
        try:
            while self.open:
                arrived = [await events.get()]
                while not events.empty():
                    arrived.append(events.get_nowait())
                newest: dict[int, RequestOutput] = {}
                for i, item in arrived:  # a sample's final output arrives after all of its snapshots
                    if isinstance(item, Future):
                        try:
                            newest[i] = item.result()
                        except EngineUnavailable as exc:  # shut down, or its weights released
                            yield error_event(str(exc), 503)
                            return
                        except RuntimeError as exc:  # a model error failed the step
                            yield error_event(str(exc), 500)
                            return
                    elif i in self.open:
                        newest[i] = item
                for i, out in newest.items():
                    if out.finish_reason is None and not self._due(i, out):
                        continue
                    yield event(self._chunk(i, out))
                    self.sent[i] = len(out.output_ids)
                    if out.finish_reason is not None:
                        self.open.discard(i)
        finally:
            if self.open:  # the client went away (or the engine failed): stop what still runs
                rids = [self.specs[i].rid for i in self.open]
                asyncio.get_running_loop().run_in_executor(None, self.engine.abort, rids)
        yield DONE

    def _due(self, i: int, out: RequestOutput) -> bool:
        """SGLang's output_streamer rule for an unfinished request."""
        unsent, every = len(out.output_ids) - self.sent[i], self.intervals[i]
        if not (every == 1 or unsent >= every or (self.sent[i] == 0 and unsent > 0)):
            return False
        return not self._may_be_stopping(self.specs[i], out.output_ids)

    def _may_be_stopping(self, spec: RequestSpec, output_ids: list[int]) -> bool:
        """Whether the text's tail holds a stop string or the start of one (SGLang holds such chunks back)."""
        if not spec.stop_strings:
            return False
        longest = max(len(s) for s in spec.stop_strings)
        tail = self.engine.tokenizer.decode(output_ids[-(longest + 1):])  # a token is at least one character
        return any(s in tail or any(tail.endswith(s[:k]) for k in range(1, len(s) + 1)) for s in spec.stop_strings)

    def _chunk(self, i: int, out: RequestOutput) -> dict[str, Any]:
        chunk = response_item(out, self.options["samples"][i], self.options["return_text_in_logprobs"],
                              self.engine.tokenizer)
        if self.batched:
            chunk["index"] = i
        return chunk
