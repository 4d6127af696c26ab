"""Prefect tasks around checkpoints: HF FP8 -> torch_dist conversion (cached across flow runs by the source's
identity while its output exists, so a new run after a crash skips it) and the megatron-core verification."""

from __future__ import annotations

import hashlib
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE


def source_identity(hf_dir: str) -> str:
    """sha256 over config.json, the index and every shard's name and size: changes when the source does."""
    d = Path(hf_dir)
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json"):
        if (d / name).exists():
            h.update(name.encode() + (d / name).read_bytes())
    for shard in sorted(d.glob("*.safetensors")):
        h.update(f"{shard.name}:{shard.stat().st_size}".encode())
    return h.hexdigest()[:20]


def _convert_key(context, parameters) -> str | None:
    """The source's identity, the destination and its key names; None (run, cache nothing) while the destination
    does not exist: a run directory deleted since would otherwise be 'converted' from the cache, and the conversion
    is a no-op anyway when the destination is complete (found by the cluster-rehearsal, its run dir removed)."""
    if not Path(parameters["dst"]).exists():
        return None
    names = parameters.get("megatron_names") or "plugin"
    suffix = "" if names == "plugin" else f"-{names}"  # plugin: the key runs converted before keep
    return (f"convert-{source_identity(parameters['hf_dir'])}-{hashlib.sha256(parameters['dst'].encode()).hexdigest()[:12]}"
            f"{suffix}")


@task(name="convert", cache_key_fn=_convert_key, persist_result=True, retries=1, retry_delay_seconds=5,
      timeout_seconds=6 * 3600)
def convert(hf_dir: str, dst: str, workers: int | None = None, megatron_names: str = "plugin") -> dict:
    """HF FP8/FP4 -> Megatron torch_dist BF16 (streaming, atomic); a no-op when dst is complete for this source.
    `megatron_names`: the key names of the Miles generation that loads it (plugin | megatron; the flow takes them
    from its Miles settings, flows/params.py PipelineParams.megatron_names)."""
    from checkpoints.convert import convert_hf_to_torch_dist

    result = convert_hf_to_torch_dist(hf_dir, dst, workers=workers, megatron_names=megatron_names)  # type: ignore[arg-type]
    return {"dst": str(result.dst), "skipped": result.skipped, "tensors": result.tensors,
            "bytes_out": result.bytes_out, "seconds": result.seconds, "megatron_names": megatron_names}


@task(name="verify", cache_policy=NO_CACHE, timeout_seconds=3 * 3600)
def verify(torch_dist_dir: str, hf_dir: str) -> dict:
    """megatron-core loads the output; names, shapes, dtypes, finiteness and values match the HF source."""
    from checkpoints.convert import verify_torch_dist

    report = verify_torch_dist(torch_dist_dir, against=hf_dir)
    return {"tensors": report.tensors, "compared": report.compared, "bytes": report.bytes, "seconds": report.seconds}
