"""Preflight on the user's SGLang: its own DeepSeek-V4 model, built on CPU, takes a first load and one online update
of the run's kind on a tiny model of the run's format, compared parameter by parameter with a fresh load
(engines/rollout/sglang_model_check.py; about 3-5 min on 2 cores, < 1.5 GB). Used by `v4rl plan --sglang-dir`
(v4rl/plan_sglang.py) and by the rl-pipeline's preflight on a cluster preset (tasks/preflight.py,
`sglang_check_dir`).

The run's mode is what the cluster job sets (engines/rollout/update_settings.py: SGLANG_OPT_FP8_WO_A_GEMM for the
model's o_lora_rank) with FP4 routed experts (DeepSeek-V4's release format and v4rl's tiny base); the other modes
SGLang can be put in are reported beside it. `ok` is False when the run's own mode does not reproduce a fresh load.

    result = check("dsv4-flash-mi355x", {}, "~/sglang/python")
    result.ok, result.modes[result.run_mode]["reason"]
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


class SGLangUpdateRejected(ValueError):
    """The user's SGLang does not reproduce a fresh load after an online update in the run's setting."""


@dataclass
class SGLangModelCheck:
    """What the user's SGLang did with a tiny model of the run's format."""

    sglang: str
    run_mode: str
    """The cluster job's SGLang setting (e.g. SGLANG_OPT_FP8_WO_A_GEMM=0) and the expert format."""
    update_kind: str
    modes: dict[str, dict[str, Any]] = field(default_factory=dict)
    """mode -> {"setting", "loads", "round_trips", "reason"}; the run's mode first."""

    @property
    def ok(self) -> bool:
        run = self.modes.get(self.run_mode) or {}
        return bool(run.get("round_trips"))

    def to_json(self) -> dict[str, Any]:
        return {"sglang": self.sglang, "run_mode": self.run_mode, "update": self.update_kind, "ok": self.ok,
                "modes": self.modes}


def check(preset: str, overrides: dict[str, Any], sglang_dir: str, *, update_kind: Literal["disk", "distributed"]
          = "disk", workdir: Path | None = None) -> SGLangModelCheck:
    """Run the user's SGLang model on the run's mode (and the others, reported). RuntimeError when it cannot run."""
    from engines.launch import resolve
    from engines.rollout.sglang_model_check import Case, Mode, Update, run_cases, tiny_checkpoints
    from engines.rollout.update_settings import wo_a_gemm_off_reason

    paths = sglang_source(sglang_dir)
    eff, _ = resolve(preset, overrides)
    o_lora_rank = _o_lora_rank(eff)
    run_wo_a_gemm = wo_a_gemm_off_reason(o_lora_rank) is None  # what the job's environment leaves SGLang with
    experts = "fp4"  # DeepSeek-V4 checkpoints (and v4rl's tiny base) carry FP4 routed experts
    with tempfile.TemporaryDirectory(prefix="v4rl-sglang-model-") as tmp:
        root = workdir or Path(tmp)
        base, update = tiny_checkpoints(root, "run", expert_dtype=experts, o_lora_rank=128 if run_wo_a_gemm else None)
        o128, o128_update = tiny_checkpoints(root, "o128", expert_dtype=experts, o_lora_rank=128)
        run = Mode("run", wo_a_gemm=run_wo_a_gemm)
        others = [Mode("wo_a-bf16"), Mode("wo_a-fp8", wo_a_gemm=True), Mode("ue8m0", ue8m0=True)]
        cases = [Case("run", str(base), run, Update(update_kind, str(update), 20_000))]
        for m in others:
            b, u = (o128, o128_update) if m.wo_a_gemm else (base, update)
            cases.append(Case(m.name, str(b), m, Update(update_kind, str(u), 20_000)))
        results = run_cases(cases, paths, root, timeout=1800)
    run_label = f"{run.setting()}, {experts.upper()} experts (the cluster job's setting)"
    out = SGLangModelCheck(sglang=str(paths[0]), run_mode=run_label, update_kind=update_kind)
    for label, mode in [(run_label, run)] + [(f"{m.setting()}, {experts.upper()} experts", m) for m in others]:
        got = results["run" if mode is run else mode.name]
        out.modes[label] = {"setting": mode.setting(), "loads": got.loaded, "round_trips": got.round_trips,
                            "reason": got.reason}
    return out


def sglang_source(sglang_dir: str) -> list[Path]:
    """sys.path for the user's SGLang (the directory holding `sglang/`), with the pinned cache's pure-Python
    dependencies behind it when they are there (the user's own environment's packages otherwise)."""
    from engines.engine_sources import EngineSourceMissing, sglang_paths

    path = Path(sglang_dir).expanduser().resolve()
    if not (path / "sglang" / "srt" / "models" / "deepseek_v4.py").is_file():
        raise ValueError(f"--sglang-dir {path} holds no sglang/srt/models/deepseek_v4.py; point it at the directory "
                         "that contains the `sglang` package (SGLang's python/ folder)")
    try:
        deps = [p for p in sglang_paths(install=False) if p.name == "deps"]
    except EngineSourceMissing:
        deps = []
    return [path, *deps]


def _o_lora_rank(eff) -> int | None:
    model = getattr(eff, "model", None)
    return getattr(model, "o_lora_rank", None) if model is not None else None


def summary(result: SGLangModelCheck) -> str:
    """One line: the verdict, the setting and (when refused) the parameter SGLang's update got wrong."""
    if result.ok:
        return (f"SGLang ({result.sglang}) reproduces a fresh load after a {result.update_kind} update with "
                f"{result.run_mode}")
    return (f"with {result.run_mode}, an online {result.update_kind} update in SGLang ({result.sglang}) does not "
            f"reproduce a fresh load: {result.modes[result.run_mode]['reason']}; rollouts after the first update would "
            "run on other weights than trained. Fix that SGLang or change the setting before submitting")
