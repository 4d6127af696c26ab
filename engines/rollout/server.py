"""SGLang-compatible HTTP server over the embedded rollout engine (sglang 0.5.23 native API).

Routes (reference/miles-sglang-megatron.md §2; bodies and responses as SGLang's http_server):
  POST /generate                    text | input_ids (single or batch), sampling_params, return_logprob, ...
  GET  /health, /health_generate    200 when the scheduler is alive / can generate one token (200 while paused)
  GET  /model_info, /server_info    (also /get_model_info, /get_server_info, /get_weight_version)
  POST /pause_generation            {"mode": "abort" | "retract" | "in_place"}
  POST /continue_generation, /abort_request {"rid", "abort_all"}, GET|POST /flush_cache
  POST /update_weights_from_disk    {"model_path", "weight_version", "abort_all_requests", "keep_pause"}; the
                                    prefix cache is always flushed (its KV belongs to the old weights)
  POST /begin_weight_update, /end_weight_update, /update_weight_version {"new_version", "abort_all_requests"}
  POST /weights_checker             {"action": "checksum"} -> per-tensor sha256 of the runtime copies
  /init_weights_update_group and /update_weights_from_distributed answer 400: NCCL/RCCL sync needs GPUs.
Weight endpoints answer `{"success", "message"}`, HTTP 400 on failure. With an API key, every route but
/health* needs `Authorization: Bearer <key>` (SGLang's rule); 401 `{"error": "Unauthorized"}` otherwise.

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
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from engines.rollout.engine import PAUSE_MODES, EngineStopped, RequestSpec, RolloutEngine
from engines.rollout.protocol import RequestError, build_response, parse_generate
from engines.rollout.sampling import SamplingParams

log = logging.getLogger("v4rl.rollout")
SGLANG_API_VERSION = "0.5.23"
HEALTH_GENERATE_TIMEOUT_S = 20.0
DISTRIBUTED_UNSUPPORTED = ("the embedded v4rl engine has no NCCL/RCCL weight sync; on GPU clusters use real SGLang "
                           "(engines/rollout/sglang.py), here use /update_weights_from_disk")


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def _result(success: bool, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"success": success, "message": message, **extra}, status_code=200 if success else 400)


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = await request.json()
    except ValueError as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    return body


def create_app(engine: RolloutEngine, *, api_key: str | None = None,
               server_args: dict[str, Any] | None = None) -> FastAPI:
    """The FastAPI app serving `engine` with SGLang's native routes."""
    app = FastAPI(title="v4rl rollout (SGLang-compatible)", openapi_url=None)
    args = {"model_path": str(engine.model_dir), "tokenizer_path": str(engine.model_dir),
            "dtype": engine.config.dtype, "max_running_requests": engine.config.max_running_requests,
            "context_length": engine.context_length, "rocm_fnuz": engine.config.rocm_fnuz, **(server_args or {})}

    if api_key:
        @app.middleware("http")
        async def authenticate(request: Request, call_next):
            path = request.url.path
            if request.method == "OPTIONS" or path.startswith("/health") or path.startswith("/metrics"):
                return await call_next(request)
            if request.headers.get("Authorization") != f"Bearer {api_key}":
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
            return await call_next(request)

    @app.exception_handler(RequestError)
    async def bad_request(_: Request, exc: RequestError) -> JSONResponse:
        return _error(str(exc))

    @app.exception_handler(EngineStopped)
    async def stopped(_: Request, exc: EngineStopped) -> JSONResponse:
        return _error(str(exc), 503)

    # ------------------------------------------------------------------ health and info
    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.alive else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if not engine.alive:
            return Response(status_code=503)
        state = await run_in_threadpool(engine.status)
        if state["paused"] or state["weight_update_session"]:
            return Response(status_code=200)  # cannot generate by design right now; the scheduler answered
        if state["num_running_reqs"]:  # busy: healthy if tokens keep coming (SGLang skips the probe then too)
            deadline = time.monotonic() + HEALTH_GENERATE_TIMEOUT_S
            while time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                now = await run_in_threadpool(engine.status)
                if now["generated_tokens"] > state["generated_tokens"] or not now["num_running_reqs"]:
                    return Response(status_code=200)
            return Response(status_code=503)
        bos = engine.cfg.bos_token_id or 0
        spec = RequestSpec(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", input_ids=[bos], seed=0,
                           sampling=SamplingParams(temperature=0.0, max_new_tokens=1))
        try:
            await asyncio.wait_for(asyncio.wrap_future(engine.submit([spec])[0]), HEALTH_GENERATE_TIMEOUT_S)
        except (asyncio.TimeoutError, RuntimeError):
            await run_in_threadpool(engine.abort, spec.rid)
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": args["model_path"], "tokenizer_path": args["tokenizer_path"], "is_generation": True,
                "preferred_sampling_params": None, "weight_version": engine.weight_version,
                "model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"]}

    @app.get("/get_weight_version")
    async def weight_version() -> dict[str, Any]:
        return {"weight_version": engine.weight_version}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        state = await run_in_threadpool(engine.status)
        return {**args, "weight_version": engine.weight_version, "internal_states": [state],
                "version": SGLANG_API_VERSION, "backend": "v4rl-embedded"}

    # ------------------------------------------------------------------ generation
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Any:
        body = await _body(request)
        specs, batched, text_options = parse_generate(body, engine.tokenizer)
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
        except EngineStopped:
            raise
        except RuntimeError as exc:
            return _error(str(exc), 500)
        return build_response(outputs, batched, text_options, engine.tokenizer)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await _body(request)
        await run_in_threadpool(engine.abort, body.get("rid") or None, abort_all=bool(body.get("abort_all")))
        return Response(status_code=200)

    # ------------------------------------------------------------------ pause / cache
    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> JSONResponse:
        mode = (await _body(request)).get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise RequestError(f"mode must be one of {PAUSE_MODES}; got {mode!r}")
        await run_in_threadpool(engine.pause, mode)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation() -> JSONResponse:
        await run_in_threadpool(engine.resume)
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        ok = await run_in_threadpool(engine.flush_cache)
        return Response("Cache flushed.\n" if ok else "Cache not flushed: requests holding KV are running or paused "
                        "in place; abort or retract them first.\n", status_code=200 if ok else 400)

    # ------------------------------------------------------------------ weights
    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        body = await _body(request)
        if not body.get("model_path"):
            raise RequestError("'model_path' is required: a directory written by `v4rl export --format hf-fp8`")
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise RequestError(f"load_format {body['load_format']!r} is not supported; the embedded engine reads "
                               "safetensors directories")
        version = body.get("weight_version")
        res = await run_in_threadpool(lambda: engine.update_weights_from_disk(
            body["model_path"], weight_version=None if version is None else str(version),
            abort_all_requests=bool(body.get("abort_all_requests", False)),
            keep_pause=bool(body.get("keep_pause", False))))
        message = res.message + (f" Weight version updated to {version}." if res.success and version else "")
        return _result(res.success, message, num_paused_requests=res.num_paused_requests)

    @app.post("/begin_weight_update")
    async def begin_weight_update() -> JSONResponse:
        res = await run_in_threadpool(engine.begin_weight_update)
        return _result(res.success, res.message)

    @app.post("/end_weight_update")
    async def end_weight_update() -> JSONResponse:
        res = await run_in_threadpool(engine.end_weight_update)
        return _result(res.success, res.message)

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> JSONResponse:
        body = await _body(request)
        if body.get("new_version") is None:
            raise RequestError("'new_version' is required")
        new = str(body["new_version"])
        await run_in_threadpool(lambda: engine.set_weight_version(
            new, abort_all_requests=bool(body.get("abort_all_requests", True))))
        return _result(True, f"Weight version updated to {new}", new_version=new)

    @app.post("/weights_checker")
    async def weights_checker(request: Request) -> JSONResponse:
        action = (await _body(request)).get("action", "checksum")
        if action != "checksum":
            return _result(False, f"action {action!r} is not supported by the embedded engine; use 'checksum'")
        sums = await run_in_threadpool(engine.checksums)
        return _result(True, f"Checksummed {len(sums)} runtime tensors.", ranks=[{"rank": 0, "checksums": sums}])

    for path in ("/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group",
                 "/update_weights_from_tensor"):
        app.add_api_route(path, lambda: _result(False, DISTRIBUTED_UNSUPPORTED), methods=["POST"])

    return app


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
                 api_key: str | None = None) -> None:
        self.engine = engine
        self._sock = bind_socket(host, port)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._server = _uvicorn(create_app(engine, api_key=api_key, server_args={"host": host, "port": self.port}))
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
          engine: RolloutEngine | None = None, on_ready: Callable[[str], None] | None = None) -> None:
    """Blocking: load the engine, serve until SIGINT/SIGTERM, then stop the engine."""
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        log.warning("serving on %s without an API key: anyone who can reach the port can update the weights", host)
    engine = engine or RolloutEngine(model_dir)
    sock = bind_socket(host, port)
    url = f"http://{host}:{sock.getsockname()[1]}"
    server = _uvicorn(create_app(engine, api_key=api_key, server_args={"host": host, "port": sock.getsockname()[1]}))
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
