"""Request bodies of the rollout server's control routes, with SGLang 0.5.23's field names and defaults.

SGLang declares each control body as a required request struct (`managers/io_struct.py`), so FastAPI
refuses a missing or malformed body with HTTP 400 before the handler runs; these pydantic models do the
same for our server (`server.py` installs SGLang's 400 shape for validation errors: `{"object": "error",
"message", "type": "Bad Request", "param": null, "code": 400}`). Unknown keys are ignored, as SGLang's
structs ignore them. Fields the embedded engine cannot honour are accepted at their defaults and refused
otherwise by the route, with the reason.

    body = PauseGeneration.model_validate({"mode": "retract"})
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

Selector = Literal["target", "draft", "all"]


class _Body(BaseModel):
    """Every SGLang request struct carries an optional `rid` (BaseReq)."""

    model_config = ConfigDict(extra="ignore")
    rid: str | None = None


class PauseGeneration(_Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGeneration(_Body):
    torch_empty_cache: bool = True
    """Meaningless on CPU; accepted so SGLang's clients can send it."""


class AbortRequest(_Body):
    abort_all: bool = False


class UpdateWeightsFromDisk(_Body):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True
    manifest: dict[str, Any] | None = None


class BeginWeightUpdate(_Body):
    selector: Selector = "all"


class EndWeightUpdate(_Body):
    pass


class UpdateWeightVersion(_Body):
    new_version: str
    abort_all_requests: bool = True


class CheckWeights(_Body):
    action: str = "checksum"
    """snapshot | reset_tensors | compare | checksum (SGLang's weight_checker actions)."""
    allow_quant_error: bool = False
    skip_tensor_list: list[str] | None = None
    """Substrings of tensor names left out of reset/compare/checksum."""
    selector: Selector = "all"


class InitWeightsUpdateGroup(_Body):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DestroyWeightsUpdateGroup(_Body):
    group_name: str = "weight_update_group"


class UpdateWeightsFromDistributed(_Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: Selector = "all"
    torch_empty_cache: bool = False


class MemoryOccupation(_Body):
    """Release/ResumeMemoryOccupationReqInput: tags among kv_cache, weights, cuda_graph; null or [] = all."""

    tags: list[str] | None = None


class UpdateWeightsFromTensor(_Body):
    serialized_named_tensors: list[str]
    """One base64 payload per TP rank (CUDA-IPC handles on GPUs)."""
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    selector: Selector = "all"
    torch_empty_cache: bool = False


CHECK_WEIGHTS_ACTIONS = ("snapshot", "reset_tensors", "compare", "checksum")
