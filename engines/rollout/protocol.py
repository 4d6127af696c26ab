"""SGLang's native `/generate` request and response, mapped onto the engine (sglang 0.5.23 field names).

Request (`GenerateReqInput`, reference/miles-sglang-megatron.md §2.1): `text` or `input_ids`, single or
batched; `sampling_params` (one dict, or one per item); `return_logprob`, `logprob_start_len`,
`top_logprobs_num`, `return_text_in_logprobs`, `rid` (each scalar or one per item). `sampling_params.n`
expands every item into n samples, item-major. Unknown sampling keys are refused (SGLang raises too);
features the embedded engine does not have (penalties, grammars, logit_bias, min_p, streaming, LoRA,
routed-expert capture, ...) are refused when set to anything but their default, never silently ignored.

Response per item: `{"text", "output_ids", "meta_info"}` with `meta_info` = `id`, `finish_reason`
(`{"type": "stop", "matched"}` | `{"type": "length", "length"}` | `{"type": "abort", "message", ...}`),
`prompt_tokens`, `completion_tokens`, `cached_tokens`, `weight_version`, `num_retractions`,
`e2e_latency`, and with `return_logprob`: `input_token_logprobs` / `output_token_logprobs` as
`[logprob, token_id, text_or_null]` lists (the first input entry's logprob is null, as in SGLang),
plus `output_token_logprobs_length` and top-k lists when `top_logprobs_num > 0`. A single item gives a
dict, a batch (or n > 1) a list.

Seeds: with `sampling_params.sampling_seed`, sample j of a prompt is seeded from (seed, j, the prompt's
tokens): the same seed and prompt give the same output alone or anywhere in a batch, and the prompts of
one batch do not share a random stream. Without a seed every sample draws a fresh random one.
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from typing import Any

from engines.rollout.engine import RequestOutput, RequestSpec
from engines.rollout.sampling import SamplingParams

SUPPORTED_SAMPLING = {"max_new_tokens", "temperature", "top_p", "top_k", "min_new_tokens", "stop", "stop_token_ids",
                      "ignore_eos", "n", "sampling_seed", "skip_special_tokens", "spaces_between_special_tokens",
                      "no_stop_trim", "stream_interval"}
"""Keys of SGLang's SamplingParams the embedded engine honours (the last three shape text only)."""
UNSUPPORTED_SAMPLING = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                        "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None, "stop_regex": None,
                        "logit_bias": None, "custom_params": None}
"""SGLang sampling keys accepted only at these defaults."""
UNSUPPORTED_REQUEST = ("stream", "lora_path", "input_embeds", "image_data", "return_routed_experts",
                       "return_indexer_topk", "return_entropy", "custom_logit_processor", "token_ids_logprob",
                       "return_hidden_states")
"""Top-level GenerateReqInput fields refused when truthy."""


class RequestError(ValueError):
    """A malformed or unsupported /generate request (HTTP 400); the message says which field and why."""


def parse_generate(body: Any, tokenizer=None) -> tuple[list[RequestSpec], bool, dict[str, Any]]:
    """GenerateReqInput JSON -> (one RequestSpec per sample, whether the input was batched, text options)."""
    if not isinstance(body, dict):
        raise RequestError("the /generate body must be a JSON object")
    for key in UNSUPPORTED_REQUEST:
        if body.get(key):
            raise RequestError(f"{key!r} is not supported by the embedded v4rl engine; send it without {key}")
    prompts, batched = _prompts(body, tokenizer)
    size = len(prompts)
    params = _per_item(body.get("sampling_params"), size, "sampling_params", {})
    return_logprob = _per_item(body.get("return_logprob"), size, "return_logprob", False)
    start = _per_item(body.get("logprob_start_len"), size, "logprob_start_len", -1)
    top = _per_item(body.get("top_logprobs_num"), size, "top_logprobs_num", 0)
    rids = _per_item(body.get("rid"), size, "rid", None)
    specs: list[RequestSpec] = []
    sample_params: list[dict[str, Any]] = []  # the sampling_params of each sample (text shaping)
    for i, ids in enumerate(prompts):
        sampling, n, seed, min_new, stop = _sampling(params[i], tokenizer)
        rid = rids[i] if rids[i] is not None else uuid.uuid4().hex
        sample_params += [params[i]] * n
        for j in range(n):
            specs.append(RequestSpec(
                rid=str(rid) if n == 1 else f"{rid}_{j}", input_ids=ids, sampling=sampling,
                seed=sample_seed(seed, j, ids) if seed is not None else secrets.randbits(63),
                min_new_tokens=min_new, stop_strings=stop, return_logprob=bool(return_logprob[i]),
                logprob_start_len=_int(start[i], "logprob_start_len"),
                top_logprobs_num=_int(top[i], "top_logprobs_num")))
    if len({s.rid for s in specs}) != len(specs):
        raise RequestError("rid values must be unique within one request")
    text_options = {"return_text_in_logprobs": bool(body.get("return_text_in_logprobs", False)),
                    "params": sample_params}
    return specs, batched or len(specs) > size, text_options


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


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name!r} must be an integer; got {value!r}")
    return value


def _sampling(p: dict[str, Any], tokenizer) -> tuple[SamplingParams, int, int | None, int, tuple[str, ...]]:
    unknown = sorted(set(p) - SUPPORTED_SAMPLING - set(UNSUPPORTED_SAMPLING))
    if unknown:
        raise RequestError(f"unknown sampling_params keys {unknown}; SGLang's SamplingParams has no such fields")
    for key, default in UNSUPPORTED_SAMPLING.items():
        if key in p and p[key] != default and p[key] is not None:
            raise RequestError(f"sampling_params.{key}={p[key]!r} is not supported by the embedded v4rl engine "
                               f"(only {default!r}); drop it or use a real SGLang server")
    n = _int(p.get("n", 1), "n")
    if n < 1:
        raise RequestError(f"sampling_params.n must be >= 1; got {n}")
    stop = p.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) and s for s in stop):
        raise RequestError("sampling_params.stop must be a string or a list of non-empty strings")
    seed = p.get("sampling_seed")
    if seed is not None:
        seed = _int(seed, "sampling_seed")
    top_k = p.get("top_k", -1)
    try:
        sampling = SamplingParams(
            temperature=float(p.get("temperature", 1.0)), top_p=float(p.get("top_p", 1.0)),
            top_k=-1 if top_k is None else _int(top_k, "top_k"),
            max_new_tokens=_int(p.get("max_new_tokens", 128), "max_new_tokens"),
            stop_token_ids=[_int(t, "stop_token_ids") for t in (p.get("stop_token_ids") or [])],
            ignore_eos=bool(p.get("ignore_eos", False)))
    except (TypeError, ValueError) as exc:
        raise RequestError(f"sampling_params: {exc}") from None
    min_new = _int(p.get("min_new_tokens", 0), "min_new_tokens")
    return sampling, n, seed, min_new, stop


# ---------------------------------------------------------------------------------------------- responses
def build_response(outputs: list[RequestOutput], batched: bool, text_options: dict[str, Any], tokenizer=None) -> Any:
    items = [_item(o, params, text_options["return_text_in_logprobs"], tokenizer)
             for o, params in zip(outputs, text_options["params"])]
    return items if batched else items[0]


def _item(o: RequestOutput, params: dict[str, Any], with_text: bool, tokenizer) -> dict[str, Any]:
    def entry(logprob: float | None, tok: int) -> list[Any]:
        return [logprob, tok, tokenizer.decode([tok]) if with_text and tokenizer is not None else None]

    meta: dict[str, Any] = {
        "id": o.rid, "finish_reason": o.finish_reason, "prompt_tokens": len(o.input_ids),
        "completion_tokens": len(o.output_ids), "cached_tokens": o.cached_tokens,
        "weight_version": o.weight_version, "num_retractions": o.num_retractions, "e2e_latency": o.e2e_latency}
    if o.input_logprobs:
        start = len(o.input_ids) - len(o.input_logprobs)
        meta["input_token_logprobs"] = [entry(lp, o.input_ids[start + k]) for k, lp in enumerate(o.input_logprobs)]
        meta["output_token_logprobs"] = [entry(lp, t) for lp, t in zip(o.output_logprobs, o.output_ids)]
        meta["output_token_logprobs_length"] = len(o.output_ids)
        if o.output_top_logprobs or o.input_top_logprobs:
            meta["input_top_logprobs"] = [None if row is None else [entry(lp, t) for lp, t in row]
                                          for row in o.input_top_logprobs]
            meta["output_top_logprobs"] = [[entry(lp, t) for lp, t in row] for row in o.output_top_logprobs]
    return {"text": _text(o, params, tokenizer), "output_ids": o.output_ids, "meta_info": meta}


def _text(o: RequestOutput, params: dict[str, Any], tokenizer) -> str:
    if tokenizer is None:
        return ""
    text = tokenizer.decode(o.output_ids, skip_special_tokens=bool(params.get("skip_special_tokens", True)))
    matched = o.finish_reason.get("matched")
    if isinstance(matched, str) and not params.get("no_stop_trim", False) and matched in text:
        text = text[:text.index(matched)]
    return text
