"""Pins checkpoints/names.py and checkpoints/hf.py: names round-trip, what lands on disk, what reads back,
that transformers' DeepseekV4ForCausalLM loads our FP8/FP4 checkpoint to the very same tensors, and that
every malformed checkpoint fails with a message naming the file and the tensor.

A tiny random config covers every tensor kind: sliding / CSA / HCA layers, hash-MoE then top-k MoE,
4 routed experts, indexer, grouped output projection.

    .venv/bin/python -m pytest tests/test_hf_checkpoint.py -q        (CPU, ~10 s)
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import checkpoints.hf as hf
from checkpoints.hf import (
    CheckpointError,
    QuantizedTensor,
    encode_tensor,
    load_hf_checkpoint,
    read_raw_tensors,
    save_hf_checkpoint,
)
from checkpoints.names import (
    native_to_sglang_name,
    native_to_transformers,
    native_to_transformers_name,
    sglang_to_native_name,
    transformers_to_native,
    transformers_to_native_name,
)
from engines.model.config import CSA, HASH_MOE, HCA, SLIDING, TOPK_MOE, ModelConfig
from engines.model.params import native_param_specs

NUM_GPUS = 0


def tiny_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=64, hidden_size=128, num_hidden_layers=4, num_attention_heads=2, head_dim=64,
        q_lora_rank=64, partial_rotary_factor=0.25, layer_types=[SLIDING, CSA, HCA, CSA],
        mlp_layer_types=[HASH_MOE, HASH_MOE, TOPK_MOE, TOPK_MOE],
        compress_rates={CSA: 4, HCA: 128}, sliding_window=8, o_groups=2, o_lora_rank=64,
        index_n_heads=2, index_head_dim=64, index_topk=4, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=128,
    )


def random_state(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every native tensor random and non-zero (sinks, ape, hc bases, tid2eid as random expert ids)."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, spec in native_param_specs(cfg).items():
        if spec.kind == "int64":
            state[name] = torch.randint(0, cfg.n_routed_experts, spec.shape, generator=g)
        else:
            state[name] = torch.randn(spec.shape, generator=g) * 0.05 + 0.01
    return state


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return tiny_config()


@pytest.fixture(scope="module")
def state(cfg) -> dict[str, torch.Tensor]:
    return random_state(cfg)


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory, cfg, state) -> Path:
    return save_hf_checkpoint(tmp_path_factory.mktemp("fp8") / "ckpt", cfg, state, max_shard_bytes=150_000)


def _expected(state, specs, **fmt) -> dict[str, torch.Tensor]:
    """What a load must return: each tensor encoded as the writer encodes it, then dequantized, fp32."""
    out = {}
    for name, spec in specs.items():
        group = dict(encode_tensor(name, state[name], spec.kind, **fmt))
        t = group[name]
        if len(group) == 2:
            t = QuantizedTensor(t, group[hf.scale_name(name)], "fp4" if t.dtype == torch.int8 else "fp8",
                                (1, 32) if t.dtype == torch.int8 else (128, 128)).dequantize(torch.float32)
        out[name] = t if spec.kind == "int64" else t.float()
    return out


def _disk(ckpt: Path) -> dict[str, tuple[str, torch.Tensor]]:
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: (f.name, h.get_tensor(k)) for k in h.keys()})
    return out


def _rewrite(src: Path, dst: Path, fn: Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]) -> Path:
    """Copy a checkpoint, passing every tensor through fn (rename / drop / replace), index kept in step."""
    dst.mkdir()
    weight_map = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            tensors = dict(pair for k in h.keys() for pair in fn(k, h.get_tensor(k)))
        save_file(tensors, str(dst / f.name), metadata={"format": "pt"})
        weight_map.update({k: f.name for k in tensors})
    (dst / hf.INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


# ============================================================================================== names
def test_names_round_trip_native_transformers_on_arange(cfg):
    specs = native_param_specs(cfg)
    offset, native = 0, {}
    for name, spec in specs.items():
        n = torch.Size(spec.shape).numel()
        native[name] = torch.arange(offset, offset + n, dtype=torch.float64).reshape(spec.shape)
        offset += n
    tf = native_to_transformers(native, cfg)
    back = transformers_to_native(tf, cfg)
    assert list(sorted(back)) == list(sorted(native))
    assert all(torch.equal(back[k], native[k]) for k in native)
    # fusion layout: gate_up_proj[e] = cat(w1_e, w3_e), down_proj[e] = w2_e
    gu, down = tf["model.layers.2.mlp.experts.gate_up_proj"], tf["model.layers.2.mlp.experts.down_proj"]
    assert tuple(gu.shape) == (4, 256, 128) and tuple(down.shape) == (4, 128, 128)
    assert torch.equal(gu[3, :128], native["layers.2.ffn.experts.3.w1.weight"])
    assert torch.equal(gu[3, 128:], native["layers.2.ffn.experts.3.w3.weight"])
    assert torch.equal(down[1], native["layers.2.ffn.experts.1.w2.weight"])


def test_transformers_names_are_the_models_state_dict(cfg):
    import transformers

    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**cfg.to_hf_dict()))
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    ours = {k: tuple(v.shape) for k, v in native_to_transformers(random_state(cfg), cfg).items()}
    assert ours == theirs


def test_sglang_names_round_trip(cfg):
    for name in native_param_specs(cfg):
        assert sglang_to_native_name(native_to_sglang_name(name)) == name
    assert native_to_sglang_name("layers.1.ffn.experts.2.w3.weight") == "model.layers.1.mlp.experts.2.up_proj.weight"
    assert native_to_sglang_name("layers.0.ffn.gate.tid2eid") == "model.layers.0.mlp.topk.tid2eid"
    assert native_to_transformers_name("layers.1.attn.indexer.compressor.ape") == \
        "model.layers.1.self_attn.compressor.indexer.position_bias"


def test_unknown_names_fail_loudly(cfg):
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.bogus\.weight"):
        native_to_transformers({"layers.0.attn.bogus.weight": torch.zeros(1)}, cfg)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.nope"):
        transformers_to_native({"model.layers.0.self_attn.nope": torch.zeros(1)}, cfg)
    with pytest.raises(ValueError, match=r"layers\.0\.ffn\.experts\.3\.w1\.weight is missing"):
        native_to_transformers({f"layers.0.ffn.experts.{e}.w1.weight": torch.zeros(2, 2) for e in range(3)}, cfg)
    with pytest.raises(ValueError, match="fused"):
        native_to_transformers_name("layers.0.ffn.experts.0.w1.weight")
    with pytest.raises(ValueError, match="fused"):
        transformers_to_native_name("model.layers.0.mlp.experts.gate_up_proj")


# ============================================================================================== save / load
def test_fp8_fp4_on_disk_layout(fp8_dir, cfg, state):
    disk = _disk(fp8_dir)
    conf = json.loads((fp8_dir / "config.json").read_text())
    assert conf["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                           "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    assert conf["expert_dtype"] == "fp4" and conf["dtype"] == "bfloat16"
    assert ModelConfig.from_hf_dict(conf) == cfg
    expect = {
        "layers.1.attn.wq_a.weight": (torch.float8_e4m3fn, (64, 128)),
        "layers.1.attn.wq_a.scale": (torch.float8_e8m0fnu, (1, 1)),
        "layers.1.ffn.experts.3.w2.weight": (torch.int8, (128, 64)),
        "layers.1.ffn.experts.3.w2.scale": (torch.float8_e8m0fnu, (128, 4)),
        "layers.1.ffn.shared_experts.w1.scale": (torch.float8_e8m0fnu, (1, 1)),
        "layers.1.attn.compressor.wkv.weight": (torch.bfloat16, (128, 128)),
        "layers.1.attn.indexer.weights_proj.weight": (torch.bfloat16, (2, 128)),
        "layers.1.attn.attn_sink": (torch.float32, (2,)),
        "layers.1.hc_attn_base": (torch.float32, (24,)),
        "layers.0.ffn.gate.tid2eid": (torch.int64, (64, 2)),
        "layers.2.ffn.gate.bias": (torch.float32, (4,)),
        "embed.weight": (torch.bfloat16, (64, 128)),
    }
    for name, (dtype, shape) in expect.items():
        assert (disk[name][1].dtype, tuple(disk[name][1].shape)) == (dtype, shape), name
    index = json.loads((fp8_dir / hf.INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(disk)
    assert all(index["weight_map"][k] == f for k, (f, _) in disk.items())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for _, t in disk.values())
    shards = sorted(p.name for p in fp8_dir.glob("*.safetensors"))
    assert len(shards) > 1 and shards[-1] == f"model-{len(shards):05d}-of-{len(shards):05d}.safetensors"
    for k, (f, _) in disk.items():  # a scale always sits in its weight's shard
        if k.endswith(".scale"):
            assert disk[k[: -len(".scale")] + ".weight"][0] == f
    assert json.loads((fp8_dir / "generation_config.json").read_text()) == {"bos_token_id": 0, "eos_token_id": 1}
    assert not list(fp8_dir.parent.glob(".*partial*"))


@pytest.mark.parametrize("fmt", [
    dict(weight_format="fp8", expert_dtype="fp4", scale_fmt="ue8m0"),
    dict(weight_format="fp8", expert_dtype="fp8", scale_fmt="ue8m0"),
    dict(weight_format="fp8", expert_dtype="fp4", scale_fmt="fp32"),
    dict(weight_format="bf16"),
    dict(weight_format="fp32"),
], ids=["fp8-fp4", "fp8-fp8experts", "fp8-fp32scales", "bf16", "fp32"])
def test_save_load_round_trip(tmp_path, cfg, state, fmt):
    ckpt = save_hf_checkpoint(tmp_path / "ckpt", cfg, state, **fmt)
    cfg2, loaded = load_hf_checkpoint(ckpt)
    assert cfg2 == cfg
    specs = native_param_specs(cfg)
    expected = _expected(state, specs, **fmt)
    assert list(loaded) == list(specs)
    for name in specs:
        assert loaded[name].dtype == expected[name].dtype and torch.equal(loaded[name], expected[name]), name
    conf = json.loads((ckpt / "config.json").read_text())
    disk = _disk(ckpt)
    if fmt["weight_format"] == "fp8":
        assert conf["expert_dtype"] == fmt["expert_dtype"]
        assert ("scale_fmt" in conf["quantization_config"]) == (fmt["scale_fmt"] == "ue8m0")
        expert, expert_scale = disk["layers.3.ffn.experts.0.w1.weight"][1], disk["layers.3.ffn.experts.0.w1.scale"][1]
        if fmt["expert_dtype"] == "fp8":
            assert expert.dtype == torch.float8_e4m3fn and tuple(expert_scale.shape) == (1, 1)
        if fmt["scale_fmt"] == "fp32":
            assert disk["layers.0.attn.wo_b.scale"][1].dtype == torch.float32
            assert expert_scale.dtype == torch.float8_e8m0fnu  # MXFP4 scales are always UE8M0
    else:
        assert "quantization_config" not in conf and "expert_dtype" not in conf
        assert not any(k.endswith(".scale") for k in disk)
        assert conf["dtype"] == ("float32" if fmt["weight_format"] == "fp32" else "bfloat16")
        if fmt["weight_format"] == "fp32":
            assert all(torch.equal(loaded[n], state[n]) for n in specs)


def test_raw_reader_keeps_weights_quantized(fp8_dir, cfg):
    raw = read_raw_tensors(fp8_dir)
    _, loaded = load_hf_checkpoint(fp8_dir, out_dtype=torch.bfloat16)
    wq = raw["layers.0.attn.wq_a.weight"]
    assert isinstance(wq, QuantizedTensor) and wq.kind == "fp8" and wq.block == (128, 128) and wq.shape == (64, 128)
    ex = raw["layers.0.ffn.experts.1.w2.weight"]
    assert isinstance(ex, QuantizedTensor) and ex.kind == "fp4" and ex.data.dtype == torch.int8
    assert ex.shape == (128, 128)
    assert isinstance(raw["layers.0.ffn.gate.tid2eid"], torch.Tensor)
    for name, t in raw.items():
        deq = t.dequantize(torch.bfloat16) if isinstance(t, QuantizedTensor) else t
        if deq.dtype.is_floating_point:
            deq = deq.to(torch.bfloat16)
        assert torch.equal(deq, loaded[name]), name


def test_renamed_forms_read_the_same(tmp_path, fp8_dir):
    """`weight_scale_inv` scales, uint8 exponent bytes, SGLang/Miles names, and a stray mtp tensor."""
    _, reference = load_hf_checkpoint(fp8_dir)

    def hf_style(k: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if k.endswith(".scale"):
            as_bytes = t.view(torch.uint8) if t.dtype == torch.float8_e8m0fnu else t  # MXFP8-style exponent bytes
            return [(k[: -len(".scale")] + ".weight_scale_inv", as_bytes)]
        return [(k, t)] + ([("mtp.0.emb.tok_emb.weight", torch.zeros(2, 2))] if k == "embed.weight" else [])

    def sglang_style(k: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if k.endswith(".scale"):
            return [(native_to_sglang_name(k[: -len(".scale")] + ".weight") + "_scale_inv", t)]
        return [(native_to_sglang_name(k), t)]

    for name, fn in [("hf", hf_style), ("sglang", sglang_style)]:
        ckpt = _rewrite(fp8_dir, tmp_path / name, fn)
        _, loaded = load_hf_checkpoint(ckpt)
        assert list(loaded) == list(reference)
        assert all(torch.equal(loaded[k], reference[k]) for k in reference), name


def test_tokenizer_and_generation_config_are_written(tmp_path, cfg, state):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"version": "1.0"}')
    (tok / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    (tok / "unrelated.bin").write_bytes(b"x")
    ckpt = save_hf_checkpoint(tmp_path / "ckpt", cfg, state, weight_format="bf16", tokenizer_dir=tok,
                              generation_config={"temperature": 0.7, "eos_token_id": [1, 2]})
    assert (ckpt / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert (ckpt / "tokenizer_config.json").exists() and not (ckpt / "unrelated.bin").exists()
    assert json.loads((ckpt / "generation_config.json").read_text()) == \
        {"bos_token_id": 0, "eos_token_id": [1, 2], "temperature": 0.7}
    with pytest.raises(CheckpointError, match="tokenizer_dir"):
        save_hf_checkpoint(tmp_path / "other", cfg, state, tokenizer_dir=tmp_path / "ckpt" / "nothing")


# ============================================================================================== transformers
def test_transformers_loads_what_we_write(fp8_dir, cfg):
    """from_pretrained dequantizes our FP8/FP4 checkpoint on CPU to exactly what load_hf_checkpoint returns."""
    import transformers

    model = transformers.DeepseekV4ForCausalLM.from_pretrained(fp8_dir)
    theirs = transformers_to_native(model.state_dict(), cfg)
    _, ours = load_hf_checkpoint(fp8_dir, out_dtype=torch.float32)
    assert set(theirs) == set(ours)
    for name, t in theirs.items():
        assert torch.equal(t, ours[name].to(t.dtype)), name
    tid2eid = theirs["layers.0.ffn.gate.tid2eid"]
    assert tid2eid.dtype == torch.int64 and bool(tid2eid.any())  # loaded, not left at its zero init
    assert theirs["layers.1.attn.wq_a.weight"].dtype == torch.bfloat16  # "dtype": "bfloat16" in config.json
    assert theirs["layers.1.hc_attn_fn"].dtype == torch.float32  # transformers keeps mHC, sinks, ape in fp32
    logits = model(torch.arange(12).reshape(1, 12) % cfg.vocab_size).logits
    assert logits.shape == (1, 12, cfg.vocab_size) and bool(torch.isfinite(logits).all())


# ============================================================================================== bad input
def _tamper(tmp_path: Path, fp8_dir: Path, fn) -> Path:
    return _rewrite(fp8_dir, tmp_path / "bad", fn)


def _shard_of(ckpt: Path, name: str) -> str:
    return json.loads((ckpt / hf.INDEX_FILE).read_text())["weight_map"][name]


def test_unknown_tensor_names_file_and_tensor(tmp_path, fp8_dir):
    bad = _tamper(tmp_path, fp8_dir, lambda k, t: [(k, t)] + ([("layers.0.attn.bogus.weight", t.clone())]
                                                              if k == "layers.0.attn.wq_a.weight" else []))
    with pytest.raises(CheckpointError, match=r"bogus") as e:
        load_hf_checkpoint(bad)
    assert _shard_of(bad, "layers.0.attn.bogus.weight") in str(e.value)
    bad2 = _rewrite(fp8_dir, tmp_path / "bad2",
                    lambda k, t: [("model.layers.0.mystery", t) if k == "embed.weight" else (k, t)])
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mystery") as e:
        load_hf_checkpoint(bad2)
    assert _shard_of(bad2, "model.layers.0.mystery") in str(e.value)


def test_missing_tensor_names_index_and_tensor(tmp_path, fp8_dir):
    bad = _tamper(tmp_path, fp8_dir, lambda k, t: [] if k.startswith("layers.2.attn.wkv.") else [(k, t)])
    with pytest.raises(CheckpointError, match=r"missing tensor 'layers\.2\.attn\.wkv\.weight'") as e:
        load_hf_checkpoint(bad)
    assert hf.INDEX_FILE in str(e.value)


def test_quantized_weight_without_scale(tmp_path, fp8_dir):
    bad = _tamper(tmp_path, fp8_dir, lambda k, t: [] if k == "layers.1.attn.wq_b.scale" else [(k, t)])
    with pytest.raises(CheckpointError, match=r"layers\.1\.attn\.wq_b\.weight.*no scale") as e:
        load_hf_checkpoint(bad)
    assert _shard_of(bad, "layers.1.attn.wq_b.weight") in str(e.value)


@pytest.mark.parametrize("case", ["shape", "dtype", "fp4-shape"])
def test_scale_of_wrong_shape_or_dtype(tmp_path, fp8_dir, case):
    target = "layers.3.ffn.experts.2.w1.scale" if case == "fp4-shape" else "layers.2.attn.wo_b.scale"
    replace = {"shape": torch.ones(2, 2), "dtype": torch.ones(1, 1, dtype=torch.float16),
               "fp4-shape": torch.ones(128, 8)}[case]
    bad = _tamper(tmp_path, fp8_dir, lambda k, t: [(k, replace if k == target else t)])
    with pytest.raises(CheckpointError, match=re.escape(f"scale of '{target[:-len('.scale')]}.weight'")) as e:
        load_hf_checkpoint(bad)
    assert _shard_of(bad, target) in str(e.value)
    assert ("float16" if case == "dtype" else "needs") in str(e.value)


def test_truncated_shard(tmp_path, fp8_dir):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(fp8_dir, bad)
    shard = bad / _shard_of(bad, "layers.1.attn.wq_a.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="re-download or re-export") as e:
        load_hf_checkpoint(bad)
    assert shard.name in str(e.value)


def test_index_points_to_missing_shard(tmp_path, fp8_dir):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(fp8_dir, bad)
    shard = _shard_of(bad, "head.weight")
    (bad / shard).unlink()
    with pytest.raises(CheckpointError, match=shard) as e:
        load_hf_checkpoint(bad)
    assert hf.INDEX_FILE in str(e.value) and "tensor '" in str(e.value)


def test_writer_refuses_bad_state(tmp_path, cfg, state):
    partial = {k: v for k, v in state.items() if k != "layers.3.attn.wo_a.weight"}
    with pytest.raises(CheckpointError, match=r"missing tensor 'layers\.3\.attn\.wo_a\.weight'"):
        save_hf_checkpoint(tmp_path / "a", cfg, partial)
    with pytest.raises(CheckpointError, match=r"unknown tensor 'layers\.9\.attn_norm\.weight'"):
        save_hf_checkpoint(tmp_path / "b", cfg, {**state, "layers.9.attn_norm.weight": torch.ones(128)})
    with pytest.raises(CheckpointError, match=r"'embed\.weight'.*shape \(64, 64\)"):
        save_hf_checkpoint(tmp_path / "c", cfg, {**state, "embed.weight": torch.ones(64, 64)})
    assert not list(tmp_path.iterdir())


# ============================================================================================== atomicity
def test_failure_mid_save_leaves_no_directory(tmp_path, cfg, state, monkeypatch):
    calls = {"n": 0}
    real = hf.save_file

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full (injected)")
        return real(*args, **kwargs)

    monkeypatch.setattr(hf, "save_file", flaky)
    with pytest.raises(OSError, match="injected"):
        save_hf_checkpoint(tmp_path / "ckpt", cfg, state, max_shard_bytes=150_000)
    assert calls["n"] == 3
    assert list(tmp_path.iterdir()) == []


def test_existing_directory_needs_overwrite(tmp_path, cfg, state):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    with pytest.raises(CheckpointError, match="overwrite=True"):
        save_hf_checkpoint(out, cfg, state, weight_format="bf16")
    save_hf_checkpoint(out, cfg, state, weight_format="bf16", overwrite=True)
    assert not (out / "stale.txt").exists() and (out / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
