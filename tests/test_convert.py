"""Pins the HF FP8/FP4 <-> Megatron torch_dist conversion (checkpoints/convert.py, hf_stream.py, manifest.py)
and its CLI (`v4rl convert | export | verify-ckpt`):

- the fast dequantizers are bit-identical to checkpoints/quant.py's reference ones;
- megatron-core's `dist_checkpointing.load` on CPU returns exactly our dequantization of the source, for
  the random tiny-cpu checkpoint and for 2 layers of real DeepSeek-V4-Flash shapes (hidden 4096, vocab
  129280, 64x512 heads, 128x128 FP8 blocks, FP4 1x32 experts of width 2048; 4 routed experts, >= 2 GB);
- HF FP8 -> torch_dist -> HF FP8 reproduces every byte (UE8M0 scales), -> HF BF16 equals the
  dequantized source; fp32-scale sources re-quantize exactly as the rollout engine would;
- re-running is a no-op; every bad input (missing scale, wrong scale shape, truncated shard, index
  pointing to a missing file, unknown tensor, NaN after dequantization, a write error mid-way, a kill)
  exits non-zero with a message naming the tensor or file and leaves nothing that looks complete.

    .venv/bin/python -m pytest tests/test_convert.py -q        (CPU, ~2 min on 2 cores; writes ~6 GB to /tmp)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import typer
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

from bench.convert import flash_like_config, write_synthetic_checkpoint
from checkpoints.convert import convert_hf_to_torch_dist, export_torch_dist_to_hf, verify_torch_dist
from checkpoints.hf import INDEX_FILE, CheckpointError, encode_tensor, load_hf_checkpoint, read_config
from checkpoints.hf_stream import fast_dequantize_fp4, fast_dequantize_fp8, plan_source, requantize_like
from checkpoints.manifest import RECORD_FILE, OutputError
from checkpoints.names import native_to_megatron
from checkpoints.torch_dist import TORCH_DIST_DTYPES, megatron_specs, read_common, read_dcp_metadata
from engines.model.config import CSA, HASH_MOE, HCA, TOPK_MOE, ModelConfig
from engines.model.params import native_param_specs
from checkpoints.quant import UE8M0, dequantize_fp4_e2m1, dequantize_fp8_blockwise, quantize_fp8_blockwise, to_ue8m0
from tests.conftest import write_random_tiny_checkpoint

NUM_GPUS = 0
REPO = Path(__file__).resolve().parents[1]


# ============================================================================================== helpers
def cli_app() -> typer.Typer:
    from v4rl import cmd_convert

    app = typer.Typer()
    cmd_convert.register(app)
    return app


def run_cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli_app(), [*map(str, args), "--no-progress"])
    return result.exit_code, result.output + (result.stderr if result.stderr_bytes is not None else "")


def cli_subprocess(*args: str, **popen: object) -> subprocess.Popen:
    """The CLI in its own process (for resource limits and SIGKILL); only our commands are registered."""
    code = "import typer, v4rl.cmd_convert as c; app = typer.Typer(); c.register(app); app()"
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args), "--no-progress"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def expected_torch_dist(src: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Our dequantization of a HF checkpoint through checkpoints/hf.py (reference dequantizers), in torch_dist
    dtypes and Megatron names: what megatron-core must load."""
    cfg, state = load_hf_checkpoint(src, out_dtype=torch.float32)
    kinds = {n: s.kind for n, s in native_param_specs(cfg).items()}
    return cfg, native_to_megatron({n: t.to(TORCH_DIST_DTYPES[kinds[n]]) for n, t in state.items()}, cfg)


def megatron_load_all(ckpt: Path) -> dict[str, torch.Tensor]:
    from megatron.core import dist_checkpointing

    from checkpoints.megatron_io import single_rank_process_group
    from checkpoints.torch_dist import resolve_iteration_dir

    with single_rank_process_group(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # megatron-core calls DCP's deprecated load_state_dict
        loaded = dist_checkpointing.load_plain_tensors(str(resolve_iteration_dir(ckpt)))
    return {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}  # minus common.pt's args etc.


def shard_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def rewrite(src: Path, dst: Path, fn: Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]) -> Path:
    """Copy a checkpoint passing every tensor through fn (rename / drop / replace), index kept in step."""
    shutil.copytree(src, dst)
    weight_map = {}
    for f in sorted(dst.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            tensors = dict(pair for k in h.keys() for pair in fn(k, h.get_tensor(k)))
        save_file(tensors, str(f), metadata={"format": "pt"})
        weight_map.update({k: f.name for k in tensors})
    (dst / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return dst


def nothing_complete(parent: Path, name: str) -> bool:
    """No `name` directory, and any leftover is a hidden `.name.partial-*` without a completion record."""
    if (parent / name).exists():
        return False
    return all(p.name.startswith(f".{name}.partial-") and not (p / RECORD_FILE).exists()
               for p in parent.iterdir() if name in p.name)


def mid_config() -> ModelConfig:
    """~330 MB of torch_dist output: big enough to kill or fail a conversion mid-way."""
    return ModelConfig(vocab_size=8192, hidden_size=2048, num_hidden_layers=2, num_attention_heads=16, head_dim=128,
                       q_lora_rank=512, partial_rotary_factor=0.5, layer_types=[CSA, HCA],
                       mlp_layer_types=[HASH_MOE, TOPK_MOE], o_groups=4, o_lora_rank=512, index_n_heads=8,
                       index_head_dim=64, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=1024)


@pytest.fixture(scope="module")
def converted(tiny_checkpoint, tmp_path_factory) -> Path:
    return convert_hf_to_torch_dist(tiny_checkpoint, tmp_path_factory.mktemp("conv") / "td", workers=2).dst


@pytest.fixture(scope="module")
def mid_checkpoint(tmp_path_factory) -> Path:
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("mid") / "hf", mid_config(), max_shard_bytes=64 << 20)


# ============================================================================================== dequantization
@pytest.mark.parametrize("case", ["ue8m0", "uint8-bytes", "fp32", "ragged", "extreme-exponent", "pow2-fp32"])
def test_fast_fp8_dequant_is_bit_identical_to_reference(case):
    g = torch.Generator().manual_seed(1)
    shape = (200, 330) if case == "ragged" else (256, 384)
    w = torch.randn(shape, generator=g) * torch.logspace(-6, 2, shape[1])  # every magnitude, subnormal FP8 too
    q, s = quantize_fp8_blockwise(w, scale_fmt="fp32" if case == "fp32" else "ue8m0")
    q.view(torch.uint8)[0, :8] = torch.tensor([0x80, 0x00, 0x01, 0x81, 0x7E, 0xFE, 0x08, 0x88], dtype=torch.uint8)
    if case == "uint8-bytes":
        s = s.view(torch.uint8)
    if case == "extreme-exponent":
        s = to_ue8m0(torch.full(s.shape, 2.0 ** -125))  # BF16 would go subnormal: the fp32 route must be taken
    if case == "pow2-fp32":
        s = s.to(torch.float32)
    for out_dtype in (torch.bfloat16, torch.float32):
        want = dequantize_fp8_blockwise(q, s, out_dtype=out_dtype)
        got = fast_dequantize_fp8(q, s, out_dtype=out_dtype)
        assert same_bytes(got, want), (case, out_dtype)


@pytest.mark.parametrize("case", ["ue8m0", "uint8-bytes", "extreme-exponent"])
def test_fast_fp4_dequant_is_bit_identical_to_reference(case):
    g = torch.Generator().manual_seed(2)
    packed = torch.randint(-128, 128, (64, 96), dtype=torch.int8, generator=g)  # every code, -0 included
    s = to_ue8m0(2.0 ** torch.randint(-20, 10, (64, 6), generator=g).float())
    if case == "uint8-bytes":
        s = s.view(torch.uint8)
    if case == "extreme-exponent":
        s = to_ue8m0(torch.full((64, 6), 2.0 ** 126))
    buf = torch.empty(64 * 192 * 2, dtype=torch.uint8).numpy()
    want = dequantize_fp4_e2m1(packed, s, out_dtype=torch.bfloat16)
    assert same_bytes(fast_dequantize_fp4(packed, s), want)
    assert same_bytes(fast_dequantize_fp4(packed, s, out=buf), want)


def test_requantize_like_reuses_exact_scales_and_falls_back_per_block():
    """Unchanged blocks keep the reference's bytes, even where the canonical quantizer would pick another scale;
    changed blocks get the rollout engine's canonical encoding."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(256, 384, generator=g)
    q0, s0 = quantize_fp8_blockwise(w)
    s0 = to_ue8m0(s0.float() * 2)  # a valid but non-canonical scale (max |q| <= 224): canonical would differ
    q0 = (w / s0.float().repeat_interleave(128, 0).repeat_interleave(128, 1)).to(torch.float8_e4m3fn)
    stored = dequantize_fp8_blockwise(q0, s0, out_dtype=torch.bfloat16)
    changed = stored.clone()
    changed[130:140, 300:310] += 1.0  # block (1, 2) changes
    for bf16, want_ref in ((stored, torch.ones(2, 3, dtype=torch.bool)), (changed, torch.tensor([[1, 1, 1], [1, 1, 0]],
                                                                                                  dtype=torch.bool))):
        canon = encode_tensor("x.weight", bf16, "fp8")
        (_, q), (_, s) = requantize_like("x.weight", bf16, canon, s0)
        reused = (s.view(torch.uint8) == s0.view(torch.uint8))
        assert torch.equal(reused, want_ref)
        got = dequantize_fp8_blockwise(q, s, out_dtype=torch.bfloat16)
        if bool(want_ref.all()):
            assert same_bytes(q, q0) and torch.equal(got, bf16)  # byte-identical, so values exact
        else:
            assert same_bytes(s[1, 2:], canon[1][1][1, 2:]) and same_bytes(q[128:, 256:], canon[0][1][128:, 256:])
            assert torch.equal(got[:128], bf16[:128]) and torch.equal(got[:, :256], bf16[:, :256])


# ============================================================================================== outcomes
def test_megatron_core_loads_our_dequantization_of_the_tiny_checkpoint(converted, tiny_checkpoint):
    _, want = expected_torch_dist(tiny_checkpoint)
    got = megatron_load_all(converted)
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    assert (converted / "latest_checkpointed_iteration.txt").read_text() == "release"
    common = read_common(converted / "release")
    assert common["args"].num_layers == 4 and common["v4rl"]["hf_config"] == read_config(tiny_checkpoint)[1]
    report = verify_torch_dist(converted, against=tiny_checkpoint)
    assert report.tensors == len(want) and report.compared == len(native_param_specs(read_config(tiny_checkpoint)[0]))


def test_round_trip_fp8_reproduces_every_byte_and_bf16_equals_dequantized_source(converted, tiny_checkpoint,
                                                                               tmp_path):
    source = shard_tensors(tiny_checkpoint)
    export_torch_dist_to_hf(converted, tmp_path / "fp8", fmt="hf-fp8", like=tiny_checkpoint, workers=2)
    again = shard_tensors(tmp_path / "fp8")
    assert sorted(again) == sorted(source)
    assert [k for k in source if not same_bytes(again[k], source[k])] == []
    assert json.loads((tmp_path / "fp8" / "config.json").read_text()) == \
        json.loads((tiny_checkpoint / "config.json").read_text())
    assert (tmp_path / "fp8" / "tokenizer.json").read_bytes() == (tiny_checkpoint / "tokenizer.json").read_bytes()

    # without the original's scales: the rollout engine's canonical quantizer; same values, loadable
    export_torch_dist_to_hf(converted, tmp_path / "canon", fmt="hf-fp8")
    _, a = load_hf_checkpoint(tiny_checkpoint, out_dtype=torch.float32)
    _, b = load_hf_checkpoint(tmp_path / "canon", out_dtype=torch.float32)
    assert all(torch.equal(a[k], b[k]) for k in a)

    export_torch_dist_to_hf(converted, tmp_path / "bf16", fmt="hf-bf16")
    cfg, c = load_hf_checkpoint(tmp_path / "bf16", dequantize=False)
    kinds = {n: s.kind for n, s in native_param_specs(cfg).items()}
    for k, t in c.items():
        want = torch.int64 if kinds[k] == "int64" else TORCH_DIST_DTYPES[kinds[k]]  # HF keeps tid2eid int64
        assert t.dtype == want and torch.equal(t, a[k].to(t.dtype)), k
    assert "quantization_config" not in json.loads((tmp_path / "bf16" / "config.json").read_text())


def test_fp32_scale_source_converts_exactly_and_requantizes_like_the_rollout_engine(tmp_path, monkeypatch):
    src = write_random_tiny_checkpoint(tmp_path / "hf", seed=3, scale_fmt="fp32")
    monkeypatch.setattr("checkpoints.convert.PIECE_BYTES", 4096)  # embed/head/norms go out as row chunks too
    convert_hf_to_torch_dist(src, tmp_path / "td", workers=1)
    _, want = expected_torch_dist(src)
    got = megatron_load_all(tmp_path / "td")
    assert all(torch.equal(got[k], want[k]) for k in want)
    chunks = read_dcp_metadata(tmp_path / "td" / "release").state_dict_metadata["output_layer.weight"].chunks
    assert len(chunks) == 8 and all(tuple(c.sizes) == (16, 128) for c in chunks)
    export_torch_dist_to_hf(tmp_path / "td", tmp_path / "fp8", fmt="hf-fp8", like=src)
    assert json.loads((tmp_path / "fp8" / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    cfg, state = load_hf_checkpoint(src, out_dtype=torch.float32)
    out, source = shard_tensors(tmp_path / "fp8"), shard_tensors(src)
    for name, spec in native_param_specs(cfg).items():
        stored = state[name].to(TORCH_DIST_DTYPES[spec.kind])  # what the torch_dist holds
        for disk, t in encode_tensor(name, stored, spec.kind, weight_format="fp8", scale_fmt="fp32"):
            # FP4 experts keep UE8M0 scales: byte-exact; FP8 blocks with fp32 scales cannot survive BF16, so
            # they are re-quantized exactly as the rollout engine's quantizer does it
            assert same_bytes(out[disk], source[disk] if spec.kind == "fp4" else t), disk


def test_two_layers_of_real_deepseek_v4_flash_shapes(tmp_path):
    cfg = flash_like_config(num_layers=2, n_routed_experts=4)
    src = write_synthetic_checkpoint(tmp_path / "hf", cfg)
    assert sum(p.stat().st_size for p in src.iterdir()) >= 2 * 10**9
    result = convert_hf_to_torch_dist(src, tmp_path / "td", workers=2)
    assert result.files > 2 and result.bytes_out > 2 * 10**9
    # megatron-core loads every tensor (big ones as expert-axis fragments) == reference dequantization
    report = verify_torch_dist(tmp_path / "td", against=src, batch_bytes=256 << 20)
    assert report.compared == len(native_param_specs(cfg)) and report.tensors == len(megatron_specs(cfg))


# ============================================================================================== re-runs
def test_rerun_is_a_noop_and_another_source_needs_force(converted, tiny_checkpoint, tmp_path):
    stamp = {p: p.stat().st_mtime_ns for p in converted.rglob("*")}
    code, out = run_cli("convert", tiny_checkpoint, converted)
    assert code == 0 and "nothing to do" in out
    assert {p: p.stat().st_mtime_ns for p in converted.rglob("*")} == stamp

    other = write_random_tiny_checkpoint(tmp_path / "other", seed=5)
    dst = tmp_path / "td"
    shutil.copytree(converted, dst)
    code, out = run_cli("convert", other, dst)
    assert code == 1 and "--force" in out and str(dst) in out
    assert convert_hf_to_torch_dist(other, dst, force=True, workers=1).skipped is False
    assert json.loads((dst / RECORD_FILE).read_text())["source"] == str(other.resolve())
    assert convert_hf_to_torch_dist(other, dst, workers=1).skipped is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "td"]
    next((dst / "release").glob("__0_*.distcp")).unlink()  # a damaged copy is never taken for complete
    code, out = run_cli("convert", other, dst)
    assert code == 1 and "files are missing or have changed size" in out


# ============================================================================================== bad inputs
def _fp8_nan(k: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    if k == "layers.2.attn.wo_b.weight":
        t = t.clone()
        t.view(torch.uint8)[3, 5] = 0x7F
    return [(k, t)]


BAD_INPUTS = {
    "missing-scale": (lambda k, t: [] if k == "layers.1.attn.wq_b.scale" else [(k, t)],
                      r"layers\.1\.attn\.wq_b\.weight.*no scale"),
    "scale-shape": (lambda k, t: [(k, torch.ones(2, 2).to(UE8M0) if k == "layers.2.attn.wo_b.scale" else t)],
                    r"scale of 'layers\.2\.attn\.wo_b\.weight' has shape \(2, 2\)"),
    "unknown-name": (lambda k, t: [(k, t)] + ([("layers.0.attn.bogus.weight", t.clone())] if k == "embed.weight" else []),
                     r"unknown tensor 'layers\.0\.attn\.bogus\.weight'"),
    "nan": (_fp8_nan, r"layers\.2\.attn\.wo_b\.weight.*1 NaN/Inf values after dequantization"),
}


@pytest.mark.parametrize("case", [*BAD_INPUTS, "truncated-shard", "missing-shard"])
def test_bad_input_fails_naming_tensor_or_file_and_leaves_nothing(case, tiny_checkpoint, tmp_path):
    if case in BAD_INPUTS:
        fn, pattern = BAD_INPUTS[case]
        bad = rewrite(tiny_checkpoint, tmp_path / "bad", fn)
        shard = "model-00001-of-00001.safetensors"
    else:
        bad = tmp_path / "bad"
        shutil.copytree(tiny_checkpoint, bad)
        shard = json.loads((bad / INDEX_FILE).read_text())["weight_map"]["head.weight"]
        if case == "truncated-shard":
            data = (bad / shard).read_bytes()
            (bad / shard).write_bytes(data[: len(data) * 2 // 3])
            pattern = rf"{shard} is truncated: tensor '.*' ends at byte"
        else:
            (bad / shard).unlink()
            pattern = rf"{INDEX_FILE} maps tensor '.*' .* to shard {shard}, which is missing"
    code, out = run_cli("convert", bad, tmp_path / "td", "--workers", "2")
    assert code == 1, out
    assert __import__("re").search(pattern, out.replace("\n", " ")), out
    assert shard in out
    assert nothing_complete(tmp_path, "td")
    assert not list(tmp_path.glob(".td.partial-*"))  # a clean failure cleans up after itself


def test_write_error_mid_way_exits_nonzero_and_leaves_nothing(mid_checkpoint, tmp_path):
    import resource

    def small_files() -> None:  # every file this process writes is capped at 40 MB: EFBIG mid-way
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (40 << 20, 40 << 20))

    proc = cli_subprocess("convert", mid_checkpoint, tmp_path / "td", "--workers", "2", preexec_fn=small_files)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out
    assert "error: writing '" in out and "File too large" in out and ".distcp failed" in out, out
    assert nothing_complete(tmp_path, "td") and not list(tmp_path.glob(".td.partial-*"))


def test_killed_run_leaves_nothing_complete_and_the_next_run_recovers(mid_checkpoint, tmp_path):
    proc = cli_subprocess("convert", mid_checkpoint, tmp_path / "td", "--workers", "2", start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:  # wait until chunk data is being written
        if any(p.stat().st_size > 1 << 20 for p in tmp_path.glob(".td.partial-*/release/*.distcp")):
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the conversion finished before it could be killed; use a bigger checkpoint"
    os.killpg(proc.pid, signal.SIGKILL)  # the process group: main process and workers, like an OOM kill
    proc.communicate(timeout=60)
    assert nothing_complete(tmp_path, "td")
    assert list(tmp_path.glob(".td.partial-*"))  # the hidden leftover of the killed run
    result = convert_hf_to_torch_dist(mid_checkpoint, tmp_path / "td", workers=2)
    assert not result.skipped and sorted(p.name for p in tmp_path.iterdir()) == ["td"]  # stale partial removed
    verify_torch_dist(tmp_path / "td")


def test_verify_and_export_refuse_what_they_cannot_read(converted, tmp_path):
    code, out = run_cli("verify-ckpt", tmp_path)
    assert code == 1 and "neither metadata.json nor latest_checkpointed_iteration.txt" in out
    code, out = run_cli("export", converted, tmp_path / "x", "--format", "hf-fp16")
    assert code == 1 and "hf-bf16 or hf-fp8" in out
    broken = tmp_path / "broken"
    shutil.copytree(converted, broken)
    victim = next((broken / "release").glob("__0_*.distcp"))
    victim.write_bytes(victim.read_bytes()[:1000])
    code, out = run_cli("verify-ckpt", broken)
    assert code == 1 and victim.name in out
    code, out = run_cli("export", broken, tmp_path / "y", "--format", "hf-bf16")
    assert code == 1 and victim.name in out and nothing_complete(tmp_path, "y")


def test_cli_happy_path(converted, tiny_checkpoint, tmp_path):
    code, out = run_cli("verify-ckpt", converted, "--against", tiny_checkpoint, "--json", tmp_path / "v.json")
    assert code == 0 and "ok: megatron-core loads" in out
    assert json.loads((tmp_path / "v.json").read_text())["compared_with_source"] > 0
    code, out = run_cli("export", converted, tmp_path / "hf", "--format", "hf-fp8", "--like", tiny_checkpoint)
    assert code == 0 and "wrote" in out
    assert plan_source(tmp_path / "hf").cfg == plan_source(tiny_checkpoint).cfg
    with pytest.raises(OutputError):
        export_torch_dist_to_hf(converted, tmp_path / "hf", fmt="hf-bf16")  # a different export is there
    with pytest.raises(CheckpointError):
        plan_source(tmp_path)
