"""Trainer side of a weight broadcast, run as its own process by tests: rank 0 of a gloo group with the engine.

Reads a HF-layout export's stored tensors (FP8/FP4 bytes and scales, as `v4rl export --format hf-fp8` writes
them), names them as SGLang does (`launcher.sglang_named_tensors`) and pushes them with v4rl's own trainer-side
client (`launcher.DistributedWeightSync`: pause, begin, buckets that keep fused pairs whole, end, continue).

    python tests/broadcast_sender.py URL EXPORT_DIR MASTER_PORT BUCKET_BYTES WEIGHT_VERSION
"""

from __future__ import annotations

import sys
from pathlib import Path

from safetensors import safe_open

from engines.rollout.launcher import DistributedWeightSync, sglang_named_tensors
from engines.rollout.sglang import SGLangClient


def stored_tensors(export: Path):
    for shard in sorted(export.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def main(url: str, export: str, master_port: str, bucket_bytes: str, weight_version: str) -> None:
    with SGLangClient(url, timeout=600) as client:
        sync = DistributedWeightSync([client], master_address="127.0.0.1", master_port=int(master_port),
                                     engine_world_sizes=[1], backend="gloo", timeout_s=120)
        sync.connect()
        try:
            buckets = sync.push(sglang_named_tensors(stored_tensors(Path(export))), weight_version=weight_version,
                                bucket_bytes=int(bucket_bytes))
        finally:
            sync.close()
    print(f"pushed {buckets} buckets")


if __name__ == "__main__":
    main(*sys.argv[1:])
