"""What the rollout server reports about itself: SGLang 0.5.23's /model_info and /server_info fields.

/model_info carries the fields of SGLang's `model_info` route; `model_path`, `served_model_name` and
`load_format` move with every successful /update_weights_from_disk (SGLang's tokenizer manager does the
same), `weight_version` with every version change. /server_info reports the startup configuration under
SGLang's ServerArgs field names (only those the embedded engine has a value for; the conformance suite
checks each name against SGLang's ServerArgs), the scheduler's handshake fields, `startup_time`,
`internal_states` (the engine's own status, one entry: there is one scheduler), `version` (the SGLang API
version served) and, under "v4rl", what only the embedded engine has (ROCm fnuz copies, prefix-cache size).

    state = ServingState(engine, host="127.0.0.1", port=30000)
    state.model_info()["model_path"]
"""

from __future__ import annotations

from typing import Any

from engines.rollout.sglang_pin import sglang_version
from engines.rollout.engine import RolloutEngine
from engines.rollout.limits import max_req_input_len

MODEL_TYPE = "deepseek_v4"
ARCHITECTURES = ["DeepseekV4ForCausalLM"]


class ServingState:
    """The server's identity: startup arguments, and the model path a weight update moved it to."""

    def __init__(self, engine: RolloutEngine, *, host: str | None = None, port: int | None = None,
                 enable_memory_saver: bool = False) -> None:
        self.engine = engine
        self.model_path = self.served_model_name = str(engine.model_dir)
        self.load_format = "auto"
        cfg = engine.config
        tokenizer_path = str(engine.model_dir) if engine.tokenizer is not None else None
        self.startup_args: dict[str, Any] = {
            "model_path": self.model_path, "tokenizer_path": tokenizer_path, "served_model_name": self.model_path,
            "host": host, "port": port, "dtype": cfg.dtype, "device": "cpu", "load_format": self.load_format,
            "context_length": engine.context_length, "max_running_requests": cfg.max_running_requests,
            "disable_radix_cache": cfg.prefix_cache_entries <= 0, "skip_tokenizer_init": engine.tokenizer is None,
            "tp_size": 1, "dp_size": 1, "attn_dp_size": 1, "ep_size": 1, "pp_size": 1,
            "weight_version": cfg.weight_version, "reasoning_parser": None, "tool_call_parser": None,
            "disaggregation_mode": "null", "incremental_streaming_output": False, "enable_metrics": False,
            "trust_remote_code": False, "enable_memory_saver": enable_memory_saver,
            # one engine process on one device (the host CPU): SGLang's single-node, single-GPU values, which
            # Miles' external-engine check (`SGLangEngine._init_external`) compares with what it computed
            "nnodes": 1, "node_rank": 0, "gpu_id_step": 1, "base_gpu_id": 0, "dist_init_addr": None,
            "enable_return_routed_experts": cfg.enable_return_routed_experts, "enable_return_indexer_topk": False,
            "enable_weights_cpu_backup": enable_memory_saver}

    def moved_to(self, model_path: str, load_format: str | None) -> None:
        """A disk update succeeded: the server now answers under the new path (SGLang's reading)."""
        self.model_path = self.served_model_name = str(model_path)
        self.load_format = load_format or self.load_format

    def model_info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "served_model_name": self.served_model_name,
                "tokenizer_path": self.startup_args["tokenizer_path"], "is_generation": True,
                "preferred_sampling_params": None, "weight_version": self.engine.weight_version,
                "load_format": self.load_format, "reasoning_parser": None, "tool_call_parser": None,
                "disaggregation_mode": "null", "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": MODEL_TYPE, "architectures": list(ARCHITECTURES)}

    def server_info(self, status: dict[str, Any]) -> dict[str, Any]:
        cfg = self.engine.config
        return {**self.startup_args, "status": "ready",
                "max_req_input_len": max_req_input_len(self.engine.context_length),
                "startup_time": {"load_weight": self.engine.load_seconds}, "internal_states": [status],
                "version": sglang_version(),
                "v4rl": {"backend": "v4rl-embedded", "rocm_fnuz": cfg.rocm_fnuz,
                         "prefix_cache_entries": cfg.prefix_cache_entries, "threads": cfg.threads}}
