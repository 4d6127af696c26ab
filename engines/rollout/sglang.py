"""One client for both rollout servers: the embedded engine (`v4rl serve-rollout`) and real SGLang.

Rules every call follows:
  - a timeout on every call (control calls `timeout`, /generate `generate_timeout`, weight updates
    `update_timeout`; each call can override); a timeout raises `SGLangTimeout` naming the endpoint;
  - retries (capped exponential backoff with jitter) only when the connection could not be made, so
    a request is never sent twice: a /generate or weight update that timed out is not retried;
  - 4xx/5xx raise `SGLangHTTPError` carrying the status and the server's body (SGLang puts the reason
    there: `{"success": false, "message": ...}` or `{"error": {"message": ...}}`).

    with SGLangClient("http://127.0.0.1:30000") as client:
        client.wait_until_healthy(timeout=60)
        [out] = client.generate_ids([[0, 5, 9]], {"max_new_tokens": 16, "sampling_seed": 1})
        out.output_ids, out.output_logprobs, out.finish_type
        client.pause_generation("retract"); client.update_weights_from_disk("export/step_10", weight_version="10")
        client.continue_generation()
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_GENERATE_TIMEOUT_S = 600.0
DEFAULT_UPDATE_TIMEOUT_S = 600.0


class SGLangError(RuntimeError):
    """Base of every client failure."""


class SGLangConnectionError(SGLangError):
    """The server could not be reached after all retries."""


class SGLangTimeout(SGLangError):
    """The server accepted the connection but did not answer in time (the call may have taken effect)."""


class SGLangHTTPError(SGLangError):
    """The server answered 4xx/5xx; `status` and `body` are what it sent."""

    def __init__(self, method: str, url: str, status: int, body: Any) -> None:
        self.method, self.url, self.status, self.body = method, url, status, body
        super().__init__(f"{method} {url} -> HTTP {status}: {_reason(body)}")


def _reason(body: Any) -> str:
    if isinstance(body, dict):
        if isinstance(body.get("error"), dict) and body["error"].get("message"):
            return str(body["error"]["message"])
        for key in ("message", "error", "detail"):
            if body.get(key):
                return str(body[key])
    text = body if isinstance(body, str) else repr(body)
    return text.strip()[:2000] or "(empty body)"


@dataclass
class GenerateOutput:
    """One /generate item, parsed (the raw item stays in `raw`)."""

    rid: str
    text: str
    output_ids: list[int]
    output_logprobs: list[float]
    input_logprobs: list[float | None]
    finish_reason: dict[str, Any]
    weight_version: str | None
    raw: dict[str, Any]
    routed_experts: str | None = None
    """meta_info.routed_experts as SGLang sends it (base64 of int32 (prompt + output - 1, layers, top_k)), when the
    request asked for it and the server has --enable-return-routed-experts; else None."""

    @property
    def finish_type(self) -> str:
        """'stop' | 'length' | 'abort' (Miles: COMPLETED | TRUNCATED | ABORTED)."""
        return str((self.finish_reason or {}).get("type"))

    @classmethod
    def from_item(cls, item: Mapping[str, Any]) -> "GenerateOutput":
        meta = item.get("meta_info") or {}
        out_lp = meta.get("output_token_logprobs") or []
        output_ids = list(item.get("output_ids") or [x[1] for x in out_lp])
        return cls(rid=str(meta.get("id")), text=item.get("text", ""), output_ids=output_ids,
                   output_logprobs=[x[0] for x in out_lp],
                   input_logprobs=[x[0] for x in meta.get("input_token_logprobs") or []],
                   finish_reason=meta.get("finish_reason") or {}, weight_version=meta.get("weight_version"),
                   raw=dict(item), routed_experts=meta.get("routed_experts"))


class SGLangClient:
    """SGLang native-API client (see module docstring for the timeout/retry/error rules)."""

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT_S,
                 generate_timeout: float = DEFAULT_GENERATE_TIMEOUT_S,
                 update_timeout: float = DEFAULT_UPDATE_TIMEOUT_S, connect_retries: int = 3,
                 backoff_s: float = 0.5, max_backoff_s: float = 8.0, transport: httpx.BaseTransport | None = None
                 ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout, self.generate_timeout, self.update_timeout = timeout, generate_timeout, update_timeout
        self.connect_retries, self.backoff_s, self.max_backoff_s = connect_retries, backoff_s, max_backoff_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._transport = transport
        self._http = httpx.Client(base_url=self.base_url, headers=headers, transport=transport, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "SGLangClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ transport
    def request(self, method: str, path: str, *, json: Any = None, timeout: float | None = None) -> Any:
        """One call: JSON (or text) body on 2xx; raises SGLangHTTPError / SGLangTimeout / SGLangConnectionError."""
        timeout = self.timeout if timeout is None else timeout
        url = f"{self.base_url}{path}"
        for attempt in range(self.connect_retries + 1):
            try:
                resp = self._http.request(method, path, json=json, timeout=timeout)
                break
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                if attempt == self.connect_retries:
                    raise SGLangConnectionError(f"{method} {url}: cannot connect after {attempt + 1} attempts "
                                                f"({exc}); is the server running and reachable?") from exc
                delay = min(self.max_backoff_s, self.backoff_s * 2**attempt)
                time.sleep(delay * (0.5 + random.random() / 2))
            except httpx.TimeoutException as exc:
                raise SGLangTimeout(f"{method} {url}: no answer within {timeout}s ({type(exc).__name__}); the "
                                    "server may still be working on it, so it was not retried") from exc
            except httpx.HTTPError as exc:
                raise SGLangError(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
        body = _decode(resp)
        if resp.status_code >= 400:
            raise SGLangHTTPError(method, url, resp.status_code, body)
        return body

    def _post(self, path: str, json: Any = None, *, timeout: float | None = None) -> Any:
        return self.request("POST", path, json={} if json is None else json, timeout=timeout)

    # ------------------------------------------------------------------ generation
    def generate(self, payload: Mapping[str, Any], *, timeout: float | None = None) -> Any:
        """POST /generate with a GenerateReqInput body; returns the raw JSON (dict, or list for a batch)."""
        return self._post("/generate", dict(payload), timeout=self.generate_timeout if timeout is None else timeout)

    def generate_ids(self, prompts: Sequence[Sequence[int]], sampling_params: Mapping[str, Any] | None = None, *,
                     return_logprob: bool = True, logprob_start_len: int = -1, rids: Sequence[str] | None = None,
                     return_routed_experts: bool = False, timeout: float | None = None) -> list[GenerateOutput]:
        """Batched token-in/token-out generation: one GenerateOutput per prompt (x n when sampling_params.n)."""
        payload: dict[str, Any] = {"input_ids": [list(p) for p in prompts], "sampling_params": dict(sampling_params or {}),
                                   "return_logprob": return_logprob, "logprob_start_len": logprob_start_len}
        if return_routed_experts:
            payload["return_routed_experts"] = True
        if rids is not None:
            payload["rid"] = list(rids)
        body = self.generate(payload, timeout=timeout)
        return [GenerateOutput.from_item(item) for item in (body if isinstance(body, list) else [body])]

    def score(self, sequences: Sequence[Sequence[int]], *, start: int = 0, timeout: float | None = None
              ) -> list[list[float | None]]:
        """Prompt scoring (max_new_tokens=0): per sequence, logprobs of positions start.. (first entry None)."""
        outs = self.generate_ids(sequences, {"max_new_tokens": 0}, logprob_start_len=start, timeout=timeout)
        return [o.input_logprobs for o in outs]

    def abort_request(self, rid: str = "", *, abort_all: bool = False) -> None:
        self._post("/abort_request", {"rid": rid, "abort_all": abort_all})

    # ------------------------------------------------------------------ health and info
    def health(self) -> bool:
        try:
            self.request("GET", "/health")
            return True
        except SGLangError:
            return False

    def health_generate(self, *, timeout: float = 30.0) -> bool:
        try:
            self.request("GET", "/health_generate", timeout=timeout)
            return True
        except SGLangError:
            return False

    def wait_until_healthy(self, timeout: float = 600.0, poll_s: float = 0.5) -> None:
        """Poll /health until 200; raises SGLangTimeout after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self._http.get("/health", timeout=min(5.0, self.timeout)).raise_for_status()
                return
            except httpx.HTTPError:
                time.sleep(poll_s)
        raise SGLangTimeout(f"{self.base_url}/health did not answer 200 within {timeout}s")

    def requires_api_key(self) -> bool:
        """Whether the server refuses GET /model_info without our Authorization header (401/403): SGLang's and our
        server's answer when started with --api-key; 2xx means anyone who reaches the port may call it."""
        with SGLangClient(self.base_url, timeout=self.timeout, connect_retries=self.connect_retries,
                          backoff_s=self.backoff_s, max_backoff_s=self.max_backoff_s,
                          transport=self._transport) as anonymous:
            try:
                anonymous.model_info()
            except SGLangHTTPError as exc:
                if exc.status in (401, 403):
                    return True
                raise
        return False

    def model_info(self) -> dict[str, Any]:
        return self.request("GET", "/model_info")

    def server_info(self) -> dict[str, Any]:
        return self.request("GET", "/server_info")

    def weight_version(self) -> str | None:
        return self.model_info().get("weight_version")

    # ------------------------------------------------------------------ pause / cache
    def pause_generation(self, mode: str = "abort") -> Any:
        """mode: abort | retract | in_place (SGLang semantics)."""
        return self._post("/pause_generation", {"mode": mode})

    def continue_generation(self) -> Any:
        return self._post("/continue_generation")

    def flush_cache(self, *, wait_s: float = 0.0) -> None:
        """Drop the prefix cache; with `wait_s` the server first waits up to that long for running requests to
        finish (SGLang's `?timeout=`). Raises SGLangHTTPError(400) while requests still hold KV."""
        path = f"/flush_cache?timeout={float(wait_s)}" if wait_s else "/flush_cache"
        self._post(path, timeout=self.timeout + wait_s)

    # ------------------------------------------------------------------ weights
    def update_weights_from_disk(self, model_path: str, *, weight_version: str | None = None,
                                 abort_all_requests: bool = False, keep_pause: bool = False, flush_cache: bool = True,
                                 timeout: float | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"model_path": str(model_path), "abort_all_requests": abort_all_requests,
                                "keep_pause": keep_pause, "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return self._post("/update_weights_from_disk", body, timeout=self._update_timeout(timeout))

    def begin_weight_update(self, *, timeout: float | None = None) -> dict[str, Any]:
        return self._post("/begin_weight_update", timeout=self._update_timeout(timeout))

    def end_weight_update(self, *, timeout: float | None = None) -> dict[str, Any]:
        return self._post("/end_weight_update", timeout=self._update_timeout(timeout))

    def update_weight_version(self, new_version: str, *, abort_all_requests: bool = True) -> dict[str, Any]:
        return self._post("/update_weight_version", {"new_version": str(new_version),
                                                     "abort_all_requests": abort_all_requests})

    def weights_checksums(self, *, timeout: float | None = None) -> dict[str, str]:
        """POST /weights_checker {"action": "checksum"}: tensor name -> sha256 (rank 0)."""
        body = self._post("/weights_checker", {"action": "checksum"}, timeout=self._update_timeout(timeout))
        ranks = body.get("ranks") or []
        if not ranks or "checksums" not in ranks[0]:
            raise SGLangError(f"{self.base_url}/weights_checker answered without per-tensor checksums: {body!r:.300}")
        return dict(ranks[0]["checksums"])

    def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl",
                                  timeout: float | None = None) -> dict[str, Any]:
        return self._post("/init_weights_update_group", {
            "master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend},
            timeout=self._update_timeout(timeout))

    def update_weights_from_distributed(self, *, names: Sequence[str], dtypes: Sequence[str],
                                        shapes: Sequence[Sequence[int]], group_name: str = "weight_update_group",
                                        flush_cache: bool = True, weight_version: str | None = None,
                                        load_format: str | None = None, timeout: float | None = None
                                        ) -> dict[str, Any]:
        """Announce one broadcast bucket; the caller broadcasts the tensors (src rank 0) concurrently."""
        body: dict[str, Any] = {"names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
                                "group_name": group_name, "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        if load_format is not None:
            body["load_format"] = load_format
        return self._post("/update_weights_from_distributed", body, timeout=self._update_timeout(timeout))

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict[str, Any]:
        return self._post("/destroy_weights_update_group", {"group_name": group_name})

    def _update_timeout(self, timeout: float | None) -> float:
        return self.update_timeout if timeout is None else timeout


def _decode(resp: httpx.Response) -> Any:
    if not resp.content:
        return None
    try:
        return resp.json()
    except ValueError:
        return resp.text
