"""Conformance on SGLang's own DeepSeek-V4 model (C8-C10): SGLang 0.5.23's `DeepseekV4ForCausalLM`, its
`DefaultModelLoader` and its online-update code (`WeightUpdater`), run on CPU in one subprocess
(engines/upstream/sglang_model_probe.py; its docstring lists the three stand-ins and why they change no name,
shape or value), fed the checkpoints v4rl writes.

(a) first load of every kind v4rl writes (bootstrap base, `v4rl export --format hf-fp8`, the weight-update
    directory the embedded trainer writes in both expert formats, an FP8-expert checkpoint): every tensor consumed,
    no parameter left at the sentinel, every SGLang parameter equal to v4rl's dequantized value (checkpoints/quant.py).
(b) updates v4rl or Miles drives (`/update_weights_from_disk`; distributed buckets cut by v4rl's own
    `launcher.buckets`) per SGLang post-load mode, compared parameter by parameter with a fresh load of the same
    files. Where stock SGLang cannot round-trip, the test is an expected failure whose reason is asserted (the
    parameter and the assertion), so a fixed SGLang turns it into a pass (strict xfail: an unexpected pass fails
    and says to update the table).

The default run covers every mode once (141 s measured on 2 cores, < 1 GB); `-m slow` adds the whole matrix
(both expert formats x both update kinds x every mode). SGLang's source: engines.upstream.sources.sglang_paths()
or $V4RL_SGLANG_DIR; skipped with the reason when neither is there.

    .venv/bin/python -m pytest tests/conformance/test_sglang_model.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines.upstream.sglang_model_check import Case, CaseResult, Mode, Update, run_cases, tiny_checkpoints
from engines import TINY_BASE

ASSET = TINY_BASE
BF16_WO_A = Mode("wo_a-bf16")
FP8_WO_A = Mode("wo_a-fp8", wo_a_gemm=True)
UE8M0 = Mode("ue8m0", ue8m0=True)
SMALL_BUCKETS = 20_000
"""Bytes: tiny-base's tensors then travel in about a hundred buckets, so any split of a fused pair would show."""


@pytest.fixture(scope="module")
def kinds(tmp_path_factory) -> dict[str, Path]:
    """Every checkpoint kind v4rl writes, each by the writer a user's command runs."""
    from checkpoints.convert import convert_hf_to_torch_dist, export_torch_dist_to_hf
    from engines.train.actors import TrainerWorker
    from engines.train.trainer import TrainerConfig
    from rl.grpo import GRPOConfig

    root = tmp_path_factory.mktemp("sglang-kinds")
    out = {"tiny-base": ASSET}
    out["fp8-experts"], out["fp8-experts-update"] = tiny_checkpoints(root, "fp8", expert_dtype="fp8")
    _, out["fp4-update"] = tiny_checkpoints(root, "fp4")
    out["o128-fp4"], out["o128-fp4-update"] = tiny_checkpoints(root, "o128", o_lora_rank=128)
    convert_hf_to_torch_dist(ASSET, root / "torch_dist", workers=1)
    export_torch_dist_to_hf(root / "torch_dist", root / "export-hf-fp8", fmt="hf-fp8", workers=1)
    out["export-hf-fp8"] = root / "export-hf-fp8"
    for dtype in ("fp8", "fp4"):  # the embedded trainer's update directory, in the run's rollout expert format
        trainer = TrainerWorker(str(ASSET), TrainerConfig(rollout_expert_dtype=dtype), GRPOConfig(),
                                str(root / f"ckpt-{dtype}"))
        trainer.export(str(root / f"trainer-update-{dtype}"))
        out[f"trainer-update-{dtype}"] = root / f"trainer-update-{dtype}"
    return out


def _default_cases(kinds: dict[str, Path], root: Path) -> list[Case]:
    first = [Case(f"first:{kind}", str(kinds[kind]), BF16_WO_A, dump=str(root / f"{kind}.safetensors"))
             for kind in ("tiny-base", "export-hf-fp8", "trainer-update-fp8", "trainer-update-fp4", "fp8-experts")]
    return first + [
        Case("first:tiny-base:wo_a-fp8", str(kinds["tiny-base"]), FP8_WO_A),
        Case("disk:wo_a-bf16:fp4", str(kinds["tiny-base"]), BF16_WO_A, Update("disk", str(kinds["fp4-update"]))),
        Case("distributed:wo_a-bf16:fp4", str(kinds["tiny-base"]), BF16_WO_A,
             Update("distributed", str(kinds["fp4-update"]), SMALL_BUCKETS)),
        Case("disk:trainer-fp8", str(kinds["fp8-experts"]), BF16_WO_A,
             Update("disk", str(kinds["trainer-update-fp8"]))),
        Case("disk:wo_a-fp8:fp4", str(kinds["o128-fp4"]), FP8_WO_A, Update("disk", str(kinds["o128-fp4-update"]))),
        Case("disk:ue8m0:fp4", str(kinds["tiny-base"]), UE8M0, Update("disk", str(kinds["fp4-update"]))),
    ]


@pytest.fixture(scope="module")
def results(sglang_paths, kinds, tmp_path_factory) -> dict[str, CaseResult]:
    root = tmp_path_factory.mktemp("sglang-model")
    return run_cases(_default_cases(kinds, root), sglang_paths, root, timeout=1200) | {"_root": root}


# ------------------------------------------------------------------------------------------------ (a)
@pytest.mark.parametrize("kind", ["tiny-base", "export-hf-fp8", "trainer-update-fp8", "trainer-update-fp4",
                                  "fp8-experts"])
def test_first_load_consumes_every_tensor_and_fills_every_parameter(results, kinds, kind):
    got = results[f"first:{kind}"]
    first = got.raw["first_load"]
    assert first["ok"], got.reason
    stored = _stored_count(kinds[kind])
    assert first["yielded"] == stored and stored == 340
    assert first["not_found"] == [] and first["not_initialized"] == [] and first["sentinel_left"] == []
    assert got.loaded and got.reason == ""


@pytest.mark.parametrize("kind", ["tiny-base", "export-hf-fp8", "trainer-update-fp8", "trainer-update-fp4",
                                  "fp8-experts"])
def test_first_load_values_equal_v4rls_dequantized_values(results, kinds, kind):
    from safetensors.torch import load_file

    held = load_file(str(results["_root"] / f"{kind}.safetensors"))
    want = expected_sglang_values(kinds[kind])
    compared = [n for n in held if not n.endswith(("k_scale", "v_scale", "weight_scale_inv"))]
    assert set(compared) == set(want) and len(compared) >= 100  # scales: checked through the values they scale
    bad = [n for n in compared if not torch.equal(sglang_value(n, held), want[n].to(sglang_value(n, held).dtype))]
    assert not bad, f"{kind}: SGLang holds {len(bad)} of {len(compared)} parameters differently, e.g. {bad[:3]}"


def test_tiny_base_first_load_fails_under_the_default_fp8_wo_a_path(results):
    """C8: tiny-cpu's o_lora_rank 64 is below one 128-wide FP8 block; SGLang's default wo_a path cannot set up
    its scales (the cluster job therefore runs SGLANG_OPT_FP8_WO_A_GEMM=0)."""
    got = results["first:tiny-base:wo_a-fp8"]
    assert not got.loaded
    assert "shape '[2, 0, 1]' is invalid" in got.reason and "_setup_fp8_wo_a_scales" in got.reason


# ------------------------------------------------------------------------------------------------ (b)
def test_disk_update_round_trips_with_bf16_wo_a(results):
    got = results["disk:wo_a-bf16:fp4"]
    assert got.raw["update"]["ok"] and got.raw["not_restored"] == []
    assert got.round_trips, got.reason


def test_embedded_trainer_update_round_trips_on_the_engine_it_was_started_for(results):
    """The trainer exports FP8 experts (the run's default rollout format); the engine starts from FP8 experts."""
    got = results["disk:trainer-fp8"]
    assert got.round_trips, got.reason


def test_distributed_update_in_v4rls_buckets_round_trips(results):
    got = results["distributed:wo_a-bf16:fp4"]
    assert got.raw["update"]["calls"] > 50  # small buckets: a split fused pair would have failed a call
    # v4rl sends wo_a's scale as `wo_a.scale`, the one name SGLang dequantizes under SGLANG_OPT_FP8_WO_A_GEMM=0
    assert got.round_trips, got.reason


@pytest.mark.xfail(strict=True, reason="stock SGLang 0.5.23: the fp8 wo_a scale reshaped by _setup_fp8_wo_a_scales "
                   "is never restored; a fixed SGLang passes (then update the README table)")
def test_disk_update_round_trips_with_fp8_wo_a(results):
    got = results["disk:wo_a-fp8:fp4"]
    assert got.loaded, got.reason  # an o_lora_rank-128 model loads under the default path
    _assert_not_restored(got, "self_attn.wo_a.weight_scale_inv", "shape [2, 1, 1] after restore, [2, 1] when built")
    assert "target.shape=torch.Size([2, 1, 1]), loaded_weight.shape=torch.Size([2, 1])" in got.reason
    assert got.round_trips, got.reason


@pytest.mark.xfail(strict=True, reason="stock SGLang 0.5.23: DeepGEMM's UE8M0 requant packs the dense FP8 scales "
                   "(int32, format_ue8m0 latched) and restore_weights_before_loading does not undo it")
def test_disk_update_round_trips_with_deepgemm_ue8m0(results):
    got = results["disk:ue8m0:fp4"]
    assert got.loaded, got.reason
    _assert_not_restored(got, "self_attn.wqkv_a.weight_scale_inv", "shape [192, 1] after restore, [2, 1] when built")
    assert "param.dtype=torch.int32" in got.reason and "rollback failed too" in got.reason
    assert got.round_trips, got.reason


def _assert_not_restored(got: CaseResult, parameter: str, what: str) -> None:
    hits = [d for d in got.raw["not_restored"] if parameter in d]
    assert hits and what in hits[0], got.raw["not_restored"][:3]
    assert not got.raw["update"]["ok"]


# --------------------------------------------------------------------------------------------- slow matrix
MATRIX = [(mode, experts, kind) for mode in ("wo_a-bf16", "wo_a-fp8", "ue8m0") for experts in ("fp4", "fp8")
          for kind in ("disk", "distributed")]
EXPECTED_FAILURE = {"wo_a-fp8": "wo_a.weight_scale_inv: shape [2, 1, 1] after restore",
                    "ue8m0": "wqkv_a.weight_scale_inv: shape [192, 1] after restore"}


@pytest.fixture(scope="module")
def matrix(sglang_paths, tmp_path_factory) -> dict[str, CaseResult]:
    root = tmp_path_factory.mktemp("sglang-matrix")
    pairs = {(False, "fp4"): tiny_checkpoints(root, "fp4"),
             (False, "fp8"): tiny_checkpoints(root, "fp8", expert_dtype="fp8"),
             (True, "fp4"): tiny_checkpoints(root, "o128-fp4", o_lora_rank=128),
             (True, "fp8"): tiny_checkpoints(root, "o128-fp8", o_lora_rank=128, expert_dtype="fp8")}
    modes = {"wo_a-bf16": BF16_WO_A, "wo_a-fp8": FP8_WO_A, "ue8m0": UE8M0}
    cases = []
    for mode, experts, kind in MATRIX:
        base, update = pairs[(mode == "wo_a-fp8", experts)]
        cases.append(Case(f"{mode}:{experts}:{kind}", str(base), modes[mode],
                          Update(kind, str(update), SMALL_BUCKETS if kind == "distributed" else 1 << 30)))
    return run_cases(cases, sglang_paths, root, timeout=1800)


@pytest.mark.slow
@pytest.mark.parametrize("mode,experts,kind", MATRIX)
def test_update_matrix(matrix, mode, experts, kind):
    got = matrix[f"{mode}:{experts}:{kind}"]
    assert got.loaded, got.reason
    if mode in EXPECTED_FAILURE:
        assert any(EXPECTED_FAILURE[mode] in d for d in got.raw["not_restored"]), got.raw["not_restored"][:3]
        assert not got.round_trips, f"{mode} now round-trips: stock SGLang was fixed, update the README table"
        return
    assert got.round_trips, got.reason


# ------------------------------------------------------------------------------------------- expectations
def _stored_count(path: Path) -> int:
    import json

    return len(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"])


def sglang_value(name: str, held: dict[str, torch.Tensor]) -> torch.Tensor:
    """One SGLang parameter as values (fp32): FP8 linears and FP4 experts dequantized with v4rl's own math
    (checkpoints/quant.py) from the bytes and scales SGLang holds; everything else as held."""
    from checkpoints.quant import dequantize_fp4_e2m1, dequantize_fp8_blockwise

    t = held[name]
    if name.endswith("weight_scale_inv"):
        return t.float()
    scale = held.get(name + "_scale_inv")
    if t.dtype == torch.float8_e4m3fn and scale is not None:
        if t.ndim == 3:
            return torch.stack([dequantize_fp8_blockwise(t[e], scale[e], out_dtype=torch.float32)
                                for e in range(t.shape[0])])
        return dequantize_fp8_blockwise(t, scale, out_dtype=torch.float32)
    if t.dtype == torch.int8 and scale is not None:  # packed FP4 experts [E, out, in/2], scale [E, out, in/32]
        return torch.stack([dequantize_fp4_e2m1(t[e], scale[e], out_dtype=torch.float32) for e in range(t.shape[0])])
    return t


def expected_sglang_values(path: Path) -> dict[str, torch.Tensor]:
    """What each SGLang parameter must hold, from v4rl's own reader (checkpoints/quant.py dequantization, fp32), fused
    the way SGLang's load_weights fuses: wq_a+wkv -> wqkv_a, compressor wkv+wgate -> wkv_gate, shared experts'
    gate+up -> gate_up_proj, routed experts stacked as w13 (gate, up) and w2; wo_a dequantized (BF16 wo_a path);
    ratio-4 compressors' `ape` re-laid as SGLang re-lays it at every load."""
    from checkpoints.hf import load_hf_checkpoint
    from checkpoints.names import native_to_sglang_name

    cfg, native = load_hf_checkpoint(path, out_dtype=torch.float32)
    named = {native_to_sglang_name(n): t for n, t in native.items()}
    for layer in range(cfg.num_hidden_layers):  # SGLang's Compressor._apply_ape_hotfix on overlapping (ratio-4)
        if cfg.compress_rate(layer) != 4:       # compressors: the two halves of the last dim stacked as rows
            continue
        for part in ("compressor", "indexer.compressor"):
            name = f"model.layers.{layer}.self_attn.{part}.ape"
            halves = torch.chunk(named[name], 2, dim=-1)
            named[name] = torch.cat(halves, dim=0).reshape(4, -1)
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in named.items():
        if ".mlp.experts." in name:
            prefix, rest = name.split(".mlp.experts.")
            eid, proj = rest.split(".")[0], rest.split(".")[1]
            experts.setdefault(prefix, {}).setdefault(int(eid), {})[proj] = t
            continue
        out[name] = t
    for a, b, fused in ((".self_attn.wq_a.weight", ".self_attn.wkv.weight", ".self_attn.wqkv_a.weight"),
                        (".compressor.wkv.weight", ".compressor.wgate.weight", ".compressor.wkv_gate.weight"),
                        (".shared_experts.gate_proj.weight", ".shared_experts.up_proj.weight",
                         ".shared_experts.gate_up_proj.weight")):
        for name in [n for n in out if n.endswith(a)]:
            stem = name[: -len(a)]
            out[stem + fused] = torch.cat([out.pop(name), out.pop(stem + b)], dim=0)
    for prefix, by_id in experts.items():
        ids = sorted(by_id)
        out[prefix + ".mlp.experts.w13_weight"] = torch.stack(
            [torch.cat([by_id[e]["gate_proj"], by_id[e]["up_proj"]], dim=0) for e in ids])
        out[prefix + ".mlp.experts.w2_weight"] = torch.stack([by_id[e]["down_proj"] for e in ids])
    return out
