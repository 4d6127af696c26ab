"""Pins checkpoints/torch_dist.py: what we write is a torch_dist directory that megatron-core and plain
torch.distributed.checkpoint both load to the very tensors we wrote, under any chunking, with the
Megatron args a launcher needs in common.pt; malformed directories fail naming the file and the key.

Uses a one-rank gloo group on loopback (megatron-core's `load` needs one), created and destroyed per call.

    .venv/bin/python -m pytest tests/test_torch_dist.py -q        (CPU, ~10 s; imports megatron-core)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from checkpoints.names import native_to_megatron, placement
from checkpoints.megatron_io import megatron_load, megatron_tensor_metadata, single_rank_process_group
from checkpoints.torch_dist import (
    CHECKPOINTING_CONFIG,
    TORCH_DIST_DTYPES,
    Box,
    ChunkFileWriter,
    ChunkRecord,
    TorchDistError,
    TorchDistReader,
    check_storage_bounds,
    mark_release,
    megatron_specs,
    read_common,
    resolve_iteration_dir,
    write_checkpointing_config,
    write_common,
    write_dcp_metadata,
)
from engines.model.params import native_param_specs
from engines.presets.models import tiny_cpu_model_config

NUM_GPUS = 0
SPLIT_KEY = "embedding.word_embeddings.weight"
"""Written as three uneven row chunks, the way a TP-sharded Megatron save stores it."""


@pytest.fixture(scope="module")
def cfg():
    return tiny_cpu_model_config()


@pytest.fixture(scope="module")
def native(cfg) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, spec in native_param_specs(cfg).items():
        dtype = TORCH_DIST_DTYPES[spec.kind]
        out[name] = (torch.randint(0, cfg.n_routed_experts, spec.shape, generator=g, dtype=dtype)
                     if not dtype.is_floating_point
                     else torch.randn(spec.shape, generator=g).to(dtype))
    return out


def write_checkpoint(root: Path, cfg, native) -> list[ChunkRecord]:
    rel = root / "release"
    rel.mkdir(parents=True)
    with ChunkFileWriter(rel / "__0_0.distcp") as a, ChunkFileWriter(rel / "__0_1.distcp") as b:
        for i, (name, t) in enumerate(native.items()):
            p = placement(name, tuple(t.shape), "megatron", cfg.n_routed_experts)
            if p.name == SPLIT_KEY:
                for lo, hi in ((0, 30), (30, 31), (31, t.shape[0])):
                    a.append(p.name, (lo, 0), t[lo:hi])
                continue
            (a if i % 2 else b).append(p.name, p.offsets, t.reshape(p.sizes))
    records = a.records + b.records
    write_dcp_metadata(rel, records, megatron_specs(cfg))
    write_common(rel, cfg, hf_config=cfg.to_hf_dict())
    write_checkpointing_config(rel)
    mark_release(root)
    return records


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, cfg, native) -> Path:
    root = tmp_path_factory.mktemp("td") / "ckpt"
    write_checkpoint(root, cfg, native)
    return root


def test_layout_on_disk(ckpt):
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "release"
    rel = ckpt / "release"
    assert sorted(p.name for p in rel.iterdir()) == [".metadata", "__0_0.distcp", "__0_1.distcp", "common.pt",
                                                     "metadata.json"]
    assert json.loads((rel / "metadata.json").read_text()) == CHECKPOINTING_CONFIG
    assert resolve_iteration_dir(ckpt) == rel and resolve_iteration_dir(rel) == rel


def test_megatron_core_loads_what_we_wrote(ckpt, cfg, native):
    want = native_to_megatron(native, cfg)
    specs = megatron_specs(cfg)
    meta = megatron_tensor_metadata(ckpt)  # dist_checkpointing.load_tensors_metadata
    assert meta == specs
    keys = list(specs)
    with single_rank_process_group():
        got = megatron_load(ckpt, [Box(k, (0,) * len(specs[k].shape), specs[k].shape) for k in keys], specs)
        fc1 = "decoder.layers.3.mlp.experts.experts.linear_fc1.weight"
        frag = megatron_load(ckpt, [Box(fc1, (6, 0, 0), (2, *specs[fc1].shape[1:])),
                                    Box(SPLIT_KEY, (29, 0), (29, cfg.hidden_size))], specs)
    for k, t in zip(keys, got):
        assert t.dtype == want[k].dtype and torch.equal(t, want[k]), k
    assert torch.equal(frag[0], want[fc1][6:8])  # an expert-parallel style fragment (0, 3, 4)
    assert torch.equal(frag[1], want[SPLIT_KEY][29:58])  # spans three stored chunks


def test_plain_dcp_and_our_reader_load_it_too(ckpt, cfg, native):
    import torch.distributed.checkpoint as dcp

    want = native_to_megatron(native, cfg)
    target = {k: torch.empty_like(v) for k, v in want.items()}
    with pytest.warns(UserWarning, match="single process"):  # no process group: DCP's own no-dist mode
        dcp.load(target, storage_reader=dcp.FileSystemReader(str(ckpt / "release")), no_dist=True)
    assert all(torch.equal(target[k], want[k]) for k in want)
    reader = TorchDistReader(ckpt)
    fc1 = "decoder.layers.2.mlp.experts.experts.linear_fc1.weight"
    inter = cfg.moe_intermediate_size
    assert torch.equal(reader.read(Box(fc1, (5, inter, 0), (1, inter, cfg.hidden_size)))[0],
                       native["layers.2.ffn.experts.5.w3.weight"])
    straddle = reader.read(Box(fc1, (4, inter // 2, 0), (2, inter, cfg.hidden_size)))
    assert torch.equal(straddle, want[fc1][4:6, inter // 2: inter // 2 + inter])
    assert torch.equal(reader.read(Box(SPLIT_KEY, (10, 3), (40, 5))), want[SPLIT_KEY][10:50, 3:8])


def test_common_pt_carries_megatron_args(ckpt, cfg):
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(ckpt / "release"))
    args = common["args"]
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (4, 128, 4)
    assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size) == (8, 2, 128)
    assert args.padded_vocab_size == cfg.vocab_size and args.tensor_model_parallel_size == 1
    assert args.dsv4_compress_ratios == [0, 4, 128, 4] and args.dsv4_n_hash_layers == 2
    assert common["iteration"] == 0 and common["checkpoint_version"] == 3.0
    assert read_common(ckpt / "release")["v4rl"]["hf_config"]["num_hidden_layers"] == 4


def test_metadata_refuses_gaps_overlaps_and_strays(tmp_path, cfg, native):
    specs = megatron_specs(cfg)
    good = write_checkpoint(tmp_path / "a", cfg, native)
    fc2 = "decoder.layers.0.mlp.experts.experts.linear_fc2.weight"
    gap = [r for r in good if not (r.key == fc2 and r.offsets[0] == 3)]
    with pytest.raises(TorchDistError, match=r"linear_fc2.*missing or overlapping"):
        write_dcp_metadata(tmp_path, gap, specs)
    overlap = good + [next(r for r in good if r.key == fc2)]
    with pytest.raises(TorchDistError, match="missing or overlapping"):
        write_dcp_metadata(tmp_path, overlap, specs)
    stray = good + [ChunkRecord("decoder.layers.9.mlp.router.weight", (0, 0), (1, 1), torch.bfloat16, "x", 0, 1)]
    with pytest.raises(TorchDistError, match=r"unknown key 'decoder\.layers\.9"):
        write_dcp_metadata(tmp_path, stray, specs)
    outside = [r if r.key != fc2 or r.offsets[0] else ChunkRecord(r.key, (8, 0, 0), r.sizes, r.dtype, r.relative_path,
                                                                  r.offset, r.length) for r in good]
    with pytest.raises(TorchDistError, match="outside its global shape"):
        write_dcp_metadata(tmp_path, outside, specs)


def test_broken_directories_name_file_and_key(tmp_path, cfg, native):
    root = tmp_path / "ckpt"
    write_checkpoint(root, cfg, native)
    rel = root / "release"
    with pytest.raises(TorchDistError, match="neither metadata.json nor latest_checkpointed_iteration"):
        resolve_iteration_dir(tmp_path)
    (root / "latest_checkpointed_iteration.txt").write_text("20")
    with pytest.raises(TorchDistError, match=r"iter_0000020.*never completed"):
        resolve_iteration_dir(root)
    (root / "latest_checkpointed_iteration.txt").write_text("release")
    data = (rel / "__0_1.distcp").read_bytes()
    (rel / "__0_1.distcp").write_bytes(data[: len(data) // 2])
    with pytest.raises(TorchDistError, match=r"__0_1\.distcp is truncated: '.*' chunk"):
        check_storage_bounds(rel)
    reader = TorchDistReader(root)
    key = "decoder.layers.3.mlp.experts.experts.linear_fc2.weight"
    with pytest.raises(TorchDistError, match=r"__0_\d\.distcp.*linear_fc2"):
        for e in range(cfg.n_routed_experts):
            reader.read(Box(key, (e, 0, 0), (1, cfg.hidden_size, cfg.moe_intermediate_size)))
    (rel / "__0_1.distcp").unlink()
    with pytest.raises(TorchDistError, match=r"__0_1\.distcp is missing"):
        check_storage_bounds(rel)


def test_chunk_writer_does_not_store_whole_storage_of_views(tmp_path):
    big = torch.arange(1_000_000, dtype=torch.float32)
    with ChunkFileWriter(tmp_path / "x.distcp", fsync=False) as w:
        rec = w.append("k", (0,), big[:10])
    assert rec.sizes == (10,) and rec.length < 4096
    assert math.prod(rec.sizes) == 10
