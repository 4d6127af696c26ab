"""DeepSeek-V4 model configuration, read from and written to a HF `config.json`.

The field names and defaults follow transformers' `DeepseekV4Config` (5.23), so a directory we write
loads in transformers and a real DeepSeek-V4 `config.json` loads here. Legacy forms are folded in the
same way transformers folds them: `compress_ratios` (per-layer 0/4/128), `compress_rate_csa` /
`compress_rate_hca`, `num_hash_layers`, `qk_rope_head_dim`.

    >>> cfg = ModelConfig.from_json_file("checkpoints/tiny/config.json")
    >>> cfg.layer_types[:2], cfg.rope_head_dim
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE = "hash_moe"
TOPK_MOE = "moe"
MLP_LAYER_TYPES = (HASH_MOE, TOPK_MOE)
_RATIO_TO_LAYER_TYPE = {0: SLIDING, 4: CSA, 128: HCA}


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
    """YaRN parameters of the `compress` RoPE (`rope_type: yarn`, `factor`, ...), or None for plain RoPE."""
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
        """Read the fields of a HF DeepSeek-V4 `config.json`, legacy forms included."""
        d = dict(raw)
        known = {f.name for f in dataclasses.fields(cls)}
        n = int(d.get("num_hidden_layers", 43))
        rates = dict(d.get("compress_rates") or {CSA: 4, HCA: 128})
        if d.get("compress_rate_csa") is not None:
            rates[CSA] = int(d["compress_rate_csa"])
        if d.get("compress_rate_hca") is not None:
            rates[HCA] = int(d["compress_rate_hca"])
        layer_types = d.get("layer_types")
        if layer_types is None and d.get("compress_ratios") is not None:
            ratios = list(d["compress_ratios"])[:n]
            unknown = sorted({r for r in ratios if r not in _RATIO_TO_LAYER_TYPE})
            if unknown:
                raise ValueError(f"config.json compress_ratios has values {unknown}; only 0, 4 and 128 are known "
                                 "(use layer_types + compress_rates for other rates).")
            layer_types = [_RATIO_TO_LAYER_TYPE[r] for r in ratios]
        if layer_types is None:  # transformers' default: 2x HCA, then CSA/HCA interleaved
            layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        mlp_types = d.get("mlp_layer_types")
        if mlp_types is None:
            n_hash = int(d.get("num_hash_layers", 3))
            mlp_types = [HASH_MOE] * min(n, n_hash) + [TOPK_MOE] * max(0, n - n_hash)
        prf = d.get("partial_rotary_factor")
        if prf is None:
            head_dim = int(d.get("head_dim", 512))
            prf = d["qk_rope_head_dim"] / head_dim if d.get("qk_rope_head_dim") else 64 / 512
        rope_scaling = None
        rope_params = d.get("rope_parameters") or {}
        compress_params = rope_params.get("compress") if isinstance(rope_params.get("compress"), dict) else None
        if compress_params is None and isinstance(d.get("rope_scaling"), dict):
            compress_params = d["rope_scaling"]
        if compress_params and compress_params.get("rope_type", compress_params.get("type")) not in (None, "default"):
            rope_scaling = {k: v for k, v in compress_params.items() if k not in ("rope_theta", "partial_rotary_factor")}
        fields = {k: v for k, v in d.items() if k in known}
        fields.update(layer_types=list(layer_types)[:n], mlp_layer_types=list(mlp_types)[:n],
                      compress_rates=rates, partial_rotary_factor=float(prf), rope_scaling=rope_scaling)
        return cls(**fields)

    @classmethod
    def from_json_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read model config {path}: {exc}") from exc
        return cls.from_hf_dict(raw)

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` body transformers' DeepseekV4Config reads (no quantization fields)."""
        d = dataclasses.asdict(self)
        rope_scaling = d.pop("rope_scaling")
        d.update(architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4",
                 num_key_value_heads=1, hidden_act="silu", attention_bias=False, mlp_bias=False,
                 num_nextn_predict_layers=0)
        compress = {"rope_type": "default", "rope_theta": self.compress_rope_theta,
                    "partial_rotary_factor": self.partial_rotary_factor}
        if rope_scaling:
            compress.update(rope_scaling)
            if compress.get("rope_type") == "yarn":
                compress.setdefault("attention_factor", 1.0)
        d["rope_parameters"] = {
            "main": {"rope_type": "default", "rope_theta": self.rope_theta,
                     "partial_rotary_factor": self.partial_rotary_factor},
            "compress": compress,
        }
        return d
