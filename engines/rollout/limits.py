"""SGLang 0.5.23's context-length rules for a generation request, and how it ends one (its finish order).

A request passes two gates before it runs, and a third bound caps its output (read from SGLang's source:
`managers/tokenizer_manager.py` `_validate_one_request`, `managers/scheduler.py` `init_req_max_new_tokens`
and `validate_input_length`, `managers/tp_worker.py`), with C the context length, no speculative decoding
(no reserved tokens) and a KV pool larger than C (the embedded engine's caches grow as needed):

  1. the tokenizer manager refuses a prompt of C tokens or more, and, when max_new_tokens is set, a prompt plus
     max_new_tokens over C: HTTP 400 `{"error": {"message": ...}}` for the whole request (a batch included);
  2. the scheduler refuses a prompt of `max_req_input_len` = C - 6 tokens or more (max_req_len = C - 1, less 5):
     that request finishes with `{"type": "abort", ..., "status_code": 400}`, which the HTTP layer answers as a
     400 (a streamed request gets it as its last chunk);
  3. every request's max_new_tokens (null: unlimited) is cut to max_req_len - prompt - 1 = C - prompt - 2, and
     reaching it finishes the request with `{"type": "length", "length": <the cut value>}`.

A finished step is checked in SGLang's order (`Req.update_finish_state`): a stop string first, then a stop token
(EOS or stop_token_ids; neither counts with ignore_eos), then the length cap.

    check_request_length(prompt_tokens=70, max_new_tokens=20, context_length=80)  # raises ContextLengthError
"""

from __future__ import annotations

from typing import Any

SCHEDULER_INPUT_MARGIN = 5
"""SGLang's tp_worker: max_req_input_len = max_req_len - 5."""


class ContextLengthError(ValueError):
    """A request SGLang's tokenizer manager refuses for its length (HTTP 400)."""


def check_request_length(*, prompt_tokens: int, max_new_tokens: int | None, context_length: int) -> None:
    """Gate 1 (the tokenizer manager), with SGLang's messages word for word."""
    if prompt_tokens >= context_length:
        raise ContextLengthError(f"The input ({prompt_tokens} tokens) is longer than the model's context length "
                                 f"({context_length} tokens).")
    if max_new_tokens is not None and max_new_tokens + prompt_tokens > context_length:
        raise ContextLengthError(
            f"Requested token count exceeds the model's maximum context length of {context_length} tokens. You "
            f"requested a total of {max_new_tokens + prompt_tokens} tokens: {prompt_tokens} tokens from the input "
            f"messages and {max_new_tokens} tokens for the completion. Please reduce the number of tokens in the "
            "input messages or the completion to fit within the limit.")


def max_req_len(context_length: int) -> int:
    return context_length - 1


def max_req_input_len(context_length: int) -> int:
    """The longest prompt the scheduler admits, minus one (SGLang reports it in /server_info)."""
    return max_req_len(context_length) - SCHEDULER_INPUT_MARGIN


def scheduler_refusal(prompt_tokens: int, context_length: int) -> dict[str, Any] | None:
    """Gate 2: the abort finish reason of a prompt the scheduler refuses, or None."""
    limit = max_req_input_len(context_length)
    if prompt_tokens < limit:
        return None
    return {"type": "abort", "status_code": 400, "err_type": "BadRequestError",
            "message": f"Input length ({prompt_tokens} tokens) exceeds the maximum allowed length ({limit} tokens). "
                       "Use a shorter input or enable --allow-auto-truncate."}


def output_cap(prompt_tokens: int, max_new_tokens: int, context_length: int) -> int:
    """Bound 3: the max_new_tokens a request really runs with."""
    return max(0, min(max_new_tokens, max_req_len(context_length) - prompt_tokens - 1))


def http_status_of(finish_reason: dict[str, Any]) -> int | None:
    """The HTTP status SGLang answers a finished request with instead of its output: an abort carrying a status
    in [400, 600) (e.g. gate 2), else None (aborts by /abort_request or a pause carry none and answer 200)."""
    code = finish_reason.get("status_code") if finish_reason.get("type") == "abort" else None
    return code if isinstance(code, int) and 400 <= code < 600 else None
