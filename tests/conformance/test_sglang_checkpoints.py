"""Conformance (e): SGLang 0.5.23's own config and checkpoint readers, and transformers 5.23's `from_pretrained`,
on every checkpoint kind v4rl writes, checked value by value against the model v4rl meant to write.

Kinds: the committed tiny base (`v4rl bootstrap`: FP8 linears + FP4 experts, UE8M0), a BF16 checkpoint, the
weight-update directory a training run hands the rollout engine (FP8 experts, the seed's FP8 repackage),
`v4rl export` from torch_dist (hf-fp8 and hf-bf16), and the DeepSeek-V4-Flash preset's config.json (shape
only, no weights). On each, in one subprocess with SGLang's GPU-only imports stubbed (engines/upstream/stubs.py):
`get_config` (SGLang's registry: DeepSeek-V4 loads as a DeepSeek-V3 config, so only release-format keys
reach it), `ModelConfig` (compress ratios, RoPE dims, window, quantization, FP4-expert flag), `get_quant_config`
(Fp8Config), `try_detect_fp4_experts`, `get_rope_config` + `precompute_freqs_cis` with the arguments
`models/deepseek_v4.py` passes (the RoPE tables SGLang's attention would build), and
`DeepseekV4ForCausalLM.remap_weight_name_to_dpsk_hf_format` on every stored tensor name. Missing keys
silently become V3 defaults there, so every resolved value is compared, not only that it loads.

SGLang's source: engines.upstream.sources.sglang_paths() (the pin of pyproject's `cluster` extra, cached by
setup.sh), or $V4RL_SGLANG_DIR for another SGLang; skipped with the reason when neither is available.

    .venv/bin/python -m pytest tests/conformance/test_sglang_checkpoints.py -q      (~2 min on 2 cores)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from checkpoints.hf import hf_config_dict, load_hf_checkpoint, save_hf_checkpoint
from checkpoints.names import transformers_to_native
from engines.upstream.sources import engine_python
from engines.model.config import ModelConfig
from engines.model.layers import rope_inv_freq
from engines.presets.models import dsv4_flash_model_config, tiny_cpu_model_config
from engines import TINY_BASE
from engines.rollout.launcher import sglang_named_tensors

ASSET = TINY_BASE
FP4_EXPERTS = {"tiny-base": True, "bf16": None, "update-fp8-experts": False, "export-hf-fp8": True,
               "export-hf-bf16": None, "flash-config": None}
"""What SGLang's `try_detect_fp4_experts` must say per kind: True = packed FP4, False = FP8 experts, None = no
quantized routed experts (BF16, or no weights at all)."""

SGLANG_READ = r'''
import json, sys
from sglang.srt.configs.deepseek_v4 import try_detect_fp4_experts
from sglang.srt.configs.load_config import LoadConfig
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_loader.weight_utils import get_quant_config
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.utils.hf_transformers.common import get_rope_config
from sglang.srt.utils.hf_transformers.config import get_config
from sglang.kernels.ops.attention.dsv4.rope import precompute_freqs_cis

KEYS = json.loads(sys.argv[1])
out = {}
for kind, path in json.loads(sys.argv[2]).items():
    hf = get_config(path, trust_remote_code=False)
    rope_theta, scaling = get_rope_config(hf)
    scaling = dict(scaling or {})
    mc = ModelConfig(path, trust_remote_code=False)
    quant = get_quant_config(mc, LoadConfig(), {}) if mc.quantization else None
    # The RoPE tables DeepseekV4Attention builds (models/deepseek_v4.py, __init__): compressed layers use
    # compress_rope_theta with YaRN from rope_scaling, sliding-only layers rope_theta without it.
    angles = {}
    for label, ratio in (("compress", 4), ("main", 0)):
        freqs = precompute_freqs_cis(
            dim=hf.qk_rope_head_dim, seqlen=2, base=hf.compress_rope_theta if ratio else rope_theta,
            original_seq_len=scaling["original_max_position_embeddings"] if ratio else 0,
            factor=scaling.get("factor", 1.0), beta_fast=scaling.get("beta_fast", 32),
            beta_slow=scaling.get("beta_slow", 1))
        angles[label] = freqs[1].angle().tolist()
    names = {}
    index = __import__("pathlib").Path(path) / "model.safetensors.index.json"
    if index.is_file():
        for name in json.loads(index.read_text())["weight_map"]:
            names[name] = DeepseekV4ForCausalLM.remap_weight_name_to_dpsk_hf_format(
                name, is_nextn=False, num_hidden_layers=hf.num_hidden_layers)
    # the wo_a scale's name on v4rl's distributed path (launcher.sglang_named_tensors), where SGLang's remap sends it
    wo_a_wire = DeepseekV4ForCausalLM.remap_weight_name_to_dpsk_hf_format(
        "model.layers.0.self_attn.wo_a.scale", is_nextn=False, num_hidden_layers=hf.num_hidden_layers)
    out[kind] = {
        "wo_a_wire": wo_a_wire,
        "config_class": type(hf).__name__,
        "hf": {k: getattr(hf, k, "<missing>") for k in KEYS},
        "rope_theta": rope_theta, "scaling": {k: scaling.get(k) for k in
                                              ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")},
        "model_config": {"compress_ratios": list(mc.compress_ratios), "qk_rope_head_dim": mc.qk_rope_head_dim,
                         "qk_nope_head_dim": mc.qk_nope_head_dim, "head_dim": mc.head_dim,
                         "window_size": mc.window_size, "index_head_dim": mc.index_head_dim,
                         "quantization": mc.quantization, "is_fp4_experts": mc.is_fp4_experts,
                         "context_len": mc.context_len, "topk_group": mc.hf_config.topk_group,
                         "n_group": mc.hf_config.n_group},
        "quant": None if quant is None else {"class": type(quant).__name__, "block": quant.weight_block_size,
                                             "serialized": quant.is_checkpoint_fp8_serialized},
        "fp4_detected": try_detect_fp4_experts(path),
        "angles": angles,
        "names": names,
    }
print("RESULT " + json.dumps(out, default=str))
'''


def _sglang_values(cfg: ModelConfig) -> dict:
    """What SGLang must resolve for the model cfg: attribute of its HF config -> our value."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": 1, "head_dim": cfg.head_dim, "q_lora_rank": cfg.q_lora_rank,
        "qk_rope_head_dim": cfg.rope_head_dim, "compress_ratios": [cfg.compress_rate(i) for i in range(cfg.num_hidden_layers)],
        "num_hash_layers": cfg.n_hash_layers, "sliding_window": cfg.sliding_window,
        "compress_rope_theta": cfg.compress_rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
        "o_groups": cfg.o_groups, "o_lora_rank": cfg.o_lora_rank, "index_n_heads": cfg.index_n_heads,
        "index_head_dim": cfg.index_head_dim, "index_topk": cfg.index_topk, "n_routed_experts": cfg.n_routed_experts,
        "n_shared_experts": cfg.n_shared_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size, "scoring_func": cfg.scoring_func,
        "routed_scaling_factor": cfg.routed_scaling_factor, "norm_topk_prob": cfg.norm_topk_prob,
        "swiglu_limit": cfg.swiglu_limit, "topk_method": "noaux_tc", "hc_mult": cfg.hc_mult,
        "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps, "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """One directory per checkpoint kind v4rl writes, each made by the writer a user's command runs."""
    from checkpoints.convert import convert_hf_to_torch_dist, export_torch_dist_to_hf
    from engines.train.actors import TrainerWorker
    from engines.train.trainer import TrainerConfig
    from rl.grpo import GRPOConfig

    root = tmp_path_factory.mktemp("kinds")
    cfg, native = load_hf_checkpoint(ASSET)
    dirs = {"tiny-base": ASSET}
    dirs["bf16"] = save_hf_checkpoint(root / "bf16", cfg, native, weight_format="bf16", tokenizer_dir=ASSET)
    TrainerWorker(str(ASSET), TrainerConfig(), GRPOConfig(), str(root / "train-ckpt")).export(str(root / "update"))
    dirs["update-fp8-experts"] = root / "update"
    convert_hf_to_torch_dist(ASSET, root / "torch_dist", workers=1)
    for fmt in ("hf-fp8", "hf-bf16"):
        export_torch_dist_to_hf(root / "torch_dist", root / fmt, fmt=fmt, workers=1)  # type: ignore[arg-type]
        dirs[f"export-{fmt}"] = root / fmt
    flash = root / "flash"
    flash.mkdir()
    (flash / "config.json").write_text(json.dumps(
        hf_config_dict(dsv4_flash_model_config(), weight_format="fp8", expert_dtype="fp4", scale_fmt="ue8m0"),
        indent=2))
    dirs["flash-config"] = flash
    return dirs


@pytest.fixture(scope="module")
def sglang_read(sglang_paths, checkpoints) -> dict:
    keys = sorted(_sglang_values(tiny_cpu_model_config()))
    done = engine_python(SGLANG_READ, sglang_paths, args=[json.dumps(keys), json.dumps(
        {k: str(v) for k, v in checkpoints.items()})], timeout=900)
    line = next(x for x in reversed(done.stdout.splitlines()) if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def _model_of(kind: str) -> ModelConfig:
    return dsv4_flash_model_config() if kind == "flash-config" else tiny_cpu_model_config()


@pytest.mark.parametrize("kind", sorted(FP4_EXPERTS))
def test_sglang_resolves_every_model_value_we_wrote(sglang_read, checkpoints, kind):
    cfg = _model_of(kind)
    assert ModelConfig.from_json_file(checkpoints[kind] / "config.json") == cfg  # we wrote the model we meant
    got = sglang_read[kind]
    assert got["config_class"] == "_DeepseekV4ConfigAlias"  # SGLang's own registry entry, a DeepseekV3Config
    want = _sglang_values(cfg)
    assert {k: got["hf"][k] for k in want} == want
    mc = got["model_config"]
    assert mc["compress_ratios"] == want["compress_ratios"] and set(mc["compress_ratios"]) <= {0, 4, 128}
    assert (mc["qk_rope_head_dim"], mc["qk_nope_head_dim"], mc["head_dim"]) == \
        (cfg.rope_head_dim, cfg.head_dim - cfg.rope_head_dim, cfg.head_dim)
    assert (mc["window_size"], mc["index_head_dim"], mc["context_len"]) == \
        (cfg.sliding_window, cfg.index_head_dim, cfg.max_position_embeddings)
    assert mc["topk_group"] == mc["n_group"]  # ungrouped sqrtsoftplus routing, as ours


@pytest.mark.parametrize("kind", sorted(FP4_EXPERTS))
def test_sglang_rope_tables_equal_ours(sglang_read, kind):
    """SGLang's YaRN parameters are ours, and the RoPE angles its attention would build equal our model's."""
    cfg = _model_of(kind)
    got = sglang_read[kind]
    scaling = cfg.rope_scaling
    assert got["scaling"] == {k: scaling[k] for k in got["scaling"]} and got["scaling"]["factor"] != 1.0
    assert got["rope_theta"] == cfg.rope_theta
    for label in ("compress", "main"):
        theirs = torch.tensor(got["angles"][label], dtype=torch.float64)
        ours = rope_inv_freq(cfg, label).double()
        assert torch.allclose(theirs, ours, rtol=1e-6, atol=0), label


@pytest.mark.parametrize("kind", sorted(FP4_EXPERTS))
def test_sglang_detects_the_storage_we_wrote(sglang_read, checkpoints, kind):
    raw = json.loads((checkpoints[kind] / "config.json").read_text())
    got = sglang_read[kind]
    if "quantization_config" in raw:
        assert got["model_config"]["quantization"] == "fp8"
        assert got["quant"] == {"class": "Fp8Config", "block": [128, 128], "serialized": True}
    else:
        assert got["model_config"]["quantization"] is None and got["quant"] is None
    assert got["fp4_detected"] is FP4_EXPERTS[kind]
    if FP4_EXPERTS[kind] is not None:
        assert got["model_config"]["is_fp4_experts"] is FP4_EXPERTS[kind]


@pytest.mark.parametrize("kind", sorted(set(FP4_EXPERTS) - {"flash-config"}))
def test_sglang_remaps_every_stored_name_to_ours(sglang_read, kind):
    names = sglang_read[kind]["names"]
    assert names, f"{kind}: no tensor names read"
    ours = dict(zip(names, (n for n, _ in sglang_named_tensors((name, None) for name in names))))
    # wo_a's scale keeps `.scale` (SGLANG_OPT_FP8_WO_A_GEMM=0's dequant pre-pass pairs only that name, fused_pairs.py);
    # SGLang's own remap sends it to the same parameter as the stored name
    wo_a = {n for n in names if n.endswith(".wo_a.scale")}
    assert bool(wo_a) == (FP4_EXPERTS[kind] is not None)  # the FP8 kinds store scales
    assert all(ours[n] == names[n].removesuffix("weight_scale_inv") + "scale" for n in wo_a)
    assert sglang_read[kind]["wo_a_wire"] == "model.layers.0.self_attn.wo_a.weight_scale_inv"
    assert {n: v for n, v in names.items() if n not in wo_a} == {n: v for n, v in ours.items() if n not in wo_a}


@pytest.mark.parametrize("kind", sorted(FP4_EXPERTS))
def test_transformers_loads_the_same_directories(checkpoints, kind):
    """transformers 5.23 reads the same model from each config.json, and (with weights) the very tensors ours does."""
    import transformers

    path = checkpoints[kind]
    cfg = _model_of(kind)
    assert ModelConfig.from_hf_dict(transformers.AutoConfig.from_pretrained(path).to_dict()) == cfg
    if kind == "flash-config":
        return
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(path)
    theirs = transformers_to_native(model.state_dict(), cfg)
    _, ours = load_hf_checkpoint(path, out_dtype=torch.float32)
    assert set(theirs) == set(ours)
    mismatched = [n for n, t in theirs.items() if not torch.equal(t, ours[n].to(t.dtype))]
    assert not mismatched, f"{kind}: transformers dequantized {len(mismatched)} tensors differently, e.g. {mismatched[:3]}"
    ids = torch.arange(140).reshape(1, 140) % 90 + 5  # past the 128-token HCA entry
    logits = model(ids).logits
    assert logits.shape == (1, 140, cfg.vocab_size) and bool(torch.isfinite(logits).all())
