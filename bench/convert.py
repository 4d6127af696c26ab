"""`v4rl bench convert --json OUT`: HF FP8/FP4 -> torch_dist conversion speed, side by side with its peers.

On one generated DeepSeek-V4-Flash-shaped checkpoint (real hidden size, vocabulary, heads and block
sizes; fewer layers and routed experts so it fits a small machine; >= 2 GB), in the same run and on
the same disk:
  ours       `convert_hf_to_torch_dist` with one worker per core (fsync on, as always)
  baseline   a single-process load-dequantize-save loop written like DeepSeek's `fp8_cast_bf16.py`
             (whole shard in memory, checkpoints/quant.py reference dequantizers, safetensors `save_file`)
  cp         `cp` of one file as large as our output, then `sync` of that file (like for like:
             our conversion fsyncs), and plain `cp` for reference
Reported: bytes written per second of each (best of `repeats` interleaved runs for ours and cp), the
ratios ours/cp+sync (goal >= 0.7) and ours/baseline (goal >= 3), CPU seconds and the peak RSS of
each process tree, and the load average (other work on a shared machine slows every contender).
Sources are read from the page cache by all three; `sync` runs before each timed step.

    .venv/bin/v4rl bench convert --json bench-convert.json
    V4RL_BENCH_DIR=/data/tmp .venv/bin/v4rl bench convert --json out.json   # where the ~15 GB of scratch go

`write_synthetic_checkpoint` (also used by tests/test_convert.py) writes a valid native HF checkpoint
of any config quickly: random bytes of the right kinds (no NaN FP8 codes, BF16 values of sane
magnitude, UE8M0 scales around 2**-8), no quantization pass.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from checkpoints.convert import convert_hf_to_torch_dist, default_workers
from checkpoints.hf import INDEX_FILE, hf_config_dict
from checkpoints.hf_stream import SafetensorsStreamWriter, hf_entries
from engines.model.config import CSA, HASH_MOE, HCA, TOPK_MOE, ModelConfig
from engines.model.params import native_param_specs
from checkpoints.quant import UE8M0

GIB = 1 << 30
REPO_ROOT = Path(__file__).resolve().parents[1]


def flash_like_config(num_layers: int = 2, n_routed_experts: int = 4) -> ModelConfig:
    """DeepSeek-V4-Flash shapes (transformers' defaults: hidden 4096, 64 heads x 512, vocab 129280, 128x128
    FP8 blocks, FP4 1x32 experts of width 2048), with fewer layers (CSA and HCA alternating, a hash-MoE
    first layer) and fewer routed experts."""
    return ModelConfig(num_hidden_layers=num_layers, layer_types=[(CSA, HCA)[i % 2] for i in range(num_layers)],
                       mlp_layer_types=[HASH_MOE] + [TOPK_MOE] * (num_layers - 1), n_routed_experts=n_routed_experts)


# ============================================================================================== synthetic checkpoint
class _Pool:
    """Random bytes of one kind, served as pieces starting at random offsets (fast: no per-byte RNG)."""

    def __init__(self, data: np.ndarray, rng: np.random.Generator) -> None:
        self.data, self.rng = data, rng

    def take(self, nbytes: int, align: int) -> np.ndarray:
        out = np.empty(nbytes, dtype=np.uint8)
        pos, size = 0, self.data.size
        while pos < nbytes:
            start = int(self.rng.integers(0, size // 2 // align)) * align  # element-aligned: whole values only
            n = min(nbytes - pos, size - start)
            out[pos:pos + n] = self.data[start:start + n]
            pos += n
        return out


def _pools(seed: int, size: int = 24 << 20) -> dict[str, _Pool]:
    rng = np.random.default_rng(seed)
    fp8 = rng.integers(0, 254, size, dtype=np.uint8)
    fp8[fp8 == 0x7F] = 0x7E  # no NaN codes (0x7F, 0xFF)
    sign = rng.integers(0, 2, size // 2, dtype=np.uint16) << 15
    bf16 = (sign | (rng.integers(118, 127, size // 2, dtype=np.uint16) << 7) | rng.integers(0, 128, size // 2,
                                                                                              dtype=np.uint16))
    fp32 = (rng.standard_normal(size // 4) * 0.05).astype(np.float32)
    return {"fp8": _Pool(fp8, rng), "any": _Pool(rng.integers(0, 256, size, dtype=np.uint8), rng),
            "bf16": _Pool(bf16.view(np.uint8), rng), "fp32": _Pool(fp32.view(np.uint8), rng)}


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...], pools: dict[str, _Pool], n_experts: int,
                   rng: np.random.Generator) -> torch.Tensor:
    n = math.prod(shape)
    if dtype == UE8M0:
        raw = rng.integers(115, 124, n, dtype=np.uint8)  # scales 2**-12 .. 2**-4
    elif dtype == torch.int64:
        return torch.from_numpy(rng.integers(0, n_experts, n, dtype=np.int64)).reshape(shape)
    elif dtype == torch.float32 and shape and len(shape) == 2 and shape[-1] <= 64:  # fp32 block scales
        return torch.from_numpy(rng.uniform(1e-4, 1e-2, n).astype(np.float32)).reshape(shape)
    else:
        kind = {torch.float8_e4m3fn: "fp8", torch.int8: "any", torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
        raw = pools[kind].take(n * dtype.itemsize, dtype.itemsize)
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def write_synthetic_checkpoint(out_dir: str | Path, cfg: ModelConfig, *, seed: int = 0, scale_fmt: str = "ue8m0",
                               expert_dtype: str = "fp4", max_shard_bytes: int = 512 << 20) -> Path:
    """A native DeepSeek-V4 HF checkpoint (FP8 + FP4 experts) with random content, written without quantizing."""
    out = Path(out_dir)
    out.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    pools = _pools(seed)
    shards: list[list[tuple[str, torch.dtype, tuple[int, ...]]]] = [[]]
    size = 0
    for name, spec in native_param_specs(cfg).items():
        entries = hf_entries(name, spec.kind, spec.shape, "hf-fp8", expert_dtype, scale_fmt)
        n = sum(math.prod(s) * d.itemsize for _, d, s in entries)
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(entries)
        size += n
    weight_map, total = {}, 0
    for k, entries in enumerate(shards, start=1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        writer = SafetensorsStreamWriter(out / file, entries, fsync=False)
        for name, dtype, shape in entries:
            writer.write(name, _random_tensor(dtype, shape, pools, cfg.n_routed_experts, rng))
            weight_map[name] = file
            total += math.prod(shape) * dtype.itemsize
        writer.close()
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    body = hf_config_dict(cfg, weight_format="fp8", expert_dtype=expert_dtype, scale_fmt=scale_fmt)  # type: ignore[arg-type]
    (out / "config.json").write_text(json.dumps(body, indent=2) + "\n")
    return out


# ============================================================================================== peers
def baseline_fp8_cast_bf16(src: Path, dst: Path) -> None:
    """DeepSeek `inference/fp8_cast_bf16.py` on CPU: per shard load everything, dequantize 1-byte weights with
    their scale (an LRU of two shards for scales elsewhere), save the shard; rewrite the index without scales.
    FP4 experts go through the reference FP4 dequantizer (DeepSeek's script has no FP4 branch)."""
    from safetensors.torch import load_file, save_file

    from checkpoints.quant import dequantize_fp4_e2m1, dequantize_fp8_blockwise

    dst.mkdir(parents=True)
    weight_map = json.loads((src / INDEX_FILE).read_text())["weight_map"]
    loaded: dict[str, dict[str, torch.Tensor]] = {}

    def get_tensor(name: str) -> torch.Tensor:
        file = weight_map[name]
        if file not in loaded:
            loaded[file] = load_file(str(src / file))
            if len(loaded) > 2:
                del loaded[next(iter(loaded))]
        return loaded[file][name]

    new_map = {}
    for file in sorted(set(weight_map.values())):
        if file not in loaded:
            loaded[file] = load_file(str(src / file))
        state = loaded[file]
        out = {}
        for name, w in state.items():
            if name.endswith(".scale"):
                continue
            if w.element_size() == 1:
                scale = get_tensor(name[: -len(".weight")] + ".scale")
                if w.dtype == torch.float8_e4m3fn:
                    out[name] = dequantize_fp8_blockwise(w, scale, out_dtype=torch.bfloat16)
                else:
                    out[name] = dequantize_fp4_e2m1(w, scale, out_dtype=torch.bfloat16)
            else:
                out[name] = w
            new_map[name] = file
        save_file(out, str(dst / file))
        if len(loaded) > 2:
            del loaded[next(iter(loaded))]
    (dst / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": new_map}))


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@dataclass
class _Sample:
    seconds: float
    cpu_seconds: float
    peak_rss: int


def _measure(argv: list[str], *, timed_inside: bool) -> _Sample:
    """Run one contender in its own process tree from a clean slate (`sync` first); sample the tree's RSS.

    timed_inside: the child prints {"seconds", "cpu_seconds"} for the work alone (interpreter start and
    imports excluded); otherwise wall time and CPU are measured from here (cp).
    """
    import psutil

    os.sync()  # no dirty pages of the previous contender still being written back
    c0 = _children_cpu()
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, cwd=REPO_ROOT, text=True)
    tree, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        total = 0
        try:
            for p in [tree, *tree.children(recursive=True)]:
                total += p.memory_info().rss
        except psutil.Error:
            pass
        peak = max(peak, total)
        time.sleep(0.02)
    seconds, cpu = time.perf_counter() - t0, _children_cpu() - c0
    out = proc.stdout.read() if proc.stdout else ""
    if proc.returncode:
        raise RuntimeError(f"{argv[:3]} failed with exit code {proc.returncode}: {out[-2000:]}")
    if timed_inside:
        inner = json.loads(out.strip().splitlines()[-1])
        seconds, cpu = inner["seconds"], inner["cpu_seconds"]
    return _Sample(seconds, cpu, peak)


def _children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _python(contender: str, src: Path, dst: Path, workers: int) -> list[str]:
    code = "import sys; from bench.convert import _child; _child(*sys.argv[1:])"
    return [sys.executable, "-c", code, contender, str(src), str(dst), str(workers)]


def _child(contender: str, src: str, dst: str, workers: str) -> None:
    """Child side of `_measure`: run one Python contender and print its own time and CPU as JSON."""
    import resource

    def cpu() -> float:
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    c0, t0 = cpu(), time.perf_counter()
    if contender == "ours":
        convert_hf_to_torch_dist(src, dst, workers=int(workers))
    else:
        baseline_fp8_cast_bf16(Path(src), Path(dst))
    print(json.dumps({"seconds": time.perf_counter() - t0, "cpu_seconds": cpu() - c0}))


def _write_blob(path: Path, nbytes: int) -> None:
    chunk = np.random.default_rng(1).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            f.write(chunk[: min(left, len(chunk))])
            left -= len(chunk)


def main(json_out: Path, *, num_layers: int = 4, n_routed_experts: int = 16, workers: int | None = None,
         repeats: int = 3, work_dir: str | Path | None = None) -> dict[str, Any]:
    """Run the benchmark, write JSON to json_out, print a short table; returns the result dict.

    Every contender runs in its own process tree (peak RSS is that tree's). ours and cp run `repeats`
    times, interleaved, and the best run of each counts (other load on the machine only ever slows a
    contender down); the slow baseline runs once. CPU seconds per contender are reported too.
    """
    workers = workers or default_workers()
    load_before = list(os.getloadavg())
    cfg = flash_like_config(num_layers, n_routed_experts)
    base = Path(work_dir or os.environ.get("V4RL_BENCH_DIR") or tempfile.gettempdir())
    root = Path(tempfile.mkdtemp(prefix="v4rl-bench-convert-", dir=base))
    runs: dict[str, list[_Sample]] = {"ours": [], "baseline": [], "cp+sync": [], "cp": []}
    try:
        t0 = time.perf_counter()
        src = write_synthetic_checkpoint(root / "hf", cfg)
        gen_seconds = time.perf_counter() - t0
        src_bytes = _tree_bytes(src)
        out_bytes = base_bytes = 0
        blob = root / "blob"
        copy = root / "blob.copy"
        for r in range(repeats):
            runs["ours"].append(_measure(_python("ours", src, root / "td", workers), timed_inside=True))
            out_bytes = _tree_bytes(root / "td" / "release")
            shutil.rmtree(root / "td")
            if r == 0:
                _write_blob(blob, out_bytes)  # one file as large as our output, for cp
                runs["baseline"].append(_measure(_python("baseline", src, root / "bf16", 1), timed_inside=True))
                base_bytes = _tree_bytes(root / "bf16")
                shutil.rmtree(root / "bf16")
            runs["cp+sync"].append(_measure(["sh", "-c", f'cp "{blob}" "{copy}" && sync "{copy}"'],
                                            timed_inside=False))
            os.unlink(copy)
            runs["cp"].append(_measure(["cp", str(blob), str(copy)], timed_inside=False))
            os.unlink(copy)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    best = {k: min(v, key=lambda s: s.seconds) for k, v in runs.items()}
    written = {"ours": out_bytes, "baseline": base_bytes, "cp+sync": out_bytes, "cp": out_bytes}
    bps = {k: written[k] / best[k].seconds for k in best}
    result = {
        "checkpoint": {"layers": num_layers, "routed_experts": n_routed_experts, "hidden": cfg.hidden_size,
                       "vocab": cfg.vocab_size, "source_bytes": src_bytes, "torch_dist_bytes": out_bytes,
                       "generate_seconds": round(gen_seconds, 2)},
        "machine": {"cpus": os.cpu_count(), "workers": workers, "torch": torch.__version__,
                    "load_average_before": load_before, "load_average_after": list(os.getloadavg())},
        "contenders": {k: {"bytes_written": written[k], "best_seconds": round(best[k].seconds, 3),
                           "bytes_per_second": round(bps[k]), "cpu_seconds": round(best[k].cpu_seconds, 2),
                           "peak_rss_bytes": best[k].peak_rss, "all_seconds": [round(s.seconds, 2) for s in v]}
                       for k, v in runs.items()},
        "ratio_vs_cp_sync": round(bps["ours"] / bps["cp+sync"], 3),
        "ratio_vs_cp": round(bps["ours"] / bps["cp"], 3),
        "ratio_vs_baseline": round(bps["ours"] / bps["baseline"], 3),
        "cpu_seconds_baseline_over_ours": round(best["baseline"].cpu_seconds / best["ours"].cpu_seconds, 3),
        "goals": {"ratio_vs_cp_sync": 0.7, "ratio_vs_baseline": 3.0},
    }
    Path(json_out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"source {src_bytes / GIB:.2f} GiB -> torch_dist {out_bytes / GIB:.2f} GiB, {workers} workers, "
          f"load average {load_before[0]:.1f}")
    for k in ("ours", "baseline", "cp+sync", "cp"):
        print(f"  {k:9s} {best[k].seconds:7.2f} s  {bps[k] / 2**20:6.0f} MiB/s  cpu {best[k].cpu_seconds:6.1f} s  "
              f"peak RSS {best[k].peak_rss / GIB:.2f} GiB")
    print(f"  ours/cp+sync {result['ratio_vs_cp_sync']}  ours/cp {result['ratio_vs_cp']}  "
          f"ours/baseline {result['ratio_vs_baseline']}")
    return result


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "bench-convert.json"))
