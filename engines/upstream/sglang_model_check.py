"""SGLang's own DeepSeek-V4 model on CPU, fed what v4rl writes: first loads and online updates, per post-load mode.

The host side of engines/upstream/sglang_model_probe.py (which runs in a subprocess with SGLang's source on
sys.path, engines.upstream.sources.engine_python). Here: the cases (checkpoint, SGLang mode, update kind), the
distributed buckets cut by v4rl's own `launcher.buckets` (what `DistributedWeightSync.push` sends, in SGLang's
names), and the verdict per case. Used by the conformance suite (tests/conformance/test_sglang_model.py) and by
`v4rl plan --sglang-dir` (v4rl/plan_sglang.py).

    cases = [Case("fp8", base, Mode("wo_a-bf16"), Update("disk", update_dir))]
    results = run_cases(cases, sglang_paths(), workdir)      # one subprocess: ~2-3 min on 2 busy cores
    results["fp8"].round_trips, results["fp8"].reason
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

PROBE = Path(__file__).with_name("sglang_model_probe.py")


WO_A_GEMM_VAR = "SGLANG_OPT_FP8_WO_A_GEMM"
FP4_EXPERTS_VAR = "SGLANG_DSV4_FP4_EXPERTS"
"""SGLang's switch for the routed experts' storage: 1 MXFP4 (the release format), 0 FP8 (the seed's repackage);
unset, SGLang detects it from the checkpoint (configs/model_config.py). A wrong one fails the first load."""


def _env_bool(value: str | None, default: bool) -> bool:
    """SGLang's EnvBool parsing (environ.py): true/1/yes/y, false/0/no/n; anything else its default."""
    text = (value or "").strip().lower()
    return True if text in ("true", "1", "yes", "y") else False if text in ("false", "0", "no", "n") else default


@dataclass(frozen=True)
class Mode:
    """One of SGLang's post-load paths that can be selected on CPU, and every SGLANG_* variable it runs with (the
    probe clears the caller's SGLANG_* first: a shell with a job's variables exported changes nothing)."""

    name: str
    wo_a_gemm: bool = False
    """SGLANG_OPT_FP8_WO_A_GEMM: wo_a kept FP8 with its block scale reshaped per group (1), or dequantized to BF16
    at load (0)."""
    ue8m0: bool = False
    """DeepGEMM on an sm100 GPU: dense FP8 block scales requantized to UE8M0 and packed after each load."""
    experts: Literal["fp4", "fp8"] | None = None
    """The routed experts' storage SGLang is told (SGLANG_DSV4_FP4_EXPERTS 1 | 0); None leaves the variable unset,
    and SGLang detects the format from the checkpoint (a preflight's start checkpoint is then FP4, the release's)."""
    env: tuple[tuple[str, str], ...] = ()
    """More SGLANG_* variables of this mode (a job's own environment); wo_a_gemm and experts win over them."""

    @classmethod
    def from_env(cls, name: str, env: dict[str, str]) -> "Mode":
        """The mode a process with these SGLANG_* variables runs in (SGLang's defaults where one is unset)."""
        sglang = {k: v for k, v in env.items() if k.startswith("SGLANG_")}
        experts = None if FP4_EXPERTS_VAR not in sglang else \
            ("fp4" if _env_bool(sglang[FP4_EXPERTS_VAR], True) else "fp8")
        return cls(name, wo_a_gemm=_env_bool(sglang.get(WO_A_GEMM_VAR), True), experts=experts,
                   env=tuple(sorted(sglang.items())))

    @property
    def checkpoint_experts(self) -> Literal["fp4", "fp8"]:
        return self.experts or "fp4"

    def environment(self) -> dict[str, str]:
        """Every SGLANG_* variable the probe sets for this case; no other SGLANG_* reaches SGLang."""
        out = {WO_A_GEMM_VAR: str(int(self.wo_a_gemm))}
        if self.experts is not None:
            out[FP4_EXPERTS_VAR] = str(int(self.experts == "fp4"))
        return {**out, **{k: v for k, v in self.env if k not in out}}

    def setting(self) -> str:
        parts = [f"{k}={v}" for k, v in self.environment().items()]
        parts.append(f"{self.experts.upper()} experts" if self.experts else
                     f"{FP4_EXPERTS_VAR} unset (SGLang detects the experts' format from the checkpoint)")
        if self.ue8m0:
            parts.append("DeepGEMM UE8M0 scales (sm100)")
        return ", ".join(parts)


@dataclass(frozen=True)
class Update:
    """An online update SGLang runs on the loaded model."""

    kind: Literal["disk", "distributed"]
    path: str
    """The update's checkpoint directory (disk: what /update_weights_from_disk gets; distributed: its tensors,
    sent in v4rl's buckets)."""
    bucket_bytes: int = 1 << 30
    """Distributed only: DistributedWeightSync.push's bucket size."""


@dataclass(frozen=True)
class Case:
    name: str
    base: str
    """The checkpoint SGLang starts from."""
    mode: Mode
    update: Update | None = None
    dump: str | None = None
    """Write the first load's parameters here (safetensors), for value checks."""


@dataclass
class CaseResult:
    """What SGLang did with one case."""

    name: str
    raw: dict[str, Any] = field(repr=False)

    @property
    def loaded(self) -> bool:
        """Built, first load without error, nothing left unconsumed or unfilled."""
        first = self.raw.get("first_load") or {}
        return bool(first.get("ok")) and not first.get("not_found") and not first.get("not_initialized") \
            and not first.get("sentinel_left")

    @property
    def round_trips(self) -> bool:
        """The update ran and left every parameter exactly as a fresh load of the same files."""
        return self.loaded and bool((self.raw.get("update") or {}).get("ok")) and "differences" in self.raw \
            and not self.raw["differences"]

    @property
    def reason(self) -> str:
        """Why not (the first thing that went wrong, SGLang's own words), '' when it round-trips or only loads."""
        raw = self.raw
        if not (raw.get("build") or {"ok": True})["ok"]:
            return "build: " + raw["build"]["error"]
        first = raw.get("first_load") or {}
        if not first.get("ok"):
            return "first load: " + first.get("error", "did not run")
        for key, what in (("not_found", "not consumed"), ("not_initialized", "not filled"),
                          ("sentinel_left", "left at the sentinel")):
            if first.get(key):
                return f"first load: {what}: {first[key][0]}"
        upd = raw.get("update")
        if upd is None:
            return ""
        if not upd["ok"]:
            restore = raw.get("not_restored") or []
            return "update: " + upd["message"] + (f"; not restored before loading: {restore[0]}" if restore else "")
        if upd.get("not_found"):
            return "update: not consumed: " + upd["not_found"][0]
        if raw.get("fresh_load"):
            return "fresh load of the update: " + raw["fresh_load"].get("error", "")
        return ("update differs from a fresh load: " + raw["differences"][0]) if raw.get("differences") else ""


def write_buckets(update_dir: str | Path, out: Path, bucket_bytes: int) -> int:
    """The update's tensors as DistributedWeightSync sends them: SGLang's names (`sglang_named_tensors`), cut by
    `launcher.buckets`; one safetensors file per bucket plus buckets.json (the order). Returns the bucket count."""
    from safetensors.torch import save_file

    from engines.rollout.launcher import buckets, sglang_named_tensors

    encoded = _encoded_tensors(update_dir)
    out.mkdir(parents=True, exist_ok=True)
    order = []
    for k, bucket in enumerate(buckets(sglang_named_tensors(encoded), bucket_bytes)):
        save_file({n: t.contiguous() for n, t in bucket}, str(out / f"bucket-{k:05d}.safetensors"))
        order.append([n for n, _ in bucket])
    tmp = out / "buckets.json.partial"
    tmp.write_text(json.dumps(order))
    os.replace(tmp, out / "buckets.json")
    return len(order)


def _encoded_tensors(update_dir: str | Path) -> list[tuple[str, Any]]:
    """(native on-disk name, tensor) pairs in the files' order: `X.weight` and `X.scale` as stored."""
    from safetensors import safe_open

    index = Path(update_dir) / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else sorted(p.name for p in Path(update_dir).glob("*.safetensors"))
    out = []
    for name in files:
        with safe_open(str(Path(update_dir) / name), framework="pt") as f:
            out += [(key, f.get_tensor(key)) for key in f.keys()]
    return out


def run_cases(cases: Sequence[Case], paths: Sequence[str | Path], workdir: Path, *, timeout: float = 900.0,
              env: dict[str, str] | None = None) -> dict[str, CaseResult]:
    """All cases in one subprocess (SGLang imported once); name -> result. RuntimeError with the tail of the
    subprocess's output when it fails outside a case."""
    from engines.upstream.sources import engine_error, engine_python

    specs = []
    for case in cases:
        spec: dict[str, Any] = {"name": case.name, "base": str(case.base),
                                "mode": {**asdict(case.mode), "env": case.mode.environment()}, "dump": case.dump}
        if case.update is not None:
            spec["update"] = {"kind": case.update.kind, "path": str(case.update.path)}
            if case.update.kind == "distributed":
                folder = workdir / f"buckets-{case.name}"
                write_buckets(case.update.path, folder, case.update.bucket_bytes)
                spec["update"]["buckets"] = str(folder)
        specs.append(spec)
    code = f"import runpy, sys; sys.argv[0] = {str(PROBE)!r}; runpy.run_path({str(PROBE)!r}, run_name='__main__')"
    done = engine_python(code, paths, args=[json.dumps({"cases": specs})], timeout=timeout, cwd=workdir,
                         env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}, check=False)
    line = next((x for x in reversed(done.stdout.splitlines()) if x.startswith("PROBE ")), None)
    if line is None:
        raise RuntimeError(f"SGLang's model probe ({paths[0]}) exited with {done.returncode} before reporting: "
                           f"{engine_error(done.stderr, done.stdout)}")
    return {r["name"]: CaseResult(r["name"], r) for r in json.loads(line[len("PROBE "):])["cases"]}


# ------------------------------------------------------------------------------------ tiny checkpoints
def tiny_checkpoints(root: Path, name: str, *, expert_dtype: Literal["fp4", "fp8"] = "fp4",
                     o_lora_rank: int | None = None, scale_fmt: Literal["ue8m0", "fp32"] = "ue8m0",
                     base: str | Path | None = None) -> tuple[Path, Path]:
    """A tiny DeepSeek-V4 checkpoint in one storage format, and an update of it (v4rl's own writer both times).

    The weights are tiny-base's (engines/train/run.py DEFAULT_BASE, or `base`); where `o_lora_rank` changes a
    shape (wo_a, wo_b) they are drawn at random. The update moves every floating weight by a seeded 2% (a
    training step's stand-in) and is written in the same format, so an update that is not applied shows.
    Returns (checkpoint, update), both under root/name."""
    import dataclasses

    import torch

    from checkpoints.hf import load_hf_checkpoint, save_hf_checkpoint
    from engines.model.params import native_param_specs
    from engines.train.run import DEFAULT_BASE

    source = Path(base or DEFAULT_BASE)
    cfg, native = load_hf_checkpoint(source, out_dtype=torch.float32)
    if o_lora_rank is not None:
        cfg = dataclasses.replace(cfg, o_lora_rank=o_lora_rank)
    gen = torch.Generator().manual_seed(20)
    state = {}
    for key, spec in native_param_specs(cfg).items():
        t = native[key]
        if tuple(t.shape) != tuple(spec.shape):
            t = torch.randn(spec.shape, generator=gen) * 0.05
        state[key] = t
    moved = {k: (t * (1 + 0.02 * torch.randn(t.shape, generator=gen)) if t.is_floating_point() else t)
             for k, t in state.items()}
    out = root / name
    paths = []
    for label, tensors in (("base", state), ("update", moved)):
        paths.append(save_hf_checkpoint(out / label, cfg, tensors, weight_format="fp8", expert_dtype=expert_dtype,
                                        scale_fmt=scale_fmt, tokenizer_dir=source, overwrite=True))
    return Path(paths[0]), Path(paths[1])
