"""Runs INSIDE a subprocess with Miles' tree and SGLang 0.5.23 on sys.path: Miles' own SGLangEngine and broadcast
functions against a running `v4rl` rollout server. Nothing here is Miles' code; it imports and calls it.

  1. `SGLangEngine(args, rank=0).init(...)` with `--rollout-external`: Miles computes its ServerArgs
     (`_compute_server_args`) and `_init_external` asserts /get_server_info equals them on every field it checks.
     SGLang 0.5.23's ServerArgs is a msgspec Struct, and Miles calls `dataclasses.fields()` on it (a Miles↔upstream
     SGLang gap, reference/conformance.md part D), so Miles is given a dataclass with 0.5.23's field names.
  2. Miles' `connect_rollout_engines_from_distributed` and `update_weights_from_distributed` (broadcast.py) as
     rank 0, with the engine behind a stand-in for its Ray actor (`.remote()` runs Miles' SGLangEngine method in a
     thread) and `ray.get` resolving those; its hard-coded backend "nccl" runs Miles' own `init_process_group` as
     gloo. FP8 weights are handed to it as uint8 views: gloo refuses float8 ("Invalid scalar type").

    python -c ... miles_external_harness.py URL EXPORT_DIR OUT_JSON
"""

from __future__ import annotations

import dataclasses
import json
import sys
from argparse import Namespace
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import msgspec
import sglang.srt.server_args as sglang_server_args

sglang_server_args.ServerArgs = dataclasses.make_dataclass(
    "ServerArgs", [f.name for f in msgspec.structs.fields(sglang_server_args.ServerArgs)])

from safetensors import safe_open  # noqa: E402

from engines.rollout.fused_pairs import update_buckets  # noqa: E402
from engines.rollout.launcher import sglang_named_tensors, wire_view  # noqa: E402
from miles.backends.megatron_utils.update_weight.update_weight_from_distributed import broadcast  # noqa: E402
from miles.backends.sglang_utils.sglang_engine import SGLangEngine  # noqa: E402
from miles.utils import distributed_utils  # noqa: E402

POOL = ThreadPoolExecutor(4)


class _Actor:
    """What `engine.method.remote(...)` needs: a future running Miles' SGLangEngine method."""

    def __init__(self, engine: SGLangEngine) -> None:
        self._engine = engine

    def __getattr__(self, name: str):
        method = getattr(self._engine, name)
        return SimpleNamespace(remote=lambda *a, **kw: POOL.submit(method, *a, **kw))


def _ray_get(refs):
    return [f.result(600) for f in refs] if isinstance(refs, list) else refs.result(600)


def _gloo_process_group(backend=None, **kwargs):
    return distributed_utils.init_process_group(backend="gloo", **kwargs)


def miles_args(hf_checkpoint: str) -> Namespace:
    return Namespace(env_report=None, sglang_router_ip=None, sglang_router_port=None, hf_checkpoint=hf_checkpoint,
                     seed=1234, offload_rollout=False, rollout_num_gpus_per_engine=1, num_gpus_per_node=1,
                     sglang_dp_size=1, sglang_pp_size=1, sglang_ep_size=1, use_rollout_routing_replay=False,
                     use_rollout_indexer_replay=False, fp16=False, colocate=False, debug_rollout_only=True,
                     actor_num_gpus_per_node=1, actor_num_nodes=1, rollout_external=True, lora_rank=0,
                     lora_adapter_path=None, multi_lora_n_adapters=0, target_modules=None)


def main(url: str, export: str, out_json: str) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    engine = SGLangEngine(miles_args(export), rank=0)
    engine.init(dist_init_addr=f"{host}:0", port=int(port), nccl_port=0, host=host)  # _init_external's check
    result = {"sanity_check": "passed"}

    broadcast.ray = SimpleNamespace(get=_ray_get, _private=SimpleNamespace(
        services=SimpleNamespace(get_node_ip_address=lambda: host)))
    broadcast.init_process_group = _gloo_process_group
    actors = [_Actor(engine)]
    args = Namespace(rollout_num_gpus_per_engine=1)
    group = broadcast.connect_rollout_engines_from_distributed(args, "miles-pp_0", actors)
    tensors = []
    for shard in sorted(Path(export).glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            tensors += [(name, f.get_tensor(name)) for name in f.keys()]
    engine.pause_generation()
    engine.flush_cache()
    engine.begin_weight_update()
    answers = []
    for bucket in update_buckets(sglang_named_tensors(tensors), bucket_bytes=200_000):
        refs = broadcast.update_weights_from_distributed("miles-pp_0", group, 1, actors,
                                                         [(n, wire_view(t)) for n, t in bucket])
        answers += _ray_get(refs)
    answers.append(engine.end_weight_update())
    engine.continue_generation()
    broadcast.disconnect_rollout_engines_from_distributed(args, "miles-pp_0", group, actors)
    result.update(buckets=len(answers) - 1, answers=answers, weight_version=engine.get_weight_version())
    Path(out_json).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
