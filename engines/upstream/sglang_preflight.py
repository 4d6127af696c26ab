"""Preflight on the user's SGLang: its own DeepSeek-V4 model, built on CPU, takes a first load and one online update
of the run's kind on a tiny model of the run's format, compared parameter by parameter with a fresh load
(engines/upstream/sglang_model_check.py; about 3-5 min on 2 cores, < 1.5 GB). Used by `v4rl plan --sglang-dir`
(v4rl/plan_sglang.py) and by the rl-pipeline's preflight on a cluster preset (tasks/preflight.py,
`sglang_check_dir`).

The run's mode is every SGLANG_* variable the job's engines get (`job_sglang_env`: the Miles job's environment for a
cluster preset, e.g. SGLANG_DSV4_FP4_EXPERTS=0 and SGLANG_OPT_FP8_WO_A_GEMM=0 on MI355X; v4rl's launcher's for
tiny-cpu), with a start checkpoint in that expert format (FP8 experts for SGLANG_DSV4_FP4_EXPERTS=0); the other
modes SGLang can be put in (FP4 experts) are reported beside it. Each mode sets its variables itself: the caller's
exported SGLANG_* never reach SGLang. `ok` is False when the run's own mode does not reproduce a fresh load.

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
    """The job's SGLang setting (every SGLANG_* it sets, the expert format) and whose environment it is."""
    update_kind: str
    run_env: dict[str, str] = field(default_factory=dict)
    """Every SGLANG_* variable the run's mode was checked with: the job's own (the caller's shell is ignored)."""
    modes: dict[str, dict[str, Any]] = field(default_factory=dict)
    """mode -> {"setting", "env", "loads", "round_trips", "reason"}; the run's mode first."""

    @property
    def ok(self) -> bool:
        run = self.modes.get(self.run_mode) or {}
        return bool(run.get("round_trips"))

    def to_json(self) -> dict[str, Any]:
        return {"sglang": self.sglang, "run_mode": self.run_mode, "run_env": self.run_env,
                "update": self.update_kind, "ok": self.ok, "modes": self.modes}


def check(preset: str, overrides: dict[str, Any], sglang_dir: str, *, update_kind: Literal["disk", "distributed"]
          = "disk", workdir: Path | None = None) -> SGLangModelCheck:
    """Run the user's SGLang model in the job's own mode (and the others, reported). RuntimeError when it cannot run."""
    from engines.miles.launch import resolve
    from engines.upstream.sglang_model_check import Case, Mode, Update, run_cases, tiny_checkpoints

    paths = sglang_source(sglang_dir)
    eff, _ = resolve(preset, overrides)
    env, whose = job_sglang_env(eff)
    run = Mode.from_env("run", env)
    others = [Mode("wo_a-bf16", experts="fp4"), Mode("wo_a-fp8", wo_a_gemm=True, experts="fp4"),
              Mode("ue8m0", ue8m0=True, experts="fp4")]
    with tempfile.TemporaryDirectory(prefix="v4rl-sglang-model-") as tmp:
        root = workdir or Path(tmp)
        # the run's start checkpoint in the job's expert format; the fp8 wo_a GEMM needs o_lora_rank % 128 == 0
        base, update = tiny_checkpoints(root, "run", expert_dtype=run.checkpoint_experts,
                                        o_lora_rank=128 if run.wo_a_gemm else None)
        fp4, fp4_update = tiny_checkpoints(root, "fp4", expert_dtype="fp4")
        o128, o128_update = tiny_checkpoints(root, "o128", expert_dtype="fp4", o_lora_rank=128)
        cases = [Case("run", str(base), run, Update(update_kind, str(update), 20_000))]
        for m in others:
            b, u = (o128, o128_update) if m.wo_a_gemm else (fp4, fp4_update)
            cases.append(Case(m.name, str(b), m, Update(update_kind, str(u), 20_000)))
        results = run_cases(cases, paths, root, timeout=1800)
    run_label = f"{run.setting()} ({whose})"
    out = SGLangModelCheck(sglang=str(paths[0]), run_mode=run_label, update_kind=update_kind,
                           run_env=run.environment())
    for label, mode in [(run_label, run)] + [(m.setting(), m) for m in others]:
        got = results[mode.name]
        out.modes[label] = {"setting": mode.setting(), "env": mode.environment(), "loads": got.loaded,
                            "round_trips": got.round_trips, "reason": got.reason}
    return out


def job_sglang_env(eff) -> tuple[dict[str, str], str]:
    """The SGLANG_* variables the run's rollout engines get, and whose they are: a cluster preset's Miles job
    (engines/miles/env.py job_env: the profile's SGLang switches, e.g. SGLANG_DSV4_FP4_EXPERTS=0 for the
    seed's FP8-expert repackage, and the update settings), else v4rl's own SGLang launcher (launcher.launch_env)."""
    from engines.profiles import get_profile

    profile = get_profile(eff.profile)
    config = eff.hf_config() if eff.hf_config is not None else None
    if eff.profile != "cpu":
        from engines.profiles.site import Site
        from engines.miles.command import MilesJob
        from engines.miles.env import job_env

        env = job_env(eff, profile, Site(), MilesJob.placeholder(eff, profile), model_config=config)
        whose = f"the Miles job's environment, profile {profile.name}"
    else:
        from engines.rollout.launcher import SGLangServerSpec, launch_env

        spec = SGLangServerSpec.from_preset("/nonexistent", eff, profile, sglang_version=None)
        env = launch_env(spec, base={})
        whose = "v4rl's SGLang launcher environment"
    return {k: v for k, v in env.items() if k.startswith("SGLANG_")}, whose


def sglang_source(sglang_dir: str) -> list[Path]:
    """sys.path for the user's SGLang (the directory holding `sglang/`), with the pinned cache's pure-Python
    dependencies behind it when they are there (the user's own environment's packages otherwise)."""
    from engines.upstream.sources import EngineSourceMissing, sglang_paths

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
