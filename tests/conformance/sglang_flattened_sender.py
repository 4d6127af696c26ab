"""Runs INSIDE a subprocess with SGLang 0.5.23 on sys.path: the trainer side (rank 0) of SGLang's distributed
update with `load_format: "flattened_bucket"`, each bucket flattened by SGLang's own `FlattenedTensorBucket`
(`sglang/srt/weight_sync/tensor_bucket.py`) and sent as its ONE uint8 broadcast, names/dtypes/shapes announced
from the bucket's metadata, as SGLang's receiver (`_receive_bucketed_weights_from_distributed`) expects.
Neither Miles generation sends flattened buckets over torch.distributed (they use the format for CUDA-IPC
`update_weights_from_tensor` only), so SGLang's own bucket is the sender here. Tensors in a bucket are ordered by
descending element size so every one starts aligned (SGLang refuses an unaligned one); with `misalign` the first
bucket starts with one extra byte (a 1-element uint8 tensor), so the tensor after it is unaligned and the engine
must refuse the bucket.

    python -c ... sglang_flattened_sender.py URL EXPORT_DIR MASTER_PORT OUT_JSON [misalign]
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

from engines.rollout.fused_pairs import update_buckets
from engines.rollout.launcher import init_weight_sync_group, sglang_named_tensors
from engines.rollout.sglang import SGLangClient, SGLangError

GROUP = "flattened"


def main(url: str, export: str, master_port: str, out_json: str, misalign: str = "") -> None:
    tensors = []
    for shard in sorted(Path(export).glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            tensors += [(name, f.get_tensor(name)) for name in f.keys()]
    answers, pool = [], ThreadPoolExecutor(1)
    with SGLangClient(url, timeout=600) as client:
        joined = pool.submit(client.init_weights_update_group, master_address="127.0.0.1",
                             master_port=int(master_port), rank_offset=1, world_size=2, group_name=GROUP,
                             backend="nccl")
        group = init_weight_sync_group(backend="gloo", master_address="127.0.0.1", master_port=int(master_port),
                                       world_size=2, rank=0, group_name=GROUP, timeout_s=120)
        joined.result()
        client.pause_generation("retract")
        client.begin_weight_update()
        batches = list(update_buckets(sglang_named_tensors(tensors), bucket_bytes=200_000))
        for k, bucket in enumerate(batches):
            bucket = sorted(bucket, key=lambda nt: nt[1].element_size(), reverse=True)
            if misalign and k == 0:
                bucket = [("model.alignment_probe", torch.zeros(1, dtype=torch.uint8)), *bucket]
            flat = FlattenedTensorBucket(named_tensors=bucket)
            meta = flat.get_metadata()
            last = k == len(batches) - 1
            announced = pool.submit(client.update_weights_from_distributed, names=[m.name for m in meta],
                                    dtypes=[str(m.dtype).removeprefix("torch.") for m in meta],
                                    shapes=[list(m.shape) for m in meta], group_name=GROUP, flush_cache=last,
                                    weight_version="flat-1" if last else None, load_format="flattened_bucket")
            dist.broadcast(flat.get_flattened_tensor(), src=0, group=group)
            try:
                answers.append({"success": True, **announced.result()})
            except SGLangError as exc:
                answers.append({"success": False, "message": str(exc)})
                break
        try:
            client.end_weight_update()
        except SGLangError as exc:
            answers.append({"success": False, "end": str(exc)})
        client.continue_generation()
        client.destroy_weights_update_group(GROUP)
    dist.destroy_process_group(group)
    tmp = Path(out_json + ".tmp")
    tmp.write_text(json.dumps({"buckets": len(batches), "answers": answers,
                               "dtypes": sorted({str(t.dtype) for _, t in tensors})}))
    tmp.rename(out_json)


if __name__ == "__main__":
    main(*sys.argv[1:])
