"""Runs INSIDE the SGLang worker subprocess (sglang_worker.py): SGLang 0.5.23's own code, driven for the suite.

Nothing here is SGLang's code; it imports SGLang's modules and calls them:
  start_app          SGLang's real FastAPI app (`sglang.srt.entrypoints.http_server.app`, its routes, request
                     structs, contract gate and API-key middleware) on 127.0.0.1, with only the TokenizerManager
                     faked: the fake runs SGLang's own request normalisation and SamplingParams checks on what
                     arrives, records it, and answers with a well-formed result (no model is loaded, so SGLang's
                     config resolution is given a one-layer Llama config; DeepSeek-V4 loading is part (e))
  decode             SGLang's generated schema (`sglang/api/v1/api_types.py`) on a JSON value
  server_args        `prepare_server_args` on a launch argv, and the fields it produced
  surface            the API surface v4rl depends on (routes, body structs, sampling fields, ServerArgs names)
  run_program        an `sgl.function` program (gen, select) through `RuntimeEndpoint`
  send_one / kl_check  `sglang.test.send_one.send_one_prompt`, `sglang.test.kl_test_utils` helpers
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import os
import socket
import threading
import time
import uuid
from contextlib import redirect_stdout
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec

import sglang
from sglang.srt.entrypoints import http_server
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.runtime_context import get_context, publish
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs, prepare_server_args

VOCAB = 128
RECORDS: list[dict[str, Any]] = []
_APP: dict[str, Any] = {}


def _plain(obj: Any) -> Any:
    """A request struct (msgspec Struct or dataclass) as JSON-ready data."""
    if isinstance(obj, msgspec.Struct):  # by field name: SGLang's request structs are array_like on the wire
        return {name: _plain(value) for name, value in msgspec.structs.asdict(obj).items()}
    if dataclasses.is_dataclass(obj):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, set):
        return sorted(obj)
    return obj if isinstance(obj, (str, int, float, bool, type(None))) else repr(obj)


def _set_fields(obj: Any) -> dict[str, Any]:
    """The fields of a request dataclass that differ from their defaults (what the client set)."""
    out = {}
    for f in dataclasses.fields(obj):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
        value = getattr(obj, f.name)
        if value != default:
            out[f.name] = _plain(value)
    return out


# ---------------------------------------------------------------------------------------- the fake manager
class _CharTokenizer:
    """Stands in for the model's tokenizer where SamplingParams.normalize needs one (stop strings, min_new_tokens)."""

    eos_token_id = 1

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % VOCAB for c in text]


class FakeTokenizerManager:
    """The one faked piece: what the routes call on SGLang's TokenizerManager, recorded."""

    is_generation = True
    gracefully_exit = False
    is_pause = False

    def __init__(self, model_path: str) -> None:
        from sglang.srt.managers.tokenizer_manager import ServerStatus

        self.server_status = ServerStatus.Up
        self.model_path = self.served_model_name = model_path
        self.model_config = SimpleNamespace(is_image_understandable_model=False, is_audio_understandable_model=False,
                                            hf_config=SimpleNamespace(model_type="llama",
                                                                      architectures=["LlamaForCausalLM"]),
                                            embedding_model_spec=None)
        self.server_args = _APP["server_args"]
        self.startup_time = {"load_weight": 0.0}
        self.last_receive_tstamp = 0.0
        self.rid_to_state: dict[str, Any] = {}
        self.weight_version = "default"

    def _record(self, route: str, obj: Any = None, **extra: Any) -> None:
        RECORDS.append({"route": route, "obj": _plain(obj), **extra})

    def config_value(self, name: str) -> Any:
        if name in ("model_path", "served_model_name"):
            return getattr(self, name)
        if name == "weight_version":
            return self.weight_version
        return get_context().config_leaf(name)

    def is_ready(self) -> bool:
        return True

    def is_healthy(self) -> bool:
        return True

    async def generate_request(self, obj, request=None):
        raw = _set_fields(obj)
        obj.normalize_batch_and_arguments()  # SGLang's own normalisation: raises ValueError as SGLang would
        items = [obj] if obj.is_single else [obj[i] for i in range(obj.batch_size)]
        n = getattr(obj, "parallel_sample_num", 1)
        for item in items:  # SGLang's SamplingParams, built and verified as the tokenizer manager does
            params = SamplingParams(**(item.sampling_params or {}))
            params.verify(VOCAB)
            params.normalize(_CharTokenizer())
        health = str(raw.get("rid") or "").startswith("HEALTH_CHECK")
        self._record("generate", raw, normalized={
            "is_single": obj.is_single, "batch_size": obj.batch_size, "parallel_sample_num": n,
            "rid": _plain(obj.rid), "sampling_params": _plain(obj.sampling_params),
            "return_logprob": _plain(obj.return_logprob), "logprob_start_len": _plain(obj.logprob_start_len),
            "top_logprobs_num": _plain(obj.top_logprobs_num)}, health=health)
        self.last_receive_tstamp = time.time()
        answers = [self._answer(item) for item in items for _ in range(n)]
        yield answers[0] if obj.is_single else answers

    def _answer(self, item) -> dict[str, Any]:
        prompt = item.input_ids or [0]
        max_new = (item.sampling_params or {}).get("max_new_tokens", 128)
        out = [] if max_new == 0 else [7]
        meta = {"id": item.rid if isinstance(item.rid, str) else uuid.uuid4().hex,
                "finish_reason": {"type": "length", "length": len(out)}, "prompt_tokens": len(prompt),
                "completion_tokens": len(out), "cached_tokens": 0, "reasoning_tokens": 0,
                "weight_version": self.weight_version, "num_retractions": 0, "e2e_latency": 0.01}
        if item.return_logprob:
            start = item.logprob_start_len if item.logprob_start_len >= 0 else len(prompt)
            meta["input_token_logprobs"] = [[None if k == start else -1.0, t, None]
                                            for k, t in enumerate(prompt) if k >= start]
            meta["output_token_logprobs"] = [[-0.5, t, None] for t in out]
        return {"text": "", "output_ids": out, "meta_info": meta}

    async def get_internal_state(self):
        return [{"fake": True}]

    def abort_request(self, rid: str = "", abort_all: bool = False):
        self._record("abort_request", None, rid=rid, abort_all=abort_all)

    def create_abort_task(self, obj):
        return None

    async def flush_cache(self, timeout_s=None):
        self._record("flush_cache", None, timeout_s=timeout_s)
        return SimpleNamespace(success=True, message="")

    async def pause_generation(self, obj):
        self._record("pause_generation", obj)

    async def continue_generation(self, obj):
        self._record("continue_generation", obj)

    async def update_weights_from_disk(self, obj, request=None):
        self._record("update_weights_from_disk", obj)
        return True, "Succeeded to update model weights.", 0

    async def begin_weight_update(self, obj, request=None):
        self._record("begin_weight_update", obj)
        return True, "Success"

    async def end_weight_update(self, obj, request=None):
        self._record("end_weight_update", obj)
        return True, "Success"

    async def update_weight_version(self, obj):
        self._record("update_weight_version", obj)
        self.weight_version = obj.new_version

    async def check_weights(self, obj, request=None):
        self._record("weights_checker", obj)
        info = {"checksums": {"model.embed_tokens.weight": "0" * 16}, "per_gpu_checksum": "1" * 64,
                "parallelism_info": [{"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1,
                                      "pp_rank": 0, "pp_size": 1, "rank": 0, "size": 1}]}
        return True, "Success", [info], "2" * 64

    async def init_weights_update_group(self, obj, request=None):
        self._record("init_weights_update_group", obj)
        return True, "Succeeded to initialize the group."

    async def update_weights_from_distributed(self, obj, request=None):
        self._record("update_weights_from_distributed", obj)
        return True, "Succeeded to update parameter online."

    async def destroy_weights_update_group(self, obj, request=None):
        self._record("destroy_weights_update_group", obj)
        return True, "Succeeded to destroy the group."


# ------------------------------------------------------------------------------------------------ the app
def _llama_dir(root: Path) -> Path:
    from transformers import LlamaConfig

    path = root / "fake-model"
    LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, max_position_embeddings=256,
                architectures=["LlamaForCausalLM"]).save_pretrained(path)
    return path


def start_app(workdir: str, api_key: str) -> dict[str, Any]:
    """SGLang's app with the fake manager on 127.0.0.1 (one per process: the app is a module global)."""
    import uvicorn

    from sglang.srt.utils.auth import add_api_key_middleware

    if "url" in _APP:
        return {"url": _APP["url"]}
    model = _llama_dir(Path(workdir))
    args = ServerArgs(model_path=str(model), device="cpu", api_key=api_key)
    publish(args, role="tokenizer")
    _APP["server_args"] = args
    manager = FakeTokenizerManager(str(model))
    http_server.set_global_state(http_server._GlobalState(
        tokenizer_manager=manager, template_manager=None,
        scheduler_info={"status": "ready", "max_total_num_tokens": 4096, "max_req_input_len": 255}))
    add_api_key_middleware(http_server.app, api_key=api_key, admin_api_key=None)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(http_server.app, log_level="warning", lifespan="off"))
    threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True).start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("SGLang's app did not start within 60 s")
        time.sleep(0.05)
    _APP["url"] = f"http://127.0.0.1:{sock.getsockname()[1]}"
    return {"url": _APP["url"]}


def records(clear: bool = True) -> list[dict[str, Any]]:
    out = list(RECORDS)
    if clear:
        RECORDS.clear()
    return out


# --------------------------------------------------------------------------------------------- the schema
def decode(kind: str, values: list[Any]) -> list[dict[str, Any]]:
    """Decode each value with api_types' `kind`; per value the decoder's error, or the re-encoded value."""
    from sglang.api.v1 import api_types

    cls = getattr(api_types, kind)
    out = []
    for value in values:
        try:
            decoded = cls.from_json_value(value)
        except api_types.JsonContractError as exc:
            out.append({"error": str(exc)})
            continue
        meta = getattr(decoded, "meta_info", None)  # which FinishReason variant it became (a dict: none fit)
        finish = type(meta.finish_reason).__name__ if meta is not None else None
        out.append({"encoded": decoded.to_json_value(), "finish": finish})
    return out


def contract_error(body: Any) -> str | None:
    """What SGLang's /generate contract gate says about a request body (None: admitted)."""
    from sglang.srt.entrypoints.api_contract import generate_contract_error

    return generate_contract_error(body)


# ------------------------------------------------------------------------------------------ server args
def server_args(argv: list[str]) -> dict[str, Any]:
    """prepare_server_args on a launch argv (the flags after `-m sglang.launch_server`); the fields it set."""
    parsed = prepare_server_args(argv)
    return {f.name: _plain(getattr(parsed, f.name)) for f in msgspec.structs.fields(ServerArgs)}


def environ_names() -> list[str]:
    """Every environment variable SGLang's `environ.envs` declares."""
    from sglang.srt.environ import envs

    return sorted(n for n in dir(type(envs)) if n.isupper())


# -------------------------------------------------------------------------------------------- the surface
def surface() -> dict[str, Any]:
    """What v4rl depends on, as this SGLang declares it: routes (methods, whether a body is required, its
    fields), GenerateReqInput fields, the contract's SamplingParams fields, ServerArgs field names."""
    from sglang.api.v1.api_types import _FIELDS_SamplingParams

    routes: dict[str, Any] = {}
    for route in http_server.app.routes:
        path, methods = getattr(route, "path", None), sorted(getattr(route, "methods", None) or ())
        if not path or not methods:
            continue
        entry = routes.setdefault(path, {"methods": [], "body_required": False, "body_fields": []})
        entry["methods"] = sorted(set(entry["methods"]) | set(methods))
        body = getattr(route, "body_field", None)
        if body is not None:
            entry["body_required"] = bool(body.field_info.is_required())
            ann = getattr(body.field_info, "annotation", None)
            ann = next((a for a in getattr(ann, "__args__", ()) if a is not type(None)), ann)  # Optional[X] -> X
            fields = getattr(ann, "__struct_fields__", None) or getattr(ann, "model_fields", None)
            if fields is None and dataclasses.is_dataclass(ann):
                fields = [f.name for f in dataclasses.fields(ann)]
            entry["body_fields"] = sorted(fields or [])
    return {"version": sglang.__version__, "routes": routes,
            "generate_fields": sorted(f.name for f in dataclasses.fields(GenerateReqInput)),
            "sampling_fields": list(_FIELDS_SamplingParams),
            "server_args_fields": sorted(f.name for f in msgspec.structs.fields(ServerArgs))}


# ---------------------------------------------------------------------------------------- SGLang's clients
def run_program(url: str, prompt: str, choices: list[str]) -> dict[str, Any]:
    """An sgl.function with gen and select, through RuntimeEndpoint against `url`."""
    backend = sglang.RuntimeEndpoint(url)
    sglang.set_default_backend(backend)

    @sglang.function
    def solve(s, question):
        s += question
        s += sglang.gen("answer", max_tokens=6, temperature=0)
        s += " Sure?"
        s += sglang.select("verdict", choices=choices, temperature=0)

    state = solve.run(question=prompt)
    error = state.error()
    return {"answer": state["answer"], "verdict": state["verdict"], "error": None if error is None else repr(error),
            "meta": state.get_meta_info("answer"), "model_path": backend.get_model_name()}


def send_one(url: str, prompt: str, stream: bool = False) -> dict[str, Any]:
    from sglang.test.send_one import BenchArgs, send_one_prompt

    printed = io.StringIO()
    with redirect_stdout(printed):
        acc_length, speed = send_one_prompt(BenchArgs(base_url=url, prompt=prompt, max_new_tokens=8, temperature=0.0,
                                                      return_logprob=True, seed=1, stream=stream))
    return {"acc_length": acc_length, "speed": speed, "printed": printed.getvalue()}


def kl_check(url: str, cache_home: str, prompts: list[list[int]], model_name: str, kl_bound: float,
             max_new_tokens: int) -> dict[str, Any]:
    """SGLang's logprob checks: decode logprobs vs. prefill rescoring of the same tokens, plain and with the
    prompts prefilled first (prefix-cache hit). The prompts go into the helper's own dataset cache file."""
    os.environ["XDG_CACHE_HOME"] = cache_home
    from sglang.test import kl_test_utils as kl

    kl.CACHE_DIR = os.path.join(cache_home, "sglang", "longbench")  # read at import; the file it looks for:
    os.makedirs(kl.CACHE_DIR, exist_ok=True)
    name = os.path.join(kl.CACHE_DIR,
                        f"input_ids_{model_name}_{kl.DEFAULT_PROMPT_TOKENS}_{kl.DEFAULT_NUM_SAMPLES}.json")
    with open(name, "w") as f:
        json.dump((prompts * kl.DEFAULT_NUM_SAMPLES)[:kl.DEFAULT_NUM_SAMPLES], f)
    thresholds = {model_name: {"kl_div": kl_bound}}
    printed = io.StringIO()
    with redirect_stdout(printed):
        kl.test_input_output_logprobs_match_helper(url, thresholds, model_name, max_samples=len(prompts),
                                                   max_new_tokens=max_new_tokens)
        kl.test_input_output_logprobs_match_prefill_cache_hit_helper(url, thresholds, model_name,
                                                                     max_samples=len(prompts),
                                                                     max_new_tokens=max_new_tokens)
    return {"printed": printed.getvalue()}
