"""SGLang's native `/generate` request and response, mapped onto the engine (sglang 0.5.23 semantics).

Request (`GenerateReqInput`, reference/miles-sglang-megatron.md §2.1): `text` or `input_ids`, single or
batched; `sampling_params` (one dict, or one per item); `return_logprob`, `logprob_start_len`,
`top_logprobs_num`, `return_text_in_logprobs`, `rid` (each scalar or one per item). `sampling_params.n`
expands every item into n samples, item-major. As in SGLang:
  - null sampling values mean "use the default" (null `max_new_tokens`: up to the context length), and an
    empty grammar (`regex`, `json_schema`, `ebnf`, `structural_tag`: ""), `stop_regex: []`, `logit_bias: {}`
    or `custom_params: {}` means "unset" (SGLang's own `RuntimeEndpoint` always sends `stop_regex: []`);
  - a string `rid` with a batch names its samples `rid_0`, `rid_1`, ...; per-item lists of
    `return_logprob` / `logprob_start_len` / `top_logprobs_num` are refused with n > 1, and every item
    must ask for the same n;
  - `logprob_start_len` -1 with `return_logprob` means "output tokens only" (`input_token_logprobs: []`),
    any value up to len(prompt) is allowed, and it is ignored without `return_logprob`;
  - an unknown sampling key is refused with SGLang's contract text, `{"error": "unknown field `x`, expected
    one of ..."}` (its generated decoder, `sglang/api/v1/api_types.py`); other refusals are
    `{"error": {"message": ...}}`, SGLang's shape for a ValueError.
  - `return_routed_experts` with `routed_experts_start_len` (0 .. len(prompt)) returns `meta_info.routed_experts`
    when the server runs with `--enable-return-routed-experts`; without it the request is served without the
    field, as SGLang does (its capturer does not exist then).
Features the embedded engine does not have (penalties, grammars, logit_bias, min_p, LoRA,
indexer top-k capture, beam search, ...) are refused when set to anything but "unset", never ignored.

Response per item: `{"text", "output_ids", "meta_info"}` with `meta_info` = `id`, `finish_reason`
(`{"type": "stop", "matched"}` | `{"type": "length", "length"}` | `{"type": "abort", "message", ...}`),
`prompt_tokens`, `completion_tokens`, `cached_tokens`, `reasoning_tokens` (0: no reasoning parser runs,
as in SGLang without `--reasoning-parser`), `weight_version` and `weight_versions` (which weights produced
which output tokens: `[{"version", "start", "end"}]`, more than one span when an update landed mid-request),
`num_retractions`, `e2e_latency`, and with `return_logprob`: `input_token_logprobs` /
`output_token_logprobs` as `[logprob, token_id, text_or_null]` lists (the first input entry's logprob is
null, as in SGLang), `output_token_logprobs_length`, and top-k lists when `top_logprobs_num > 0`; with routed
experts, `routed_experts`: base64 of int32 `(prompt + completion - 1 - start, num_layers, top_k)`, C order, in the
finished answer only (SGLang's detokenizer encoding). A single item gives a dict, a batch (or n > 1) a list.

Seeds: with `sampling_params.sampling_seed`, sample j of a prompt is seeded from (seed, j, the prompt's
tokens): the same seed and prompt give the same output alone or anywhere in a batch, and the prompts of
one batch do not share a random stream. Without a seed every sample draws a fresh random one.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import uuid
from typing import Any

from engines.rollout.engine import RequestOutput, RequestSpec
from engines.rollout.limits import ContextLengthError, check_request_length
from engines.rollout.sampling import SamplingParams

SAMPLING_FIELDS = ("max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
                   "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
                   "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
                   "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
                   "sampling_seed", "custom_params", "beam_width", "watermark", "choice")
"""SGLang 0.5.23's SamplingParams contract fields, in its schema's order (the unknown-field message lists them)."""
UNSUPPORTED_SAMPLING = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                        "json_schema": "", "regex": "", "ebnf": "", "structural_tag": "", "stop_regex": [],
                        "logit_bias": {}, "custom_params": {}, "beam_width": 1, "watermark": None, "choice": []}
"""SGLang sampling keys the embedded engine has no feature for, each with its "unset" value (null is unset too)."""
TOP_K_ALL = 1 << 30
"""SGLang's top_k for "the whole vocabulary" (its schema's default); -1 here."""
UNLIMITED_NEW_TOKENS = 1 << 30
"""A null max_new_tokens: generate until a stop or the context length (SGLang's reading)."""
UNSUPPORTED_REQUEST = ("lora_path", "input_embeds", "image_data", "video_data", "audio_data",
                       "return_indexer_topk", "return_entropy", "custom_logit_processor",
                       "token_ids_logprob", "return_hidden_states", "session_params", "return_sampling_mask")
"""Top-level GenerateReqInput fields refused when truthy (an empty list or dict counts as unset)."""
LOGPROB_OPTIONS = ("return_logprob", "logprob_start_len", "top_logprobs_num")


class RequestError(ValueError):
    """A malformed or unsupported /generate request (HTTP 400); the message says which field and why."""

    def body(self) -> dict[str, Any]:
        """The JSON body SGLang answers a ValueError from request normalisation with."""
        return {"error": {"message": str(self)}}


class ContractError(RequestError):
    """A body SGLang's schema gate refuses; its 400 body is `{"error": "<the schema's text>"}`."""

    def body(self) -> dict[str, Any]:
        return {"error": str(self)}


def unknown_field_message(key: str, fields: tuple[str, ...] = SAMPLING_FIELDS) -> str:
    """serde's unknown-field text, which SGLang's generated decoder reproduces word for word."""
    listed = ", ".join(f"`{f}`" for f in fields)
    return f"unknown field `{key}`, expected one of {listed}"


def parse_generate(body: Any, tokenizer=None, context_length: int | None = None
                   ) -> tuple[list[RequestSpec], bool, dict[str, Any]]:
    """GenerateReqInput JSON -> (one RequestSpec per sample, whether the answer is a list, response options).
    With `context_length`, every prompt passes SGLang's tokenizer-manager length gate (limits.py)."""
    if not isinstance(body, dict):
        raise RequestError("the /generate body must be a JSON object")
    for key in UNSUPPORTED_REQUEST:
        if body.get(key):
            raise RequestError(f"{key!r} is not supported by the embedded v4rl engine; send it without {key}")
    prompts, batched = _prompts(body, tokenizer)
    size = len(prompts)
    params = _per_item(body.get("sampling_params"), size, "sampling_params", {})
    for p in params:
        unknown = [k for k in p if k not in SAMPLING_FIELDS]
        if unknown:
            raise ContractError(unknown_field_message(unknown[0]))
    n = _parallel_sample_num(params)
    if n > 1:
        for name in LOGPROB_OPTIONS:
            if isinstance(body.get(name), list):
                raise RequestError(f"Cannot use list {name} with parallel_sample_num > 1")
    return_logprob = _per_item(body.get("return_logprob"), size, "return_logprob", False)
    start = _per_item(body.get("logprob_start_len"), size, "logprob_start_len", -1)
    top = _per_item(body.get("top_logprobs_num"), size, "top_logprobs_num", 0)
    rids = _sample_rids(body.get("rid"), size, n, batched)
    wants_routes = bool(body.get("return_routed_experts") or False)
    routes_start = _int(body.get("routed_experts_start_len") or 0, "routed_experts_start_len")
    specs: list[RequestSpec] = []
    per_sample: list[dict[str, Any]] = []  # what shapes each sample's response (text, logprob fields)
    for i, ids in enumerate(prompts):
        sampling, seed, min_new, stop = _sampling(params[i], tokenizer)
        if context_length is not None:
            _check_length(ids, params[i], sampling, context_length)
        wants_logprob = bool(return_logprob[i])
        first = _logprob_start(_int(start[i], "logprob_start_len"), len(ids)) if wants_logprob else -1
        if wants_routes:
            _check_routes_start(routes_start, len(ids))
        for j in range(n):
            per_sample.append({**params[i], "return_logprob": wants_logprob,
                               "top_logprobs_num": _int(top[i], "top_logprobs_num")})
            specs.append(RequestSpec(
                rid=rids[i * n + j], input_ids=ids, sampling=sampling,
                seed=sample_seed(seed, j, ids) if seed is not None else secrets.randbits(63),
                min_new_tokens=min_new, stop_strings=stop, return_logprob=wants_logprob,
                logprob_start_len=first, top_logprobs_num=_int(top[i], "top_logprobs_num"),
                return_routed_experts=wants_routes, routed_experts_start_len=routes_start))
    if len({s.rid for s in specs}) != len(specs):
        raise RequestError("rid values must be unique within one request")
    options = {"return_text_in_logprobs": bool(body.get("return_text_in_logprobs") or False),
               "samples": per_sample}
    return specs, batched or n > 1, options


def _check_length(ids: list[int], params: dict[str, Any], sampling: SamplingParams, context_length: int) -> None:
    # SGLang reads the request's own dict: omitted or null max_new_tokens skips the prompt + output check
    max_new = None if params.get("max_new_tokens") is None else sampling.max_new_tokens
    try:
        check_request_length(prompt_tokens=len(ids), max_new_tokens=max_new, context_length=context_length)
    except ContextLengthError as exc:
        raise RequestError(str(exc)) from None


def sample_seed(seed: int, sample: int, input_ids: list[int]) -> int:
    """Generator seed of sample `sample` of a prompt: equal (seed, prompt) give equal outputs wherever the
    request sits in a batch, while different prompts under one batch-wide seed draw independent streams."""
    digest = hashlib.blake2b(f"{seed}:{sample}:{','.join(map(str, input_ids))}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _prompts(body: dict[str, Any], tokenizer) -> tuple[list[list[int]], bool]:
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise RequestError("give exactly one of 'text' or 'input_ids'")
    if text is not None:
        if tokenizer is None:
            raise RequestError("this model directory has no tokenizer; send 'input_ids' instead of 'text'")
        texts = [text] if isinstance(text, str) else text
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise RequestError("'text' must be a string or a non-empty list of strings")
        return [tokenizer(t).input_ids for t in texts], not isinstance(text, str)
    if isinstance(input_ids, list) and input_ids and all(isinstance(t, int) for t in input_ids):
        return [list(input_ids)], False
    if (isinstance(input_ids, list) and input_ids and all(isinstance(p, list) for p in input_ids)
            and all(isinstance(t, int) for p in input_ids for t in p)):
        return [list(p) for p in input_ids], True
    raise RequestError("'input_ids' must be a non-empty list of token ids or a non-empty list of such lists")


def _per_item(value: Any, size: int, name: str, default: Any) -> list[Any]:
    """A per-request field: one value for every input, or a list with one entry per input."""
    if value is None:
        return [default] * size
    if isinstance(value, list):
        if len(value) != size:
            raise RequestError(f"{name!r} has {len(value)} entries for {size} inputs")
        values = [default if v is None else v for v in value]
    else:
        values = [value] * size
    if name == "sampling_params" and not all(isinstance(v, dict) for v in values):
        raise RequestError(f"'sampling_params' must be one object or a list of {size} objects")
    return values


def _parallel_sample_num(params: list[dict[str, Any]]) -> int:
    counts = {1 if p.get("n") is None else p["n"] for p in params}
    if len(counts) > 1:
        raise RequestError("The parallel_sample_num should be the same for all samples in sample params.")
    n = _int(counts.pop(), "n")
    if n < 1:
        raise RequestError(f"sampling_params.n must be >= 1; got {n}")
    return n


def _sample_rids(rid: Any, size: int, n: int, batched: bool) -> list[str]:
    """One rid per sample, item-major: a list names each item (its samples `<rid>_<j>` when n > 1), one string
    names the samples `<rid>_0`, `<rid>_1`, ... (a single prompt with n == 1 keeps it as is)."""
    if rid is None:
        return [uuid.uuid4().hex for _ in range(size * n)]
    if isinstance(rid, str):
        return [rid] if size * n == 1 and not batched else [f"{rid}_{k}" for k in range(size * n)]
    if isinstance(rid, list) and all(isinstance(r, str) for r in rid):
        if len(rid) != size:
            raise RequestError("The specified rids length mismatch with the batch_size for batch processing.")
        return [r if n == 1 else f"{r}_{j}" for r in rid for j in range(n)]
    raise RequestError("The rid should be a string or a list of strings.")


def _logprob_start(start: int, prompt_len: int) -> int:
    """SGLang's reading: -1 is "output tokens only" (start at the end of the prompt); beyond the prompt is refused."""
    if start == -1:
        return prompt_len
    if start < -1 or start > prompt_len:
        raise RequestError(f"logprob_start_len={start} is higher than the number of input tokens {prompt_len}; "
                           "use a smaller logprob_start_len" if start > prompt_len else
                           f"logprob_start_len must be -1 or in [0, {prompt_len}]; got {start}")
    return start


def _check_routes_start(start: int, prompt_len: int) -> None:
    """SGLang's scheduler check of routed_experts_start_len, with its wording."""
    if start < 0:
        raise RequestError(f"routed_experts_start_len={start} is lower than 0. Please use a non-negative "
                           "routed_experts_start_len.")
    if start > prompt_len:
        raise RequestError(f"routed_experts_start_len={start} is higher than the number of input tokens "
                           f"{prompt_len}. Please use a smaller routed_experts_start_len.")


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name!r} must be an integer; got {value!r}")
    return value


def _is_unset(value: Any, unset: Any) -> bool:
    # stop_regex "" is not unset in SGLang: an empty pattern matches at once and stops every sample
    return value is None or (value == unset and type(value) is type(unset))


def _sampling(p: dict[str, Any], tokenizer) -> tuple[SamplingParams, int | None, int, tuple[str, ...]]:
    for key, unset in UNSUPPORTED_SAMPLING.items():
        if key in p and not _is_unset(p[key], unset):
            raise RequestError(f"sampling_params.{key}={p[key]!r} is not supported by the embedded v4rl engine "
                               f"(only unset: null or {unset!r}); drop it or use a real SGLang server")
    stop = p.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) and s for s in stop):
        raise RequestError("sampling_params.stop must be a string or a list of non-empty strings")
    seed = p.get("sampling_seed")
    if seed is not None:
        seed = _int(seed, "sampling_seed")
    top_k = _int(_default(p, "top_k", -1), "top_k")
    max_new = _default(p, "max_new_tokens", 128)
    try:
        sampling = SamplingParams(
            temperature=float(_default(p, "temperature", 1.0)), top_p=float(_default(p, "top_p", 1.0)),
            top_k=-1 if top_k >= TOP_K_ALL else top_k,
            max_new_tokens=UNLIMITED_NEW_TOKENS if max_new is None else _int(max_new, "max_new_tokens"),
            stop_token_ids=[_int(t, "stop_token_ids") for t in (p.get("stop_token_ids") or [])],
            ignore_eos=bool(_default(p, "ignore_eos", False)))
    except (TypeError, ValueError) as exc:
        raise RequestError(f"sampling_params: {exc}") from None
    min_new = _int(_default(p, "min_new_tokens", 0), "min_new_tokens")
    return sampling, seed, min_new, stop


def _default(p: dict[str, Any], key: str, default: Any) -> Any:
    """The value of a sampling key, null meaning its default (SGLang's SamplingParams.__post_init__)."""
    value = p.get(key)
    if value is None and key == "max_new_tokens" and key in p:
        return None  # explicit null: no limit but the context length
    return default if value is None else value


# ---------------------------------------------------------------------------------------------- responses
def build_response(outputs: list[RequestOutput], batched: bool, options: dict[str, Any], tokenizer=None) -> Any:
    items = [response_item(o, sample, options["return_text_in_logprobs"], tokenizer)
             for o, sample in zip(outputs, options["samples"])]
    return items if batched else items[0]


def response_item(o: RequestOutput, sample: dict[str, Any], with_text: bool, tokenizer) -> dict[str, Any]:
    """One sample's `{"text", "output_ids", "meta_info"}`; of a running request (finish_reason None): SGLang's
    streamed chunk, cumulative (text and ids so far, logprobs so far), without e2e_latency."""
    def entry(logprob: float | None, tok: int) -> list[Any]:
        return [logprob, tok, tokenizer.decode([tok]) if with_text and tokenizer is not None else None]

    meta: dict[str, Any] = {
        "id": o.rid, "finish_reason": o.finish_reason, "prompt_tokens": len(o.input_ids),
        "completion_tokens": len(o.output_ids), "cached_tokens": o.cached_tokens, "reasoning_tokens": 0,
        "weight_version": o.weight_version, "weight_versions": o.weight_versions,
        "num_retractions": o.num_retractions, "e2e_latency": o.e2e_latency}
    if sample["return_logprob"]:
        start = len(o.input_ids) - len(o.input_logprobs)
        meta["input_token_logprobs"] = [entry(lp, o.input_ids[start + k]) for k, lp in enumerate(o.input_logprobs)]
        meta["output_token_logprobs"] = [entry(lp, t) for lp, t in zip(o.output_logprobs, o.output_ids)]
        meta["output_token_logprobs_length"] = len(o.output_ids)
        if sample["top_logprobs_num"] > 0:
            meta["input_top_logprobs"] = [None if row is None else [entry(lp, t) for lp, t in row]
                                          for row in o.input_top_logprobs]
            meta["output_top_logprobs"] = [[entry(lp, t) for lp, t in row] for row in o.output_top_logprobs]
    if o.routed_experts is not None:
        meta["routed_experts"] = base64.b64encode(o.routed_experts.contiguous().numpy().tobytes()).decode("ascii")
    if o.finish_reason is None:
        del meta["e2e_latency"]
    return {"text": _text(o, sample, tokenizer), "output_ids": o.output_ids, "meta_info": meta}


def _text(o: RequestOutput, params: dict[str, Any], tokenizer) -> str:
    """SGLang's detokenizer text: a matched stop string cut off (`no_stop_trim`: kept, and the text ends right
    after it), a matched stop token left out of the text unless `no_stop_trim` (output_ids keep every token
    either way). A running request's text (a streamed chunk) is untrimmed and holds back a trailing incomplete
    UTF-8 character, as SGLang's incremental detokenizer does."""
    if tokenizer is None:
        return ""
    skip = params.get("skip_special_tokens")
    keep_stop = bool(params.get("no_stop_trim"))
    matched = (o.finish_reason or {}).get("matched")
    ids = o.output_ids[:-1] if isinstance(matched, int) and not keep_stop and o.output_ids else o.output_ids
    text = tokenizer.decode(ids, skip_special_tokens=True if skip is None else bool(skip))
    if o.finish_reason is None:
        return text.rstrip("\ufffd")
    if isinstance(matched, str) and matched in text:
        end = text.index(matched)
        text = text[:end + len(matched)] if keep_stop else text[:end]
    return text
