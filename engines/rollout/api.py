"""The rollout engine's data types: its configuration, a request, a request's result, a control call's result.

They carry SGLang's field names (reference/miles-sglang-megatron.md §2), so the HTTP layer (server.py,
protocol.py) maps them one to one; engine.py holds the engine that consumes them.

    from engines.rollout.api import EngineConfig, RequestSpec
    spec = RequestSpec(rid="a", input_ids=[0, 5, 9], sampling=SamplingParams(max_new_tokens=8), seed=1)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from engines.rollout.sampling import SamplingParams

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass(kw_only=True)
class EngineConfig:
    dtype: str = "float32"
    """Runtime dtype of the dequantized copies: float32 (bit-exact scoring) or bfloat16."""
    max_running_requests: int = 1024
    """Requests decoded together at most; the rest wait in the queue (SGLang --max-running-requests). SGLang
    sizes it from KV memory; our caches are small, and one batch for a whole GRPO step (128 prompts x 8)
    halves its rollout time against waves of 128 (fewer, wider decode steps)."""
    prefix_cache_entries: int = 512
    """Prefilled sequences kept for reuse (LRU); 0 disables the prefix cache."""
    context_length: int | None = None
    """Longest prompt + output; None: the model's max_position_embeddings."""
    weight_version: str = "default"
    """Initial weight_version reported in meta_info and /model_info."""
    profile: Mapping[str, Any] = field(default_factory=dict)
    """Engine profile as a mapping (e.g. `dataclasses.asdict(get_profile(...))`); read: `fp8_dtype` ==
    "e4m3fnuz" or `rocm_fnuz` True puts FP8 weights through e4m3fnuz copies, as ROCm MI300-class engines do."""
    threads: int | None = None
    """Intra-op CPU threads of the scheduler thread (torch.set_num_threads there; other threads keep theirs).
    None keeps torch's default. A decode step of a small model is thousands of tiny ops, where waking a second
    thread can cost more than it saves: bench/rollout.py measures 1 thread against the default."""
    enable_return_routed_experts: bool = False
    """SGLang's --enable-return-routed-experts: requests with return_routed_experts get `routed_experts` (the
    experts every token was routed to, engine.py). Off, such requests are served without it, as SGLang does."""
    return_original_logprob: bool = True
    """True: each sampled token's logprob is RAW, log_softmax of the unprocessed logits (what v4rl's trainer
    recomputes; SGLang returns the same with SGLANG_RETURN_ORIGINAL_LOGPROB=1, which v4rl's SGLang launcher sets).
    False: SGLang's default, log_softmax(logits / temperature) for a sampled row (temperature > 0), what Miles'
    trainer recomputes (its loss divides the logits by --rollout-temperature); output logprobs and their top-k
    lists, prompt (input) logprobs stay RAW. `serve-rollout --no-return-original-logprob`."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}; got {self.dtype!r}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1; got {self.max_running_requests}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1 or None (torch's default); got {self.threads}")

    @property
    def rocm_fnuz(self) -> bool:
        return bool(self.profile.get("rocm_fnuz")) or self.profile.get("fp8_dtype") == "e4m3fnuz"


@dataclass(kw_only=True)
class RequestSpec:
    """One sequence to generate (SGLang GenerateReqInput after batch expansion)."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    seed: int
    """Seeds this request's own torch.Generator."""
    min_new_tokens: int = 0
    stop_strings: tuple[str, ...] = ()
    return_logprob: bool = False
    logprob_start_len: int = -1
    """First prompt position with an input logprob entry; -1 or len(input_ids): none, output tokens only
    (SGLang's reading of -1 with return_logprob)."""
    top_logprobs_num: int = 0
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    """First position whose routing is returned (SGLang: rows cover [start, len(sequence) - 1))."""


@dataclass
class RequestOutput:
    rid: str
    input_ids: list[int]
    output_ids: list[int]
    finish_reason: dict[str, Any] | None
    """SGLang's finish reason; None in a snapshot of a request still running (RolloutEngine.submit's progress)."""
    output_logprobs: list[float]
    output_top_logprobs: list[list[tuple[float, int]]]
    input_logprobs: list[float | None]
    """Entries for positions logprob_start_len .. len(input_ids)-1, the first one None (SGLang)."""
    input_top_logprobs: list[list[tuple[float, int]] | None]
    cached_tokens: int
    num_retractions: int
    weight_version: str
    e2e_latency: float
    weight_versions: list[dict[str, Any]] = field(default_factory=list)
    """Which weights produced which output tokens: `[{"version", "start", "end"}]` (SGLang's meta_info)."""
    routed_experts: torch.Tensor | None = None
    """int32 [prompt + output - 1 - routed_experts_start_len, layers, top_k]: the experts each forwarded token was
    routed to in every layer (hash layers: the tid2eid lookup), for a finished request that asked with
    enable_return_routed_experts on; None otherwise."""


@dataclass
class UpdateResult:
    success: bool
    message: str
    num_paused_requests: int = 0


def weight_version_spans(changes: list[tuple[str, int]], current: str, num_output_tokens: int
                         ) -> list[dict[str, Any]]:
    """Output-token spans per weight version. `changes` are (version before the change, output tokens the
    request had then), oldest first; tokens before the first change came from its version, the rest from the
    next one, and so on up to `current`. Versions that produced no tokens are left out, except that a request
    with no output yet is attributed to the version in force when it began."""
    spans: list[dict[str, Any]] = []
    for version, end in [*changes, (current, num_output_tokens)]:
        end = min(end, num_output_tokens)
        start = spans[-1]["end"] if spans else 0
        if spans and end <= start:
            continue
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = end
        else:
            spans.append({"version": version, "start": start, "end": end})
    return spans


class EngineUnavailable(RuntimeError):
    """The engine cannot serve a request now; the message says why and what brings it back (HTTP 503)."""


class EngineStopped(EngineUnavailable):
    """The engine was shut down while a request or command was pending."""

