"""The Miles job v4rl builds and submits: where it reads and writes (`MilesJob`) and what runs (`MilesCommand`).

v4rl owns the whole job: from the run preset, the planner's cluster, the checkpoint's config.json and the
hardware profile it builds the complete `train.py` argv (model flags: model_args.py; the rest: train_args.py)
and the runtime environment every rank gets (env.py), for either Miles DeepSeek-V4 generation (MILES_PINS below,
MilesSettings.generation). It is submitted
to the user's existing Ray cluster by submit.py; Miles' own launchers are not involved (the seed's launcher
command for the unmerged PR-head stays reproducible in pr_launcher.py).

    job = MilesJob(run_id="r1", hf_checkpoint="/data/V4-Flash-FP8", ref_load="/data/V4-Flash_torch_dist",
                   save_dir="/ckpt/r1", miles_dir="/workspace/miles")
    cmd = build_command(SEED_RUN, job, site=Site(ray_address="http://10.0.0.1:8265", master_addr="10.0.0.1"))
    cmd.argv[:2], cmd.env["MASTER_ADDR"]      # ['--disable-bias-linear', '--num-layers'], '10.0.0.1'
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engines.miles.pins import MEGATRON, MEGATRON_GEN2, MILES, MILES_GEN2
from engines.layout import ClusterSpec
from engines.profiles import HardwareProfile, get_profile
from engines.presets.runs import layout_input
from engines.presets.spec import RunPreset
from engines.profiles.site import Site
from engines.miles import train_args as T
from engines.miles.env import job_env
from engines.miles.model_args import model_args, read_config

if TYPE_CHECKING:
    from engines.miles.checkpoints import Resume

MILES_PIN = {"miles": MILES.short, "megatron_lm": MEGATRON.short, "megatron_lm_branch": "miles-main"}
"""The first DeepSeek-V4 generation's pins (engines/miles/pins.py holds them): radixark/miles main at
31f1ca961 with radixark/Megatron-LM miles-main at 2e64d788b (what Miles' Dockerfiles clone)."""
MILES_PINS = {1: MILES_PIN,
              2: {"miles": MILES_GEN2.short, "megatron_lm": MEGATRON_GEN2.short, "megatron_lm_branch": "dsv4-dual-backend"}}
"""The pins of each DeepSeek-V4 generation the job is built for (MilesSettings.generation); `v4rl plan --miles-dir
DIR` detects a checkout's generation and checks the job against it."""
ENTRYPOINT = "train.py"


@dataclass(frozen=True, kw_only=True)
class MilesJob:
    """Where one Miles run reads and writes. Keep `save_dir` across retries: that is what makes them resume."""

    run_id: str
    """Names the log file and the W&B group; a retry may use a new one, resume follows save_dir."""
    hf_checkpoint: str
    """FP8 HF directory SGLang serves and Miles reads config/tokenizer from (--hf-checkpoint)."""
    ref_load: str
    """Our torch_dist BF16 directory (convert task output): --ref-load, and the start when save_dir is empty."""
    save_dir: str
    """Miles --save and --load: iter_XXXXXXX/ checkpoints + latest_checkpointed_iteration.txt."""
    miles_dir: str = "/workspace/miles"
    """The Miles checkout on the cluster nodes (train.py's directory, first on PYTHONPATH)."""
    megatron_dir: str = "/root/Megatron-LM"
    """The Megatron-LM (miles-main) checkout on the cluster nodes (second on PYTHONPATH)."""
    data_dir: str = "/root/datasets"
    """Where the preset's relative dataset paths live on the cluster (Miles' launcher --data-dir default)."""
    log_dir: str | None = None
    """Where <run_id>.log goes; None = miles_dir (the seed's /workspace/miles/${RUN_ID}.log)."""
    wandb_project: str | None = None
    """--use-wandb --wandb-project; None leaves W&B off (metrics still reach v4rl through the log)."""
    wandb_team: str | None = None
    """--wandb-team (with wandb_project)."""
    extra_args: tuple[str, ...] = ()
    """More Miles/Megatron/SGLang flags appended last (argparse: the last occurrence wins)."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """More variables for every rank's runtime env (win over the profile's)."""

    @property
    def log_path(self) -> str:
        return f"{self.log_dir or self.miles_dir}/{self.run_id}.log"

    @classmethod
    def placeholder(cls, preset: RunPreset, profile: HardwareProfile) -> "MilesJob":
        """A job with ${VAR} paths, for showing a launch plan before the paths exist."""
        return cls(run_id=default_run_id(preset), hf_checkpoint="${HF_CHECKPOINT}", ref_load="${REF_LOAD}",
                   save_dir="${SAVE_DIR}", miles_dir=profile.workspace, megatron_dir=profile.megatron_workspace)


def default_run_id(preset: RunPreset, now: datetime | None = None) -> str:
    """The seed's run id pattern: dsv4-fp8-4node-2roll-tp1-pp4-ep4-YYYYmmdd_HHMMSS."""
    p = preset.parallel
    stamp = (now or datetime.now()).strftime("%Y%m%d_%H%M%S")
    return f"dsv4-fp8-{preset.nodes}node-{preset.rollout_nodes}roll-tp{p.tp}-pp{p.pp}-ep{p.ep}-{stamp}"


@dataclass(frozen=True)
class MilesCommand:
    """One built Miles job: `python3 <miles_dir>/train.py <argv>` with `env` in every rank's Ray runtime env."""

    argv: list[str]
    """Every token after train.py."""
    env: dict[str, str]
    """The runtime env vars (Ray delivers them to the driver, every Megatron rank and every SGLang engine)."""
    miles_dir: str
    entrypoint: str = ENTRYPOINT
    generation: int = 1
    """The Miles DeepSeek-V4 generation it was built for (MilesSettings.generation)."""

    @property
    def script(self) -> str:
        return f"{self.miles_dir}/{self.entrypoint}"

    def flag_values(self) -> dict[str, list[str]]:
        """flag -> its values as given (a bare flag -> []); a repeated flag keeps its last occurrence."""
        return parse_flags(self.argv)

    def to_json(self) -> dict[str, Any]:
        return {"entrypoint": self.entrypoint, "script": self.script, "argv": list(self.argv), "env": dict(self.env),
                "generation": self.generation, "pin": dict(MILES_PINS[self.generation])}


def parse_flags(argv: list[str]) -> dict[str, list[str]]:
    """`--flag v1 v2 --bare` -> {"--flag": ["v1", "v2"], "--bare": []}; values are the tokens up to the next
    flag (negative numbers are values). The last occurrence of a repeated flag wins, as in argparse."""
    out: dict[str, list[str]] = {}
    flag: str | None = None
    for token in argv:
        if token.startswith("--") and len(token) > 2 and not _is_number(token):
            flag = token
            out[flag] = []
        elif flag is None:
            raise ValueError(f"argv starts with a value {token!r}, not a --flag")
        else:
            out[flag].append(token)
    return out


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def build_command(preset: RunPreset, job: MilesJob, *, site: Site | None = None, cluster: ClusterSpec | None = None,
                  profile: HardwareProfile | None = None, resume: "Resume | None" = None,
                  hf_config: dict[str, Any] | None = None) -> MilesCommand:
    """The complete Miles job for this preset (sections in Miles' launcher's order, then resume and extra flags).

    The model flags come from `hf_config`, else `<job.hf_checkpoint>/config.json` when that directory is here,
    else the preset's own config (a launch plan before the checkpoint exists). `cluster` defaults to the
    preset's on its profile (give the planner's when overrides changed it).
    """
    profile = profile or get_profile(preset.profile)
    cluster = cluster or layout_input(preset, profile=profile).cluster
    config, source = _model_config(preset, job, hf_config)
    argv = model_args(config, source=source, generation=preset.miles.generation)
    argv += T.vocab_args(preset, int(config["vocab_size"])) + T.dsv4_args(preset, profile)
    argv += T.checkpoint_args(preset, job) + T.rollout_args(preset, job) + T.optimizer_args(preset)
    argv += T.grpo_args(preset) + T.wandb_args(job)
    argv += T.perf_args(preset, num_layers=int(config.get("num_hidden_layers") or 0) or None,
                        hash_layers=int(config.get("num_hash_layers") or config.get("n_hash_layers") or 0))
    argv += T.eval_args(preset, job) + T.sglang_args(preset) + T.misc_args(preset, cluster, profile)
    argv += list(resume.extra_args if resume else ()) + list(job.extra_args)
    env = job_env(preset, profile, site or Site(), job, model_config=config)
    return MilesCommand(argv=argv, env=env, miles_dir=job.miles_dir, generation=preset.miles.generation)


def _model_config(preset: RunPreset, job: MilesJob, given: dict[str, Any] | None) -> tuple[dict[str, Any], str]:
    if given is not None:
        return given, "the given config.json"
    if not job.hf_checkpoint.startswith("${") and Path(job.hf_checkpoint).is_dir():
        return read_config(job.hf_checkpoint), f"{job.hf_checkpoint}/config.json"
    if preset.hf_config is None:
        raise ValueError(f"preset {preset.name!r} has no model config.json and {job.hf_checkpoint} is not a "
                         "directory here; point hf_checkpoint at the FP8 HF checkpoint")
    return preset.hf_config(), f"preset {preset.name}'s config.json"


def with_paths(job: MilesJob, **paths: str | None) -> MilesJob:
    """`job` with the given non-empty fields replaced (CLI flags that may be unset)."""
    return dataclasses.replace(job, **{k: v for k, v in paths.items() if v})
