"""DeepSeek-V4 model configuration, read from and written to a HF `config.json`.

The field names and defaults follow transformers' `DeepseekV4Config` (5.23). `to_hf_dict` writes DeepSeek's
release form (what SGLang, Miles' bridge and transformers all read: per-layer `compress_ratios`,
`num_hash_layers`, `qk_rope_head_dim`, flat YaRN `rope_scaling`, ...); `from_hf_dict` reads that form and
transformers' own (`layer_types`, `compress_rates`, nested `rope_parameters`). The two forms and their keys:
engines/model/config_format.py.

    >>> cfg = ModelConfig.from_json_file("checkpoints/tiny/config.json")
    >>> cfg.layer_types[:2], cfg.rope_head_dim
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engines.model.config_format import (
    CSA,
    HASH_MOE,
    HCA,
    SLIDING,
    TOPK_MOE,
    canonical_rope_scaling,
    model_fields_from_json,
    release_config_dict,
)

LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = (HASH_MOE, TOPK_MOE)


@dataclass(kw_only=True)
class ModelConfig:
    """Shape and hyper-parameters of a DeepSeek-V4 model (transformers' `DeepseekV4Config` fields)."""

    vocab_size: int = 129280
    """Rows of `embed` and `head`; every token id must be below it."""
    hidden_size: int = 4096
    """Width D of each of the `hc_mult` residual streams."""
    num_hidden_layers: int = 43
    """Decoder layers; `layer_types` and `mlp_layer_types` must have this many entries."""
    num_attention_heads: int = 64
    """Query heads; all share one KV head (shared-KV MQA)."""
    head_dim: int = 512
    """Per-head width of Q and of the single shared K=V head."""
    q_lora_rank: int = 1024
    """Low-rank Q bottleneck (`wq_a` output, `q_norm`, `wq_b` input)."""
    partial_rotary_factor: float = 64 / 512
    """Fraction of `head_dim` (the trailing channels) that carries interleaved RoPE."""
    rope_theta: float = 10000.0
    """RoPE base of sliding-only layers (`main`)."""
    compress_rope_theta: float = 160000.0
    """RoPE base of CSA/HCA layers and their compressors (`compress`)."""
    rope_scaling: dict[str, Any] | None = None
    """YaRN of the `compress` RoPE in the release's flat form (`type: yarn`, `factor`,
    `original_max_position_embeddings`, `beta_fast`, `beta_slow`), or None for plain RoPE. Other spellings
    (`rope_type`, transformers' nested sub-dict) are folded into this one."""
    max_position_embeddings: int = 1048576
    """Longest position the RoPE tables are meant for."""
    layer_types: list[str] = field(default_factory=list)
    """Per-layer attention: sliding_attention | compressed_sparse_attention (CSA) | heavily_compressed_attention (HCA)."""
    mlp_layer_types: list[str] = field(default_factory=list)
    """Per-layer MoE: hash_moe (frozen tid2eid routing) | moe (learned sqrtsoftplus top-k)."""
    compress_rates: dict[str, int] = field(default_factory=lambda: {CSA: 4, HCA: 128})
    """Tokens folded into one compressed KV entry, per compressed layer type."""
    sliding_window: int = 128
    """Tokens (query included) each query sees in the local branch of every layer."""
    o_groups: int = 8
    """Head groups of the grouped output projection (`wo_a`)."""
    o_lora_rank: int = 1024
    """Per-group output width of `wo_a`."""
    index_n_heads: int = 64
    """Lightning-indexer query heads (CSA layers)."""
    index_head_dim: int = 128
    """Lightning-indexer head width (CSA layers)."""
    index_topk: int = 512
    """Compressed entries each query keeps after the indexer (CSA layers)."""
    n_routed_experts: int = 256
    """Routed experts per MoE layer."""
    n_shared_experts: int = 1
    """Shared experts per MoE layer (DeepSeek-V4 has exactly one)."""
    num_experts_per_tok: int = 6
    """Experts each token is routed to (top-k, and columns of `tid2eid`)."""
    moe_intermediate_size: int = 2048
    """Inner width of every routed and shared expert."""
    scoring_func: str = "sqrtsoftplus"
    """Router score activation; DeepSeek-V4 uses sqrt(softplus(logits))."""
    routed_scaling_factor: float = 1.5
    """Multiplier on the normalised routing weights."""
    norm_topk_prob: bool = True
    """Normalise the selected experts' weights to sum to 1 before scaling."""
    swiglu_limit: float = 10.0
    """SwiGLU clamp: gate <= limit, -limit <= up <= limit."""
    hc_mult: int = 4
    """mHC residual streams."""
    hc_sinkhorn_iters: int = 20
    """Sinkhorn-Knopp iterations that make the mHC comb matrix doubly stochastic."""
    hc_eps: float = 1e-6
    """Floor added in the mHC pre/comb weights and Sinkhorn normalisation."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False
    """DeepSeek-V4 keeps `head` separate from `embed`; True is rejected."""
    initializer_range: float = 0.02
    """Std of the random initialisation used by `v4rl bootstrap` and tests."""

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if len(self.layer_types) != n:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {n}; "
                             "give one attention type per layer (or the legacy compress_ratios list).")
        if len(self.mlp_layer_types) != n:
            raise ValueError(f"mlp_layer_types has {len(self.mlp_layer_types)} entries but num_hidden_layers is {n}.")
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"layer_types entries must be one of {LAYER_TYPES}; got {bad}.")
        bad = [t for t in self.mlp_layer_types if t not in MLP_LAYER_TYPES]
        if bad:
            raise ValueError(f"mlp_layer_types entries must be one of {MLP_LAYER_TYPES}; got {bad}.")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ValueError(f"num_attention_heads*head_dim ({self.num_attention_heads * self.head_dim}) must be "
                             f"divisible by o_groups ({self.o_groups}).")
        if self.rope_head_dim % 2 or not 0 < self.rope_head_dim <= self.head_dim:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} gives a RoPE width of "
                             f"{self.rope_head_dim}; it must be even and within head_dim {self.head_dim}.")
        if self.n_shared_experts != 1:
            raise ValueError("DeepSeek-V4 has exactly one shared expert; set n_shared_experts=1.")
        if self.tie_word_embeddings:
            raise ValueError("DeepSeek-V4 keeps head separate from embed; set tie_word_embeddings=false.")
        if self.scoring_func != "sqrtsoftplus":
            raise ValueError(f"scoring_func {self.scoring_func!r} is not supported; DeepSeek-V4 uses sqrtsoftplus.")
        self.rope_scaling = canonical_rope_scaling(self.rope_scaling)
        if self.rope_scaling is not None:
            self._check_rope_scaling(self.rope_scaling)

    @staticmethod
    def _check_rope_scaling(scaling: dict[str, Any]) -> None:
        if scaling["type"] != "yarn":
            raise ValueError(f"rope_scaling type {scaling['type']!r} is not supported; DeepSeek-V4's compressed "
                             "layers use yarn (or no rope_scaling for plain RoPE).")
        missing = [k for k in ("factor", "original_max_position_embeddings") if k not in scaling]
        if missing:  # SGLang raises KeyError on a missing original length, transformers would guess one
            raise ValueError(f"rope_scaling (yarn) lacks {missing}; give the YaRN factor and the pre-extension "
                             "context (DeepSeek-V4-Flash: factor 16, original_max_position_embeddings 65536).")
        if "attention_factor" in scaling:
            raise ValueError(f"rope_scaling attention_factor {scaling['attention_factor']} is not supported; "
                             "DeepSeek-V4 does not scale cos/sin (attention factor 1.0): drop the key.")

    # ------------------------------------------------------------------ derived shape facts
    @property
    def rope_head_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def n_hash_layers(self) -> int:
        return self.mlp_layer_types.count(HASH_MOE)

    def compress_rate(self, layer: int) -> int:
        """Compression rate of a layer's compressor, 0 for sliding-only layers."""
        kind = self.layer_types[layer]
        return 0 if kind == SLIDING else self.compress_rates[kind]

    # ------------------------------------------------------------------ HF config.json
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Read the fields of a HF DeepSeek-V4 `config.json`: the release form, transformers' form, or a mix."""
        return cls(**model_fields_from_json(raw, {f.name for f in dataclasses.fields(cls)}))

    @classmethod
    def from_json_file(cls, path: str | Path) -> "ModelConfig":
        """A DeepSeek-V4 config.json, or the checkpoint directory holding one."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read model config {path}: {exc}; give a DeepSeek-V4 config.json") from exc
        model_type = raw.get("model_type") if isinstance(raw, dict) else "not a JSON object"
        if model_type not in (None, "deepseek_v4"):
            raise ValueError(f"model config {path} is {model_type!r}, not 'deepseek_v4'; give a DeepSeek-V4 "
                             "config.json")
        return cls.from_hf_dict(raw)

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` body in DeepSeek's release form (no storage fields: checkpoints/hf.py adds them)."""
        return release_config_dict(self)
