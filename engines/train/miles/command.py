"""The Miles job v4rl submits: where it reads and writes (`MilesJob`) and its command lines.

`launcher_argv` is the seed's `scripts/amd/run_deepseek_v4.py train` command; `train_args` the Miles `train.py`
arguments the preset's settings map to; `sglang_server_argv` what one rollout engine amounts to.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engines.launch import RunPreset
    from engines.profiles import HardwareProfile
    from engines.train.miles.checkpoints import Resume


@dataclass(frozen=True, kw_only=True)
class MilesJob:
    """Where one Miles run reads and writes. Keep `save_dir` across retries: that is what makes them resume."""

    run_id: str
    """--run-id (also the log file name); a retry may use a new one, resume follows save_dir."""
    hf_checkpoint: str
    """FP8 HF directory SGLang serves and Miles reads config/tokenizer from (--hf-checkpoint)."""
    ref_load: str
    """Our torch_dist BF16 directory (convert task output): --ref-load, and the start when save_dir is empty."""
    save_dir: str
    """Miles --save and --load: iter_XXXXXXX/ checkpoints + latest_checkpointed_iteration.txt."""
    miles_dir: str = "/workspace/miles"
    """The Miles checkout the launcher runs from (cwd)."""
    log_dir: str | None = None
    """Where <run_id>.log goes; None = miles_dir (the seed's /workspace/miles/${RUN_ID}.log)."""
    wandb_team: str | None = None
    """--wandb-team inside --extra-args; None leaves W&B to the launcher's defaults."""
    extra_args: tuple[str, ...] = ()
    """More Miles/Megatron/SGLang flags appended to --extra-args (argparse: the last occurrence wins)."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """More KEY=VALUE pairs for --extra-env-vars."""

    @property
    def log_path(self) -> str:
        return f"{self.log_dir or self.miles_dir}/{self.run_id}.log"

    @classmethod
    def placeholder(cls, preset: "RunPreset", profile: "HardwareProfile") -> "MilesJob":
        """A job with ${VAR} paths, for showing a launch plan before the paths exist."""
        return cls(run_id=default_run_id(preset), hf_checkpoint="${HF_CHECKPOINT}", ref_load="${REF_LOAD}",
                   save_dir="${SAVE_DIR}", miles_dir=profile.workspace)


def default_run_id(preset: "RunPreset", now: datetime | None = None) -> str:
    """The seed's run id pattern: dsv4-fp8-4node-2roll-tp1-pp4-ep4-YYYYmmdd_HHMMSS."""
    p = preset.parallel
    stamp = (now or datetime.now()).strftime("%Y%m%d_%H%M%S")
    return f"dsv4-fp8-{preset.nodes}node-{preset.rollout_nodes}roll-tp{p.tp}-pp{p.pp}-ep{p.ep}-{stamp}"


# ------------------------------------------------------------------------------------------ command lines
def megatron_parallel_args(preset: "RunPreset") -> list[str]:
    """The Megatron parallel flags of the actor (what every trainer rank is started with)."""
    p = preset.parallel
    args = ["--tensor-model-parallel-size", str(p.tp)] + (["--sequence-parallel"] if p.sp else [])
    args += ["--pipeline-model-parallel-size", str(p.pp)]
    if p.first_stage_layers is not None:
        args += ["--decoder-first-pipeline-num-layers", str(p.first_stage_layers)]
    if p.last_stage_layers is not None:
        args += ["--decoder-last-pipeline-num-layers", str(p.last_stage_layers)]
    args += ["--context-parallel-size", str(p.cp)] + (["--allgather-cp"] if p.cp > 1 else [])
    return args + ["--expert-model-parallel-size", str(p.ep), "--expert-tensor-parallel-size", str(p.expert_tp)]


def _launcher_extra_args(preset: "RunPreset", job: MilesJob, resume: "Resume | None") -> list[str]:
    extra = (["--wandb-team", job.wandb_team] if job.wandb_team else []) + (["--use-tis"] if preset.use_tis else [])
    extra += ["--ref-load", job.ref_load, "--load", job.save_dir, "--save", job.save_dir]
    if preset.enable_eval:
        extra += ["--eval-interval", str(preset.eval_interval),
                  "--n-samples-per-eval-prompt", str(preset.n_samples_per_eval_prompt)]
    return extra + list(resume.extra_args if resume else ()) + list(job.extra_args)


def launcher_argv(preset: "RunPreset", profile: "HardwareProfile", job: MilesJob,
                  resume: "Resume | None" = None) -> list[str]:
    """The seed's launch command for this preset: `python3 <launcher> train --run-id ... --extra-env-vars ...`.

    Flags in the seed's order; additions: --hf-checkpoint, and inside --extra-args our --ref-load/--load/--save
    and the eval cadence (argparse keeps the last occurrence, so they override the launcher's defaults).
    """
    c, t, r = preset, preset.train, preset.rollout
    argv = [profile.python, profile.miles_launcher, "train", "--run-id", job.run_id, "--mode", c.mode]
    argv += ["--enable-eval"] if c.enable_eval else []
    argv += ["--num-nodes", str(c.nodes), "--actor-num-nodes", str(_actor_nodes(c)),
             "--rollout-num-nodes", str(c.rollout_nodes)]
    if profile.gpus_per_node != 8:
        argv += ["--num-gpus-per-node", str(profile.gpus_per_node)]
    argv += ["--num-rollout", str(c.num_rollout), "--num-steps-per-rollout", str(t.num_steps_per_rollout),
             "--rollout-batch-size", str(t.rollout_batch_size), "--n-samples-per-prompt", str(t.n_samples_per_prompt),
             "--context-length", str(r.context_length), "--rollout-max-response-len", str(t.max_response_len),
             "--max-tokens-per-gpu", str(t.max_tokens_per_gpu),
             "--sglang-max-running-requests", str(r.max_running_requests),
             "--sglang-max-total-tokens", str(r.max_total_tokens)]
    argv += [a for a in megatron_parallel_args(preset) if a not in ("--sequence-parallel", "--allgather-cp")]
    argv += ["--hf-checkpoint", job.hf_checkpoint]
    argv += ["--extra-args", shlex.join(_launcher_extra_args(preset, job, resume))]
    env = {**profile.launcher_env, **job.extra_env}
    return argv + ["--extra-env-vars", " ".join(f"{k}={v}" for k, v in env.items())]


def _actor_nodes(preset: "RunPreset") -> int:
    return preset.nodes - preset.rollout_nodes if preset.rollout_nodes else preset.nodes


def train_args(preset: "RunPreset", profile: "HardwareProfile", job: MilesJob) -> list[str]:
    """The Miles `train.py` arguments the preset's settings map to (reference §1.2), for a launcher-free run."""
    c, t, r = preset, preset.train, preset.rollout
    args = ["--actor-num-nodes", str(_actor_nodes(c)), "--actor-num-gpus-per-node", str(profile.gpus_per_node),
            "--num-gpus-per-node", str(profile.gpus_per_node)]
    args += (["--colocate"] if not c.rollout_nodes
             else ["--rollout-num-gpus", str(c.rollout_nodes * profile.gpus_per_node)])
    args += ["--rollout-num-gpus-per-engine", str(r.engine_tp), "--sglang-tp-size", str(r.engine_tp),
             "--sglang-dp-size", str(r.engine_dp), "--sglang-ep-size", str(r.engine_ep),
             "--sglang-max-running-requests", str(r.max_running_requests),
             "--sglang-max-total-tokens", str(r.max_total_tokens), "--sglang-context-length", str(r.context_length),
             "--sglang-mem-fraction-static", str(r.mem_fraction_static),
             "--num-rollout", str(c.num_rollout), "--rollout-batch-size", str(t.rollout_batch_size),
             "--n-samples-per-prompt", str(t.n_samples_per_prompt),
             "--num-steps-per-rollout", str(t.num_steps_per_rollout),
             "--rollout-max-response-len", str(t.max_response_len),
             "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(t.max_tokens_per_gpu)]
    args += megatron_parallel_args(preset)
    if t.recompute == "full":
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    elif t.recompute == "selective":
        args += ["--recompute-granularity", "selective"]
    if t.optimizer_offload > 0:
        args += ["--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--overlap-cpu-optimizer-d2h-h2d"]
        args += ["--optimizer-offload-fraction", str(t.optimizer_offload)] if t.optimizer_offload < 1 else []
    args += ["--use-tis"] if c.use_tis else []
    if c.enable_eval:
        args += ["--eval-interval", str(c.eval_interval), "--n-samples-per-eval-prompt",
                 str(c.n_samples_per_eval_prompt)]
    return args + ["--hf-checkpoint", job.hf_checkpoint, "--ref-load", job.ref_load, "--load", job.save_dir,
                   "--save", job.save_dir, "--model-name", "deepseekv4"]


def sglang_server_argv(preset: "RunPreset", job: MilesJob, *, base_gpu_id: int = 0) -> list[str]:
    """What one rollout engine amounts to (Miles starts it in-process as a Ray actor; shown for reproduction)."""
    from engines.rollout.launcher import SGLangServerSpec, build_launch_command

    spec = SGLangServerSpec.from_preset(job.hf_checkpoint, preset, python="python3",
                                        extra_args=("--base-gpu-id", str(base_gpu_id)))
    return build_launch_command(spec)
