"""Real-SGLang cluster path: launch command, environment, weight-sync buckets and names, and SGLang's
weight-update process-group protocol (run here with gloo: trainer rank 0 in this process, a receiving
rank 1 in a subprocess, FP8 / packed FP4 / UE8M0 / bf16 tensors must arrive bit-identical).

The launch on Ray and NCCL/RCCL sync against real SGLang servers carry the `gpu` marker (they need
`pip install -e '.[cluster]'`, GPUs and a Ray cluster): `pytest -m gpu tests/test_rollout_launcher.py`.

    .venv/bin/python -m pytest tests/test_rollout_launcher.py -q
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from checkpoints.hf import encode_tensor
from checkpoints.quant import tensor_checksum
from engines.rollout.sglang_pin import sglang_version
from engines.rollout.launcher import (DistributedWeightSync, SGLangServerSpec, bucket_metadata, buckets,
                                      build_launch_command, check_sglang_version, init_weight_sync_group, launch_env,
                                      sglang_named_tensors, wire_view)
from engines.rollout.sglang import SGLangError

PRESET = SimpleNamespace(rollout=SimpleNamespace(engine_tp=8, engine_ep=4, engine_dp=1, max_running_requests=48,
                                                 max_total_tokens=524288, context_length=16384,
                                                 mem_fraction_static=0.85))
PROFILE = SimpleNamespace(comm_env={"NCCL_IB_GID_INDEX": "1"}, launcher_env={"GPU_MAX_HW_QUEUES": "2"},
                          python="/opt/venv/bin/python3")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_launch_command_from_preset_and_profile():
    spec = SGLangServerSpec.from_preset("/ckpt/dsv4-fp8", PRESET, PROFILE, api_key="k", weight_version="0")
    cmd = build_launch_command(spec, host="10.0.0.5", port=30001)
    assert cmd[:3] == ["/opt/venv/bin/python3", "-m", "sglang.launch_server"]
    flags = dict(zip(cmd[3::1], cmd[4::1]))
    for flag, value in (("--model-path", "/ckpt/dsv4-fp8"), ("--host", "10.0.0.5"), ("--port", "30001"),
                        ("--tp-size", "8"), ("--ep-size", "4"), ("--max-running-requests", "48"),
                        ("--max-total-tokens", "524288"), ("--context-length", "16384"),
                        ("--mem-fraction-static", "0.85"), ("--api-key", "k"), ("--weight-version", "0")):
        assert flags[flag] == value, flag
    assert "--dp-size" not in cmd and "--trust-remote-code" in cmd
    env = launch_env(spec, base={"PATH": "/bin"})
    assert env == {"PATH": "/bin", "NCCL_IB_GID_INDEX": "1", "GPU_MAX_HW_QUEUES": "2",
                   "SGLANG_RETURN_ORIGINAL_LOGPROB": "1", "SGLANG_OPT_FP8_WO_A_GEMM": "0"}
    with pytest.raises(ValueError, match="mem_fraction_static"):
        SGLangServerSpec(model_path="/x", mem_fraction_static=1.5)


def test_sglang_fp8_wo_a_gemm_follows_the_model_and_what_round_trips(tmp_path, monkeypatch):
    """update_settings.py: SGLANG_OPT_FP8_WO_A_GEMM=0 while SGLang's default wo_a path cannot round-trip an online
    update (C9), and always for an o_lora_rank below/off SGLang's 128-wide FP8 block (tiny-cpu: 64, C8)."""
    from engines.rollout import update_settings
    from engines.rollout.update_settings import wo_a_gemm_off_reason

    (tmp_path / "config.json").write_text(json.dumps({"o_lora_rank": 64}))
    tiny = SGLangServerSpec.from_preset(str(tmp_path), PRESET, PROFILE)
    preset = SimpleNamespace(rollout=PRESET.rollout, hf_config=lambda: {"o_lora_rank": 1024})
    flash = SGLangServerSpec.from_preset("/not/here", preset, PROFILE)  # the preset's config.json
    assert (tiny.o_lora_rank, flash.o_lora_rank) == (64, 1024)
    assert "not a multiple of SGLang's 128-wide FP8 block" in wo_a_gemm_off_reason(64)
    assert "never restores it" in wo_a_gemm_off_reason(1024)
    assert launch_env(tiny, base={})["SGLANG_OPT_FP8_WO_A_GEMM"] == "0" == launch_env(flash, base={})[
        "SGLANG_OPT_FP8_WO_A_GEMM"]
    overridden = SGLangServerSpec(model_path="/x", env={"SGLANG_OPT_FP8_WO_A_GEMM": "1"})  # a profile may set it
    assert launch_env(overridden, base={})["SGLANG_OPT_FP8_WO_A_GEMM"] == "1"
    monkeypatch.setattr(update_settings, "DEFAULT_WO_A_ROUND_TRIPS", True)
    assert "SGLANG_OPT_FP8_WO_A_GEMM" not in launch_env(flash, base={})
    assert launch_env(tiny, base={})["SGLANG_OPT_FP8_WO_A_GEMM"] == "0"
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read the model's config.json"):
        SGLangServerSpec.from_preset(str(tmp_path), PRESET, PROFILE)


def test_engine_dp_is_attention_dp_and_replicas_are_dp_size():
    """B18: a preset's engine_dp is DP attention (--attn-dp-size); --dp-size means whole-model replicas."""
    preset = SimpleNamespace(rollout=SimpleNamespace(**{**vars(PRESET.rollout), "engine_dp": 2}))
    cmd = build_launch_command(SGLangServerSpec.from_preset("/ckpt", preset, PROFILE))
    assert cmd[cmd.index("--attn-dp-size") + 1] == "2" and "--dp-size" not in cmd
    replicas = build_launch_command(SGLangServerSpec(model_path="/ckpt", tp_size=4, dp_size=2))
    assert replicas[replicas.index("--dp-size") + 1] == "2" and "--attn-dp-size" not in replicas
    with pytest.raises(ValueError, match="attn_dp_size=3 must divide tp_size=8"):
        SGLangServerSpec(model_path="/x", tp_size=8, attn_dp_size=3)


class _Engine:
    """Records the control calls a weight push makes (real SGLang's answers are {"success", "message"})."""

    def __init__(self, log: list, name: str, fail_on_bucket: int | None = None, dp_size: int = 1) -> None:
        self.log, self.name, self.fail_on_bucket, self.dp_size, self.buckets = log, name, fail_on_bucket, dp_size, 0
        self.base_url = f"http://{name}"

    def server_info(self):
        return {"dp_size": self.dp_size, "version": "0.5.22"}

    def __getattr__(self, method):
        def call(*args, **kwargs):
            self.log.append((self.name, method, kwargs.get("flush_cache"), kwargs.get("weight_version")))
            if method == "update_weights_from_distributed":
                self.buckets += 1
                if self.buckets == self.fail_on_bucket:
                    raise SGLangError("bucket refused")
            return {"success": True, "message": "ok"}
        return call


def _sync(engines) -> DistributedWeightSync:
    sync = DistributedWeightSync(engines, master_address="127.0.0.1", master_port=_free_port(),
                                 engine_world_sizes=[1] * len(engines), backend="gloo")
    sync.group = init_weight_sync_group(backend="gloo", master_address="127.0.0.1", master_port=_free_port(),
                                        world_size=1, rank=0, group_name=f"push-{id(sync)}", timeout_s=30)
    return sync


def test_weight_push_is_one_paused_session():
    """B17: SGLang refuses distributed updates outside begin/end and does not pause for them: the pusher does."""
    import torch.distributed as dist

    log: list = []
    named = [(f"model.layers.{i}.self_attn.wq_b.weight", torch.zeros(64, 64)) for i in range(3)]
    sync = _sync([_Engine(log, "a")])
    try:
        assert sync.push(named, weight_version="7", bucket_bytes=64 * 64 * 4) == 3
        methods = [m for _, m, _, _ in log]
        assert methods == ["pause_generation", "begin_weight_update"] + ["update_weights_from_distributed"] * 3 + [
            "end_weight_update", "continue_generation"]
        buckets_sent = [entry for entry in log if entry[1] == "update_weights_from_distributed"]
        assert [(f, v) for _, _, f, v in buckets_sent] == [(False, None), (False, None), (True, "7")]
        log.clear()
        sync.push(named, pause_mode="in_place")  # requests keep their KV: no bucket may ask for a flush
        assert not any(f for _, m, f, _ in log if m == "update_weights_from_distributed")
        log.clear()
        sync.clients = [_Engine(log, "b", fail_on_bucket=2)]
        with pytest.raises(SGLangError, match="stay paused"):
            sync.push(named, bucket_bytes=64 * 64 * 4)
        assert [m for _, m, _, _ in log][-1] == "end_weight_update"  # session closed, generation not resumed
    finally:
        dist.destroy_process_group(sync.group)
        sync._pool.shutdown()


def test_weight_sync_refuses_data_parallel_replicas_and_other_sglang_versions():
    sync = DistributedWeightSync([_Engine([], "r", dp_size=2)], master_address="127.0.0.1", master_port=1,
                                 engine_world_sizes=[8])
    with pytest.raises(SGLangError, match="dp_size=2.*--dp-size 1"):
        sync.connect()
    sync._pool.shutdown()
    with pytest.raises(SGLangError, match=f"runs SGLang 0.5.22, but v4rl is pinned to {sglang_version()}"):
        check_sglang_version(_Engine([], "old"), sglang_version())
    check_sglang_version(_Engine([], "any"), None)


def test_sglang_names_and_buckets_keep_storage_bits():
    w = torch.randn(128, 128)
    encoded = (encode_tensor("layers.0.attn.wq_b.weight", w, "fp8")
               + encode_tensor("layers.0.ffn.experts.3.w1.weight", w, "fp4")
               + encode_tensor("layers.0.ffn.gate.tid2eid", torch.zeros(4, 2, dtype=torch.long), "int64"))
    named = list(sglang_named_tensors(encoded))
    assert [n for n, _ in named] == [
        "model.layers.0.self_attn.wq_b.weight", "model.layers.0.self_attn.wq_b.weight_scale_inv",
        "model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.0.mlp.experts.3.gate_proj.weight_scale_inv",
        "model.layers.0.mlp.topk.tid2eid"]
    assert all(a is b for (_, a), (_, b) in zip(encoded, named))
    meta = bucket_metadata(named)
    assert meta["dtypes"] == ["float8_e4m3fn", "float8_e8m0fnu", "int8", "float8_e8m0fnu", "int64"]
    assert meta["shapes"] == [[128, 128], [1, 1], [128, 64], [128, 4], [4, 2]]
    sizes = [[n for n, _ in b] for b in buckets(named, bucket_bytes=128 * 128)]
    assert sizes == [[named[0][0]], [n for n, _ in named[1:]]]
    assert wire_view(named[0][1]).dtype == torch.uint8 and wire_view(named[2][1]).dtype == torch.int8


RECEIVER = textwrap.dedent("""
    import json, os, sys
    from checkpoints.quant import tensor_checksum
    from engines.rollout.launcher import init_weight_sync_group, receive_bucket
    port, meta = int(sys.argv[1]), json.loads(sys.argv[2])
    group = init_weight_sync_group(backend="gloo", master_address="127.0.0.1", master_port=port, world_size=2,
                                   rank=1, group_name="weight_update_group", timeout_s=60)
    print(json.dumps({n: tensor_checksum(t) for n, t in receive_bucket(group, meta)}), flush=True)
    os._exit(0)  # skip gloo's C++ teardown at interpreter exit, which can abort when the peer left first
""")


def test_weight_sync_group_protocol_delivers_the_same_bits():
    import torch.distributed as dist

    w = torch.randn(256, 128)
    named = list(sglang_named_tensors(encode_tensor("layers.1.attn.wq_b.weight", w, "fp8")
                                      + encode_tensor("layers.1.ffn.experts.0.w2.weight", w, "fp4")
                                      + encode_tensor("layers.1.attn_norm.weight", w[0], "bf16")))
    meta = bucket_metadata(named)
    port = _free_port()
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER, str(port), json.dumps(meta)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        group = init_weight_sync_group(backend="gloo", master_address="127.0.0.1", master_port=port, world_size=2,
                                       rank=0, group_name="weight_update_group", timeout_s=60)
        for _, t in named:
            dist.broadcast(wire_view(t), src=0, group=group)
        out, err = receiver.communicate(timeout=120)
        dist.destroy_process_group(group)
    finally:
        if receiver.poll() is None:
            receiver.kill()
    assert receiver.returncode == 0, err
    assert json.loads(out) == {n: tensor_checksum(t) for n, t in named}


# ------------------------------------------------------------------------------------------- GPU cluster
@pytest.mark.gpu
def test_real_sglang_on_ray_generates_and_takes_distributed_weights(tmp_path):  # pragma: no cover - GPU only
    """Needs: sglang installed, a GPU Ray cluster (RAY_ADDRESS), V4RL_SGLANG_MODEL = an HF FP8 checkpoint."""
    pytest.importorskip("sglang")
    ray = pytest.importorskip("ray")
    model = os.environ.get("V4RL_SGLANG_MODEL")
    if not model:
        pytest.skip("set V4RL_SGLANG_MODEL to a DeepSeek-V4 HF FP8 checkpoint directory")
    from checkpoints.hf import read_raw_tensors
    from engines.rollout.launcher import DistributedWeightSync, launch_sglang_servers

    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"))
    spec = SGLangServerSpec(model_path=model, tp_size=int(os.environ.get("V4RL_SGLANG_TP", "1")))
    fleet = launch_sglang_servers(spec, num_engines=1)
    try:
        [client] = fleet.clients
        [before] = client.generate_ids([[0, 100, 200]], {"max_new_tokens": 8, "temperature": 0})
        sync = DistributedWeightSync([client], master_address=ray.util.get_node_ip_address(),
                                     master_port=_free_port(), engine_world_sizes=[spec.tp_size])
        sync.connect()
        raw = read_raw_tensors(model)
        encoded = [(n, t) for name, t in raw.items()
                   for n, t in ([(name, t.data), (name[:-len("weight")] + "scale", t.scale)]
                                if hasattr(t, "scale") else [(name, t)])]
        assert sync.push(sglang_named_tensors(encoded), weight_version="resync", bucket_bytes=1 << 28) >= 1
        [after] = client.generate_ids([[0, 100, 200]], {"max_new_tokens": 8, "temperature": 0})
        assert after.output_ids == before.output_ids and after.weight_version == "resync"
        sync.close()
    finally:
        fleet.stop()
