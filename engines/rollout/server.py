"""SGLang-compatible HTTP server over the embedded rollout engine (SGLang 0.5.23's native API and semantics).

Routes (bodies, defaults and replies as SGLang's `entrypoints/http_server.py`; reference/conformance.md part B):
  POST /generate                    see protocol.py (null = default, empty grammar = unset, rid expansion, ...),
                                    limits.py (context-length gates, finish order) and, with `"stream": true`,
                                    streaming.py (SGLang's server-sent events)
  GET  /health, /health_generate    both run SGLang's one-token generation probe: 200 once the scheduler
                                    answers anything, 503 after SGLANG_HEALTH_CHECK_TIMEOUT (20 s), e.g.
                                    while paused; SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0 makes /health
                                    a liveness check (SGLang's switch)
  GET  /ready                       200 while accepting requests, 503 while paused or the weights are freed
  GET  /model_info, /server_info    (and the deprecated /get_model_info, /get_server_info) SGLang's fields;
                                    a disk update moves `model_path`, `served_model_name`, `load_format`
  POST /pause_generation {"mode"}, /continue_generation, /abort_request {"rid", "abort_all"}
  GET|POST /flush_cache?timeout=S   waits up to S seconds for idle, then flushes (400 if still busy)
  POST /update_weights_from_disk, /begin_weight_update, /end_weight_update, /update_weight_version
  GET|POST /weights_checker         actions snapshot | reset_tensors | compare | checksum
  /init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group
                                    SGLang's broadcast update over a gloo group (distributed_update.py)
  GET|POST /release_memory_occupation, /resume_memory_occupation {"tags"}   memory.py (what a CPU engine frees)
  /update_weights_from_tensor       validated as SGLang does, then 400: CUDA IPC needs GPUs
Control bodies are required where SGLang requires them (`control.py`): an empty body is a 400 in SGLang's
validation shape. Weight endpoints answer `{"success", "message"}`, HTTP 400 on failure. With an API key,
every route but /health*, /ready and /metrics needs `Authorization: Bearer <key>` (scheme case-insensitive,
as SGLang's auth.py); 401 `{"error": "Unauthorized"}` otherwise. No route SGLang 0.5.23 lacks is served.

Deliberate differences from SGLang (also in docs/rollout-server.md):
  - generation is held inside a begin/end weight-update session and weight updates wait until nothing
    runs (unless paused); SGLang keeps generating during a session, so its callers pause first, as
    `launcher.DistributedWeightSync` does for both;
  - /update_weights_from_disk inside a session stages the directory (a bucket) and applies it at
    /end_weight_update; outside one it loads, rebuilds and flushes the prefix cache in one step
    (`flush_cache: false` cannot keep KV that belongs to the old weights);
  - /weights_checker hashes the embedded engine's runtime tensors under v4rl's native names with sha256
    (the fidelity gate compares them exactly); SGLang's 16-hex hashes of its own dequantized parameters
    are not comparable across engines anyway;
  - /server_info reports the ServerArgs fields this engine has a value for, plus v4rl's own under "v4rl".

The server binds 127.0.0.1 unless told otherwise. Blocking engine calls run in a worker thread; a
client that disconnects mid-/generate has its requests aborted. `v4rl serve-rollout` sets
OMP_WAIT_POLICY=PASSIVE unless set: with libgomp's default spin-wait the engine ran ~10x slower on a
loaded 2-core machine (40 vs 450 tok/s), each OpenMP worker spinning on CPU the others need.

    v4rl serve-rollout --model ckpt/ --port 30000
    with RolloutServer(RolloutEngine("ckpt/")) as server:   # in-process, free port: server.url
        ...
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import Body, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from engines.rollout import control
from engines.rollout.engine import EngineUnavailable, RolloutEngine
from engines.rollout.distributed_update import WeightUpdateGroups
from engines.rollout.health import HealthProbe
from engines.rollout.memory import MemoryOccupationError
from engines.rollout.info import ServingState
from engines.rollout.limits import http_status_of
from engines.rollout.protocol import RequestError, build_response, parse_generate
from engines.rollout.streaming import stream_generate
from engines.rollout.weights_checker import WeightsChecker

log = logging.getLogger("v4rl.rollout")
DISTRIBUTED_UNSUPPORTED = ("the embedded v4rl engine has no CUDA-IPC weight sync (/update_weights_from_tensor); use "
                           "/update_weights_from_distributed (a gloo group) or /update_weights_from_disk")
OUTSIDE_SESSION = ("update_weights_from_distributed must run between begin_weight_update() and "
                   "end_weight_update()")
"""SGLang 0.5.23's refusal of a distributed update outside a session (scheduler_components/weight_updater.py)."""
AUTH_EXEMPT = ("/health", "/ready", "/metrics")


def _result(success: bool, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"success": success, "message": message, **extra}, status_code=200 if success else 400)


def _validation_error(message: str) -> JSONResponse:
    """SGLang's 400 for a body FastAPI could not validate (its ErrorResponse)."""
    return JSONResponse({"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400},
                        status_code=400)


def _bearer_ok(header: str | None, key: str) -> bool:
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), key.encode())


REFUSAL_PREFIX = "v4rl engine refused "
"""How `v4rl serve-rollout` starts its line for each refused request (on stderr), so a supervisor can find it."""


def create_app(engine: RolloutEngine, *, api_key: str | None = None,
               server_args: dict[str, Any] | None = None,
               on_refusal: Callable[[str], None] | None = None) -> FastAPI:
    """The FastAPI app serving `engine` with SGLang's native routes. `on_refusal` gets one line per refused
    request, an answer of status 4xx ("POST /generate: HTTP 400 {body}"; a 503 while paused is no refusal): clients such as Miles' retry any non-2xx answer for a
    minute before they raise, so whoever runs the server can show the engine's own reason at once."""
    app = FastAPI(title="v4rl rollout (SGLang-compatible)", openapi_url=None, docs_url=None, redoc_url=None)
    if on_refusal is not None:
        @app.middleware("http")
        async def report_refusals(request: Request, call_next):
            response = await call_next(request)
            # "PRI *": an HTTP/2 preface (sglang-router probes each worker for gRPC first), no client's request
            if not 400 <= response.status_code < 500 or request.method == "PRI":
                return response
            body = b"".join([chunk async for chunk in response.body_iterator])
            on_refusal(f"{request.method} {request.url.path}: HTTP {response.status_code} "
                       f"{body[:500].decode(errors='replace')}")
            return Response(content=body, status_code=response.status_code, headers=dict(response.headers))

    state = ServingState(engine, **(server_args or {}))
    probe = HealthProbe(engine)
    checker = WeightsChecker(engine)
    update_groups = WeightUpdateGroups(engine)

    if api_key:
        @app.middleware("http")
        async def authenticate(request: Request, call_next):
            if request.method == "OPTIONS" or request.url.path.startswith(AUTH_EXEMPT):
                return await call_next(request)
            if not _bearer_ok(request.headers.get("Authorization"), api_key):
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
            return await call_next(request)

    @app.exception_handler(RequestError)
    async def bad_request(_: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(f"{exc} {exc.errors()}")

    @app.exception_handler(EngineUnavailable)
    async def unavailable(_: Request, exc: EngineUnavailable) -> JSONResponse:
        return JSONResponse({"error": {"message": str(exc)}}, status_code=503)

    # ------------------------------------------------------------------ health and info
    @app.get("/health")
    async def health() -> Response:
        if not probe.generation_on_health():
            return Response(status_code=200 if engine.alive else 503)
        return Response(status_code=await probe.check())

    @app.get("/health_generate")
    async def health_generate() -> Response:
        return Response(status_code=await probe.check())

    @app.get("/ready")
    async def ready() -> Response:
        if not engine.alive:
            return Response(status_code=503)
        status = await run_in_threadpool(engine.status)
        return Response(status_code=503 if status["paused"] or status["weights_freed"] else 200)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return state.model_info()

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return state.server_info(await run_in_threadpool(engine.status))

    # ------------------------------------------------------------------ generation
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Any:
        try:
            body = await request.json()
        except ValueError as exc:
            raise RequestError(f"request body is not valid JSON: {exc}") from None
        if isinstance(body, dict) and body.get("stream"):
            return stream_generate(engine, body)
        specs, batched, options = parse_generate(body, engine.tokenizer, engine.context_length)
        try:
            futures = [asyncio.wrap_future(f) for f in engine.submit(specs)]
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        pending = set(futures)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=1.0)
            if pending and await request.is_disconnected():
                await run_in_threadpool(engine.abort, [s.rid for s in specs])
                await asyncio.wait(pending)
                break
        try:
            outputs = [f.result() for f in futures]
        except EngineUnavailable:
            raise
        except RuntimeError as exc:
            return JSONResponse({"error": {"message": str(exc)}}, status_code=500)
        for out in outputs:  # an abort carrying a status (the scheduler's length gate) answers the whole request
            status = http_status_of(out.finish_reason)
            if status == 400:
                raise RequestError(out.finish_reason["message"])
            if status is not None:
                return JSONResponse({"detail": out.finish_reason["message"]}, status_code=status)
        return build_response(outputs, batched, options, engine.tokenizer)

    @app.post("/abort_request")
    async def abort_request(body: control.AbortRequest = Body()) -> Response:
        await run_in_threadpool(engine.abort, body.rid or None, abort_all=body.abort_all)
        return Response(status_code=200)

    # ------------------------------------------------------------------ pause / cache
    @app.post("/pause_generation")
    async def pause_generation(body: control.PauseGeneration = Body()) -> JSONResponse:
        await run_in_threadpool(engine.pause, body.mode)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation(body: control.ContinueGeneration = Body()) -> JSONResponse:
        await run_in_threadpool(engine.resume)
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(timeout: float = Query(0.0, ge=0.0)) -> Response:
        deadline = time.monotonic() + timeout
        while not (ok := await run_in_threadpool(engine.flush_cache)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # SGLang defers the flush until idle, up to `timeout` seconds
        if ok:
            return Response("Cache flushed.\n", status_code=200)
        why = "Timed out waiting for idle state." if timeout else "requests holding KV are running or paused in place"
        return Response(f"Cache not flushed: {why}; abort or retract them first.\n", status_code=400)

    # ------------------------------------------------------------------ weights
    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: control.UpdateWeightsFromDisk = Body()) -> JSONResponse:
        refused = _unsupported_disk_options(body)
        if refused:
            return _result(False, refused, num_paused_requests=0)
        res = await run_in_threadpool(lambda: engine.update_weights_from_disk(
            body.model_path, weight_version=body.weight_version, abort_all_requests=body.abort_all_requests,
            keep_pause=body.keep_pause))
        if res.success:
            state.moved_to(body.model_path, body.load_format)
        version = body.weight_version
        message = res.message + (f" Weight version updated to {version}." if res.success and version else "")
        return _result(res.success, message, num_paused_requests=res.num_paused_requests)

    @app.post("/begin_weight_update")
    async def begin_weight_update(body: control.BeginWeightUpdate = Body()) -> JSONResponse:
        if body.selector == "draft":
            return _result(False, "selector 'draft': the embedded engine has no draft (speculative) model")
        res = await run_in_threadpool(engine.begin_weight_update)
        return _result(res.success, res.message)

    @app.post("/end_weight_update")
    async def end_weight_update(body: control.EndWeightUpdate = Body()) -> JSONResponse:
        unpaired = update_groups.unpaired()
        if unpaired:
            await run_in_threadpool(engine.end_weight_update)  # the session closes; the last complete state holds
            return _result(False, unpaired)
        res = await run_in_threadpool(engine.end_weight_update)
        return _result(res.success, res.message)

    @app.post("/update_weight_version")
    async def update_weight_version(body: control.UpdateWeightVersion = Body()) -> JSONResponse:
        await run_in_threadpool(lambda: engine.set_weight_version(
            body.new_version, abort_all_requests=body.abort_all_requests))
        return _result(True, f"Weight version updated to {body.new_version}", new_version=body.new_version)

    @app.api_route("/weights_checker", methods=["GET", "POST"])
    async def weights_checker(body: control.CheckWeights | None = Body(None)) -> JSONResponse:
        body = body or control.CheckWeights()
        success, message, extra = await run_in_threadpool(checker.handle, body)
        return _result(success, message, **extra)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(body: control.InitWeightsUpdateGroup = Body()) -> JSONResponse:
        return _result(*await run_in_threadpool(update_groups.init, body))

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(body: control.DestroyWeightsUpdateGroup = Body()) -> JSONResponse:
        return _result(*await run_in_threadpool(update_groups.destroy, body.group_name))

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: control.UpdateWeightsFromDistributed = Body()) -> JSONResponse:
        if not (await run_in_threadpool(engine.status))["weight_update_session"]:
            return _result(False, OUTSIDE_SESSION)
        return _result(*await run_in_threadpool(update_groups.receive_bucket, body))

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(body: control.MemoryOccupation = Body()) -> Response:
        try:
            await run_in_threadpool(lambda: engine.release_memory_occupation(
                body.tags, free_weights=state.startup_args["enable_memory_saver"]))
        except MemoryOccupationError as exc:
            return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
        return JSONResponse(None)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(body: control.MemoryOccupation = Body()) -> Response:
        try:
            await run_in_threadpool(engine.resume_memory_occupation, body.tags)
        except MemoryOccupationError as exc:
            return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
        return JSONResponse(None)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(body: control.UpdateWeightsFromTensor = Body()) -> JSONResponse:
        in_session = (await run_in_threadpool(engine.status))["weight_update_session"]
        return _result(False, DISTRIBUTED_UNSUPPORTED if in_session else
                       OUTSIDE_SESSION.replace("distributed", "tensor"))

    return app


def _unsupported_disk_options(body: control.UpdateWeightsFromDisk) -> str | None:
    """Options of SGLang's disk update the embedded engine cannot honour, refused rather than ignored."""
    if body.load_format not in (None, "auto", "safetensors"):
        return (f"load_format {body.load_format!r} is not supported; the embedded engine reads safetensors "
                "directories (load_format auto or safetensors)")
    if body.is_async:
        return "is_async: the embedded engine loads synchronously; send is_async false"
    if body.manifest is not None:
        return "manifest: the embedded engine loads whole directories; send no manifest"
    return None


# ---------------------------------------------------------------------------------------------- running
def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket; port 0 picks a free one (read it back from getsockname)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted sockets (Linux)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def _uvicorn(app: FastAPI) -> uvicorn.Server:
    return uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))


class RolloutServer:
    """Serve an engine from a background thread on host:port (0 = a free port); stop() ends both."""

    def __init__(self, engine: RolloutEngine, *, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, enable_memory_saver: bool = False) -> None:
        self.engine = engine
        self._sock = bind_socket(host, port)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._server = _uvicorn(create_app(engine, api_key=api_key, server_args={
            "host": host, "port": self.port, "enable_memory_saver": enable_memory_saver}))
        self._thread = threading.Thread(target=lambda: asyncio.run(self._server.serve(sockets=[self._sock])),
                                        name="rollout-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "RolloutServer":
        self._thread.start()
        for _ in range(int(timeout / 0.02)):
            if self._server.started or not self._thread.is_alive():
                break
            time.sleep(0.02)
        if not self._server.started:
            raise RuntimeError(f"rollout HTTP server did not start on {self.url} within {timeout}s")
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self.engine.shutdown()  # pending /generate calls answer 503 at once, so uvicorn can close
        self._thread.join(30)
        self._sock.close()

    def __enter__(self) -> "RolloutServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(model_dir: str | Path, *, host: str = "127.0.0.1", port: int = 30000, api_key: str | None = None,
          engine: RolloutEngine | None = None, on_ready: Callable[[str], None] | None = None,
          enable_memory_saver: bool = False, on_refusal: Callable[[str], None] | None = None) -> None:
    """Blocking: load the engine, serve until SIGINT/SIGTERM, then stop the engine."""
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        log.warning("serving on %s without an API key: anyone who can reach the port can update the weights", host)
    engine = engine or RolloutEngine(model_dir)
    sock = bind_socket(host, port)
    url = f"http://{host}:{sock.getsockname()[1]}"
    server = _uvicorn(create_app(engine, api_key=api_key, server_args={
        "host": host, "port": sock.getsockname()[1], "enable_memory_saver": enable_memory_saver},
        on_refusal=on_refusal))
    if on_ready is not None:
        threading.Thread(target=_notify_when_started, args=(server, url, on_ready), daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        engine.shutdown()


def _notify_when_started(server: uvicorn.Server, url: str, on_ready: Callable[[str], None]) -> None:
    while not server.started and not server.should_exit:
        time.sleep(0.05)
    if server.started:
        on_ready(url)
