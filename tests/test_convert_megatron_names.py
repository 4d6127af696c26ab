"""The converter writes the Megatron names of the Miles generation asked for, and readers take both.

HF (BF16, every mHC scale and tid2eid distinct, so an alpha order or table misplacement shows) -> torch_dist under
Megatron's names (Miles e9e19b223's model): the stored key set is the name table's (134 keys for this tiny model,
plugin names + 4 per layer), each alpha holds its block of the packed scale (pre, post, res), tid2eid is int32
`[vocab, topk]`, common.pt records the names; `verify_torch_dist` (names, shapes, dtypes, values vs the source)
fails on a renamed key, swapped alphas and an int64 or mis-shaped tid2eid planted into such a checkpoint;
-> HF BF16 reproduces the source, and align's megatron-core reader returns it under native names; the CLI picks the names from `--miles-dir` (detected from the tree's code) or
`--megatron-names`, plugin by default.

    .venv/bin/python -m pytest tests/test_convert_megatron_names.py -q        (CPU, ~40 s on 2 cores)
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from checkpoints.convert import convert_hf_to_torch_dist, export_torch_dist_to_hf, verify_torch_dist
from checkpoints.hf import load_hf_checkpoint, save_hf_checkpoint
from checkpoints.names import native_to_megatron
from checkpoints.torch_dist import (
    Box,
    ChunkFileWriter,
    TensorSpec,
    TorchDistError,
    TorchDistReader,
    mark_release,
    megatron_specs,
    read_common,
    read_dcp_metadata,
    write_checkpointing_config,
    write_common,
    write_dcp_metadata,
)
from engines.model.config import ModelConfig
from engines.model.params import native_param_specs
from engines.presets.models import tiny_cpu_model_config

NUM_GPUS = 0
ALPHAS = ("alpha_pre", "alpha_post", "alpha_res")


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return tiny_cpu_model_config()


@pytest.fixture(scope="module")
def native(cfg) -> dict[str, torch.Tensor]:
    """Random weights where no two values of a tensor repeat: constant mHC scales would hide an alpha swap."""
    g = torch.Generator().manual_seed(7)
    out = {}
    for name, spec in native_param_specs(cfg).items():
        if spec.kind == "int64":
            out[name] = torch.randint(0, cfg.n_routed_experts, spec.shape, generator=g, dtype=torch.int64)
        else:
            out[name] = (torch.randn(spec.shape, generator=g) * 0.05).to(torch.bfloat16).float() \
                if spec.kind != "fp32" else torch.randn(spec.shape, generator=g)
    return out


@pytest.fixture(scope="module")
def hf_bf16(tmp_path_factory, cfg, native) -> Path:
    return save_hf_checkpoint(tmp_path_factory.mktemp("hf") / "bf16", cfg, native, weight_format="bf16")


@pytest.fixture(scope="module")
def gen2(tmp_path_factory, hf_bf16) -> Path:
    dst = tmp_path_factory.mktemp("td") / "gen2"
    convert_hf_to_torch_dist(hf_bf16, dst, workers=2, megatron_names="megatron", verify="none")
    return dst


def test_converter_writes_the_second_generation_names(gen2, cfg, native):
    reader = TorchDistReader(gen2)
    want = megatron_specs(cfg, "megatron")
    assert {k: (tuple(v.size), v.properties.dtype) for k, v in reader.tensors.items()} == {
        k: (s.shape, s.dtype) for k, s in want.items()}
    assert len(want) == len(megatron_specs(cfg, "plugin")) + 4 * cfg.num_hidden_layers
    assert "decoder.layers.0.self_attention.linear_o_group_proj" in want and "decoder.hc_head_fn" in want
    assert not [k for k in want if any(old in k for old in (".wq_a.", ".wo_a.", "hc_attn_fn", "hc_head_params"))]
    for i in range(cfg.num_hidden_layers):
        for site, hc in (("attn", "self_attention_hyper_connection"), ("ffn", "mlp_hyper_connection")):
            scale = native[f"layers.{i}.hc_{site}_scale"]
            assert len(set(scale.tolist())) == 3
            for k, alpha in enumerate(ALPHAS):  # pre, post, res: DeepSeek's packed order
                got = reader.read(Box(f"decoder.layers.{i}.{hc}.{alpha}", (0,), (1,)))
                assert got.dtype == torch.float32 and torch.equal(got, scale[k:k + 1]), (i, site, alpha)
    hashed = [n for n in native if n.endswith("tid2eid")]
    assert hashed
    for name in hashed:
        i = name.split(".")[1]
        key = f"decoder.layers.{i}.mlp.router.tid2eid"
        t = reader.read(Box(key, (0, 0), (cfg.vocab_size, cfg.num_experts_per_tok)))
        assert t.dtype == torch.int32 and torch.equal(t.long(), native[name])
    assert read_common(reader.dir)["v4rl"]["megatron_names"] == "megatron"


def test_round_trip_hf_to_gen2_to_hf_is_exact(gen2, tmp_path, cfg, native, hf_bf16):
    out = export_torch_dist_to_hf(gen2, tmp_path / "back", fmt="hf-bf16", workers=1)
    assert not out.skipped
    _, back = load_hf_checkpoint(tmp_path / "back", dequantize=True, out_dtype=torch.float32)
    source_cfg, source = load_hf_checkpoint(hf_bf16, dequantize=True, out_dtype=torch.float32)
    assert source_cfg == cfg and sorted(back) == sorted(source)
    for name, t in source.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    from engines.align.inputs import load_torch_dist  # what align and the trainer read: megatron-core, native names

    weights = load_torch_dist(gen2, cfg)
    assert weights["layers.0.ffn.gate.tid2eid"].dtype == torch.int64  # int32 on disk, int64 to index with
    assert all(torch.equal(weights[n], source[n].to(weights[n].dtype)) for n in source)


def _write_planted(root: Path, cfg: ModelConfig, native: dict[str, torch.Tensor], *, rename: dict | None = None,
                   swap_alphas: bool = False, tid2eid: torch.Tensor | None = None) -> Path:
    """A release checkpoint in Megatron's names with one planted fault (the same writer calls the converter uses)."""
    rename = rename or {}
    meg = native_to_megatron(native, cfg, "megatron")
    specs = megatron_specs(cfg, "megatron")
    if swap_alphas:
        pre, res = "decoder.layers.1.mlp_hyper_connection.alpha_pre", "decoder.layers.1.mlp_hyper_connection.alpha_res"
        meg[pre], meg[res] = meg[res], meg[pre]
    if tid2eid is not None:
        key = "decoder.layers.0.mlp.router.tid2eid"
        meg[key] = tid2eid
        specs[key] = TensorSpec(tuple(tid2eid.shape), tid2eid.dtype)
    rel = root / "release"
    rel.mkdir(parents=True)
    with ChunkFileWriter(rel / "__0_0.distcp") as w:
        for key, t in meg.items():
            spec = specs[key]
            w.append(rename.get(key, key), (0,) * len(spec.shape), t.to(spec.dtype).contiguous())
    write_dcp_metadata(rel, w.records, {rename.get(k, k): s for k, s in specs.items()})
    write_common(rel, cfg, hf_config=cfg.to_hf_dict(), names="megatron")
    write_checkpointing_config(rel)
    mark_release(root)
    return root


def test_verify_fails_on_planted_name_alpha_and_tid2eid_faults(tmp_path, cfg, native, hf_bf16, gen2):
    report = verify_torch_dist(gen2, against=hf_bf16)  # the converter's own output: every value as the source
    assert report.compared == len(native) and report.tensors == len(megatron_specs(cfg, "megatron"))
    clean = _write_planted(tmp_path / "clean", cfg, native)
    assert verify_torch_dist(clean, against=hf_bf16).compared == len(native)  # the writer itself is right
    old = "decoder.layers.2.self_attention.core_attention.compressor.ape"
    renamed = _write_planted(tmp_path / "renamed", cfg, native, rename={old: old.replace(".ape", ".position_bias")})
    with pytest.raises(TorchDistError, match=r"missing tensor '.*core_attention\.compressor\.ape'"):
        verify_torch_dist(renamed, against=hf_bf16)
    swapped = _write_planted(tmp_path / "swapped", cfg, native, swap_alphas=True)
    with pytest.raises(Exception, match=r"mlp_hyper_connection\.alpha_(pre|res)'.*differs from .*layers\.1\.hc_ffn_scale"):
        verify_torch_dist(swapped, against=hf_bf16)
    t = native["layers.0.ffn.gate.tid2eid"]
    wide = _write_planted(tmp_path / "int64", cfg, native, tid2eid=t.to(torch.int64))
    with pytest.raises(TorchDistError, match=r"router\.tid2eid' is torch\.int64 .*expects torch\.int32"):
        verify_torch_dist(wide, against=hf_bf16)
    transposed = _write_planted(tmp_path / "shape", cfg, native, tid2eid=t.t().contiguous().to(torch.int32))
    with pytest.raises(TorchDistError, match=rf"router\.tid2eid' is torch\.int32 .*\({t.shape[1]}, {t.shape[0]}\)"):
        verify_torch_dist(transposed, against=hf_bf16)


def test_export_reads_plugin_names_too_and_refuses_a_mix(tmp_path, cfg, native, hf_bf16, gen2):
    gen1 = tmp_path / "gen1"
    convert_hf_to_torch_dist(hf_bf16, gen1, workers=1, verify="none")  # default: plugin names, as before
    assert set(TorchDistReader(gen1).tensors) == set(megatron_specs(cfg, "plugin"))
    assert read_common(TorchDistReader(gen1).dir)["v4rl"]["megatron_names"] == "plugin"
    mixed = tmp_path / "mixed"
    shutil.copytree(gen2, mixed)
    md_path = mixed / "release" / ".metadata"
    md = read_dcp_metadata(md_path.parent)
    old, new = "decoder.layers.0.self_attention.linear_q_down_proj.weight", "decoder.layers.0.self_attention.wq_a.weight"
    md.state_dict_metadata[new] = md.state_dict_metadata.pop(old)
    md_path.write_bytes(pickle.dumps(md))
    with pytest.raises(TorchDistError, match=r"mixes Miles' plugin names \(e\.g\. '.*wq_a\.weight'\)"):
        export_torch_dist_to_hf(mixed, tmp_path / "out", fmt="hf-bf16", workers=1)


def _cli(*args: str) -> tuple[int, str]:
    import typer

    from v4rl import cmd_convert

    app = typer.Typer()
    cmd_convert.register(app)
    result = CliRunner().invoke(app, [*map(str, args), "--no-progress", "--verify", "none", "--workers", "1"],
                                env={"V4RL_MILES_DIR": ""})
    return result.exit_code, result.output


def _fake_miles(root: Path, generation: int) -> Path:
    """The two files generation detection reads, as each generation's Miles has them (the lines it keys on)."""
    plugin = root / "miles_plugins" / "models" / "deepseek_v4"
    plugin.mkdir(parents=True)
    if generation == 1:
        (plugin / "deepseek_v4.py").write_text("class DeepSeekV4Attention:\n    def __init__(self):\n"
                                               "        self.wq_a = TELinear()\n")
    else:
        (plugin / "deepseek_v4.py").write_text("class DeepSeekV4Attention:\n    def __init__(self):\n"
                                               "        self.linear_q_down_proj = TELinear()\n")
        (plugin / "arguments.py").write_text('group.add_argument(\n    "--dsv4-impl",\n    type=str,\n'
                                             '    choices=["miles", "megatron"],\n)\n'
                                             "def assert_checkpoint_is_current(load_dir):\n    pass\n")
    return root


def test_cli_picks_names_from_miles_dir_or_flag(tmp_path, hf_bf16, cfg):
    code, out = _cli("convert", hf_bf16, tmp_path / "a", "--miles-dir", _fake_miles(tmp_path / "m2", 2))
    assert code == 0, out
    assert "Megatron names: megatron (Miles DeepSeek-V4 generation 2" in out
    assert set(TorchDistReader(tmp_path / "a").tensors) == set(megatron_specs(cfg, "megatron"))
    code, out = _cli("convert", hf_bf16, tmp_path / "b", "--miles-dir", _fake_miles(tmp_path / "m1", 1),
                     "--megatron-names", "megatron")
    assert code == 0 and "Megatron names: megatron (--megatron-names megatron)" in out, out
    code, out = _cli("convert", hf_bf16, tmp_path / "c", "--miles-dir", tmp_path / "m1")
    assert code == 0 and "Megatron names: plugin (Miles DeepSeek-V4 generation 1" in out, out
    code, out = _cli("convert", hf_bf16, tmp_path / "d", "--megatron-names", "mcore")
    assert code == 1 and "--megatron-names must be plugin or megatron; got 'mcore'" in out, out
    code, out = _cli("convert", hf_bf16, tmp_path / "e", "--miles-dir", tmp_path / "nowhere")
    assert code == 1 and "does not exist; point it at your Miles checkout" in out, out
