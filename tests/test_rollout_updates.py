"""Online weight updates of the embedded rollout server, over real HTTP, and the fidelity gate.

Pins: (a) an update with changed weights changes the outputs and makes the server equal, bit for bit,
a fresh server started on the same files (whole directory, and begin / buckets / end with generation
held until the end); (b) the fidelity gate catches each known update bug (FP4 bytes read as FP8, a
stale runtime copy, transposed scales; planted by tests/planted.py) and names the tensors; (c) a changed or all-zero tid2eid, or an
export whose storage kind differs, is refused and leaves the served weights untouched. Also: the ROCm
fnuz runtime path is bit-identical, and an update waits for running requests instead of mixing weights.

"Changed weights" = the base checkpoint's weights plus noise (tid2eid untouched), saved with
checkpoints/hf.py in the layout `v4rl export --format hf-fp8` writes.

    .venv/bin/python -m pytest tests/test_rollout_updates.py -q
"""

from __future__ import annotations

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from checkpoints.hf import INDEX_FILE, load_hf_checkpoint, save_hf_checkpoint
from engines.rollout.engine import EngineConfig, RolloutEngine
from engines.rollout.fidelity import (FidelityError, check_fidelity, compare, probe_batch, reference_fingerprint,
                                      server_fingerprint)
from engines.rollout.server import RolloutServer
from engines.rollout.sglang import SGLangClient, SGLangHTTPError
from tests.planted import UPDATE_BUGS, plant_update_bug
from tests.conftest import write_noisy_copy

PROMPTS = [[0] + [5 + (11 * i + 5 * k) % 90 for k in range(31 + i)] for i in range(3)]
SAMPLING = {"max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 5}
EXPERT_WEIGHTS = {f"layers.{i}.ffn.experts.{e}.w{w}.weight" for i in range(4) for e in range(8) for w in (1, 2, 3)}


def _served(ckpt: Path, **config):
    server = RolloutServer(RolloutEngine(ckpt, EngineConfig(**config))).start()
    return server, SGLangClient(server.url, timeout=60)


class Serving:
    """Context manager: a server on `ckpt` and its client, both closed on exit."""

    def __init__(self, ckpt: Path, **config) -> None:
        self.server, self.client = _served(ckpt, **config)

    def __enter__(self) -> SGLangClient:
        return self.client

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        self.server.stop()


def _run(client: SGLangClient):
    outs = client.generate_ids(PROMPTS, SAMPLING)
    return [(o.output_ids, o.output_logprobs, o.weight_version) for o in outs]


@pytest.fixture(scope="module")
def updated(tiny_checkpoint, tmp_path_factory) -> Path:
    """The base weights plus 2% noise per tensor (tid2eid kept), sharded small so shards can be buckets."""
    return write_noisy_copy(tiny_checkpoint, tmp_path_factory.mktemp("update") / "step-1", seed=1,
                            max_shard_bytes=150_000)


def _bucket(src: Path, dst: Path, shards: list[str]) -> Path:
    """A bucket directory: some shards of an export plus an index listing only their tensors."""
    dst.mkdir(parents=True)
    index = json.loads((src / INDEX_FILE).read_text())
    for shard in shards:
        shutil.copy2(src / shard, dst / shard)
    weight_map = {n: f for n, f in index["weight_map"].items() if f in shards}
    (dst / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def _single_tensor_bucket(dst: Path, name: str, tensor: torch.Tensor) -> Path:
    dst.mkdir(parents=True)
    save_file({name: tensor.contiguous()}, str(dst / "model-00001-of-00001.safetensors"))
    (dst / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": {name: "model-00001-of-00001.safetensors"}}))
    return dst


# ------------------------------------------------------------------------------------------- (a)
def test_update_changes_outputs_and_equals_a_fresh_server(tiny_checkpoint, updated):
    with Serving(tiny_checkpoint) as client:
        before = _run(client)
        t0 = time.monotonic()
        res = client.update_weights_from_disk(str(updated), weight_version="step-1")
        latency = time.monotonic() - t0
        assert res["success"] and "step-1" in res["message"] and latency < 30
        after = _run(client)
        report = check_fidelity(client, updated)
    assert report.ok and report.logprob_positions > 100
    assert all(b[0] != a[0] or b[1] != a[1] for b, a in zip(before, after)), "outputs did not change"
    assert {v for *_, v in after} == {"step-1"}
    with Serving(updated, weight_version="step-1") as fresh:
        assert _run(fresh) == after  # token ids and logprobs bit for bit


def test_bucketed_session_holds_generation_until_end(tiny_checkpoint, updated, tmp_path):
    shards = sorted(p.name for p in updated.glob("*.safetensors"))
    assert len(shards) >= 2, "the update fixture should be sharded"
    half = len(shards) // 2
    first, second = _bucket(updated, tmp_path / "b1", shards[:half]), _bucket(updated, tmp_path / "b2", shards[half:])
    with Serving(tiny_checkpoint) as client:
        with pytest.raises(SGLangHTTPError, match="no weight update session"):
            client.end_weight_update()
        client.begin_weight_update()
        with pytest.raises(SGLangHTTPError, match="already open"):
            client.begin_weight_update()
        assert "Staged" in client.update_weights_from_disk(str(first))["message"]
        pending = ThreadPoolExecutor(1).submit(_run, client)
        time.sleep(0.5)
        assert not pending.done(), "generation must wait for /end_weight_update"
        client.update_weights_from_disk(str(second), weight_version="step-1")
        client.end_weight_update()
        during = pending.result(60)
        assert check_fidelity(client, updated).ok
    with Serving(updated, weight_version="step-1") as fresh:
        assert _run(fresh) == during


def test_update_waits_for_running_requests(tiny_checkpoint, updated):
    """Not paused: requests in flight finish on the old weights, then the update applies."""
    with Serving(tiny_checkpoint) as client:
        pool = ThreadPoolExecutor(2)
        running = pool.submit(client.generate_ids, [PROMPTS[0]], {"max_new_tokens": 80, "ignore_eos": True})
        while client.server_info()["internal_states"][0]["num_running_reqs"] == 0:
            time.sleep(0.01)
        update = pool.submit(client.update_weights_from_disk, str(updated), weight_version="step-1")
        [out] = running.result(60)
        assert out.finish_type == "length" and out.weight_version == "default"
        assert update.result(60)["success"]
        assert {v for *_, v in _run(client)} == {"step-1"}


# ------------------------------------------------------------------------------------------- (b)
@pytest.mark.parametrize("fault", UPDATE_BUGS)
def test_fidelity_gate_catches_known_update_bugs(tiny_checkpoint, updated, fault):
    serving = Serving(tiny_checkpoint)
    plant_update_bug(serving.server.engine, fault)
    with serving as client:
        assert client.update_weights_from_disk(str(updated))["success"]  # the bug itself is silent
        with pytest.raises(FidelityError) as err:
            check_fidelity(client, updated)
    report = err.value.report
    assert report.logprob_mismatches > 0 and not report.missing_tensors and not report.unexpected_tensors
    differing = set(report.differing_tensors)
    if fault == "skip_rebuild":  # every tensor the update changed is stale
        assert {"embed.weight", "head.weight", "layers.0.attn.wq_a.weight"} | EXPERT_WEIGHTS <= differing
        assert not any(n.endswith("tid2eid") for n in differing)
    else:  # FP4 experts are mis-decoded; FP8 linears are untouched
        assert differing == EXPERT_WEIGHTS
    assert "fidelity gate failed" in str(err.value) and sorted(differing)[0] in str(err.value)


# ------------------------------------------------------------------------------------------- (c)
@pytest.mark.parametrize("case", ["all-zero", "changed"])
def test_tid2eid_updates_are_refused(tiny_checkpoint, tmp_path, case):
    name = "layers.1.ffn.gate.tid2eid"
    table = load_hf_checkpoint(tiny_checkpoint)[1][name]
    bad = torch.zeros_like(table) if case == "all-zero" else table.roll(1, dims=0)
    bucket = _single_tensor_bucket(tmp_path / "bucket", name, bad)
    with Serving(tiny_checkpoint) as client:
        with pytest.raises(SGLangHTTPError) as err:
            client.update_weights_from_disk(str(bucket))
        assert err.value.status == 400 and name in str(err.value)
        assert ("all zeros" if case == "all-zero" else "differs from the served table") in str(err.value)
        assert check_fidelity(client, tiny_checkpoint).ok  # nothing was applied


def test_a_bf16_wo_a_updates_an_fp8_one_as_sglang_loads_it(tiny_checkpoint, tmp_path):
    """Miles broadcasts wo_a unquantized (its FP8 quantizer's list has no wo_a); SGLang dequantizes wo_a to BF16
    anyway (SGLANG_OPT_FP8_WO_A_GEMM=0), so the update is accepted and the dequantized values serve unchanged;
    another FP8 linear sent in BF16 stays refused."""
    from checkpoints.hf import read_stored_tensors

    stored = read_stored_tensors(tiny_checkpoint)[1]
    wo_a = stored["layers.0.attn.wo_a.weight"].dequantize(torch.float32).to(torch.bfloat16)
    with Serving(tiny_checkpoint) as client:
        client.update_weights_from_disk(str(_single_tensor_bucket(tmp_path / "wo_a", "layers.0.attn.wo_a.weight",
                                                                  wo_a)))
        assert check_fidelity(client, tiny_checkpoint).ok  # FP8 values are exact in BF16: the same runtime
        wq_a = stored["layers.0.attn.wq_a.weight"].dequantize(torch.float32).to(torch.bfloat16)
        with pytest.raises(SGLangHTTPError, match="arrived as"):
            client.update_weights_from_disk(str(_single_tensor_bucket(tmp_path / "wq_a", "layers.0.attn.wq_a.weight",
                                                                      wq_a)))


def test_export_with_another_expert_storage_is_refused(tiny_checkpoint, tmp_path):
    cfg, state = load_hf_checkpoint(tiny_checkpoint)
    fp8_experts = save_hf_checkpoint(tmp_path / "fp8-experts", cfg, state, expert_dtype="fp8")
    with Serving(tiny_checkpoint) as client:
        with pytest.raises(SGLangHTTPError) as err:
            client.update_weights_from_disk(str(fp8_experts))
        assert "experts" in str(err.value) and "FP8" in str(err.value) and "FP4" in str(err.value)
        with pytest.raises(SGLangHTTPError, match="cannot read weights"):
            client.update_weights_from_disk(str(tmp_path / "missing"))
        assert check_fidelity(client, tiny_checkpoint).ok


def test_rocm_fnuz_runtime_is_bit_identical(tiny_checkpoint, updated):
    probe = probe_batch(load_hf_checkpoint(tiny_checkpoint)[0], n=2)
    with Serving(tiny_checkpoint, profile={"fp8_dtype": "e4m3fnuz"}) as client:
        assert client.server_info()["v4rl"]["rocm_fnuz"] is True
        assert compare(reference_fingerprint(tiny_checkpoint, probe), server_fingerprint(client, probe)).ok
        client.update_weights_from_disk(str(updated))
        assert compare(reference_fingerprint(updated, probe), server_fingerprint(client, probe)).ok


def test_update_from_a_real_export_round_trip(tiny_checkpoint, updated, tmp_path):
    """HF FP8 -> torch_dist (trainer side) -> `export --format hf-fp8` -> update a server serving other
    weights: it must then compute exactly what a fresh engine on the original checkpoint computes."""
    convert = pytest.importorskip("checkpoints.convert")
    convert.convert_hf_to_torch_dist(tiny_checkpoint, tmp_path / "torch_dist", workers=1)
    convert.export_torch_dist_to_hf(tmp_path / "torch_dist", tmp_path / "hf-fp8", fmt="hf-fp8", like=tiny_checkpoint,
                                    workers=1)
    with Serving(updated) as client:
        assert client.update_weights_from_disk(str(tmp_path / "hf-fp8"), weight_version="rt")["success"]
        assert check_fidelity(client, tiny_checkpoint).ok


@pytest.mark.parametrize("expert_dtype", ["fp8", pytest.param("fp4", marks=pytest.mark.slow)])
def test_trainer_export_matches_the_rollout_start_format(tiny_base, tmp_path, expert_dtype):
    """TrainRunConfig.rollout_expert_dtype: the rollout starts from the base re-stored in that expert format
    (FP4 base -> FP8 converted once, logged) and the trainer exports in the same format, so its update is
    accepted and passes the fidelity gate (conformance C10: SGLang started from FP4 experts refuses FP8 ones).
    fp4 (the non-default setting) is `slow`: ~10 s more on an idle machine."""
    from engines.train.actors import HTTPRollout, TrainerWorker
    from engines.train.run import _rollout_start_weights
    from engines.train.trainer import TrainerConfig
    from rl.grpo import GRPOConfig

    logged: list[str] = []
    start, fresh = _rollout_start_weights(str(tiny_base), tmp_path / "run", expert_dtype, logged.append)
    assert fresh and json.loads((start / "config.json").read_text())["expert_dtype"] == expert_dtype
    assert json.loads((tiny_base / "config.json").read_text())["expert_dtype"] == "fp4"
    assert ("converted once to FP8" if expert_dtype == "fp8" else "stay FP4") in logged[0]
    trainer = TrainerWorker(str(tiny_base), TrainerConfig(rollout_expert_dtype=expert_dtype), GRPOConfig(),
                            str(tmp_path / "ckpts"))
    with torch.no_grad():  # an update: every trained weight moves
        for p in trainer.trainer.model.parameters():
            if p.numel() > 1:
                p.add_(1e-2 * p.float().std() * torch.randn_like(p))
    export, other = tmp_path / "export", "fp4" if expert_dtype == "fp8" else "fp8"
    trainer.export(str(export))
    assert json.loads((export / "config.json").read_text())["expert_dtype"] == expert_dtype
    trainer.trainer.config.rollout_expert_dtype = other
    trainer.export(str(tmp_path / "other"))
    with Serving(start, prefix_cache_entries=0) as client:
        before = client.weights_checksums()
        with pytest.raises(SGLangHTTPError, match=f"arrived as {other.upper()}"):  # refused, never misread
            client.update_weights_from_disk(str(tmp_path / "other"))
        assert client.weights_checksums() == before
        HTTPRollout(client).load_weights(str(export), version="step-1")
        assert check_fidelity(client, export, probe=probe_batch(trainer.cfg, n=1)).ok
        after = client.weights_checksums()
        assert sum(before[n] != after[n] for n in EXPERT_WEIGHTS) == len(EXPERT_WEIGHTS)  # experts took the update
        stored = client.server_info()["internal_states"][0]["stored_tensors"]
        assert stored.get("fp4", 0) == (len(EXPERT_WEIGHTS) if expert_dtype == "fp4" else 0)
