"""The seed's exact launch command, for the one Miles that accepts it: PR #1300's head `a8684732f` (never merged).

The seed ran `scripts/amd/run_deepseek_v4.py train --actor-num-nodes 2 --num-rollout 200 ...`; Miles main
rejects 16 of those options (conformance A1) and that PR's launcher never saves a checkpoint (A8), so v4rl's
supported job is the `train.py` job of command.py. This module keeps the seed's command reproducible as a
documented extra: `launcher_argv` rebuilds it from the seed preset, and tests/conformance/test_miles_launcher.py
records that PR-head launcher (typer parses every option; nothing runs) on it.

    launcher_argv(SEED_RUN, get_profile("mi355x"), job)[:3]
    # ['/opt/venv/bin/python3', 'scripts/amd/run_deepseek_v4.py', 'train']
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

from engines.miles.pins import MILES_SEED_PR
from engines.miles.train_args import megatron_parallel_args

if TYPE_CHECKING:
    from engines.profiles import HardwareProfile
    from engines.presets.spec import RunPreset
    from engines.miles.checkpoints import Resume
    from engines.miles.command import MilesJob

PR_HEAD = MILES_SEED_PR.short
"""radixark/miles PR #1300 head: the only commit whose AMD launcher takes the seed's options."""


def _launcher_extra_args(preset: "RunPreset", job: "MilesJob", resume: "Resume | None") -> list[str]:
    extra = (["--wandb-team", job.wandb_team] if job.wandb_team else []) + (["--use-tis"] if preset.use_tis else [])
    extra += ["--ref-load", job.ref_load, "--load", job.save_dir, "--save", job.save_dir]
    if preset.eval.enabled:
        extra += ["--eval-interval", str(preset.eval.interval),
                  "--n-samples-per-eval-prompt", str(preset.eval.n_samples_per_prompt)]
    return extra + list(resume.extra_args if resume else ()) + list(job.extra_args)


def launcher_argv(preset: "RunPreset", profile: "HardwareProfile", job: "MilesJob",
                  resume: "Resume | None" = None) -> list[str]:
    """The seed's launch command for this preset: `python3 <launcher> train --run-id ... --extra-env-vars ...`.

    Flags in the seed's order; additions: --hf-checkpoint, and inside --extra-args our --ref-load/--load/--save
    and the eval cadence (argparse keeps the last occurrence, so they override the launcher's defaults).
    `--extra-env-vars` is one space-separated string, as the launcher splits it on spaces (conformance A12):
    a value with whitespace cannot travel this way and is refused.
    """
    c, t, r = preset, preset.train, preset.rollout
    argv = [profile.python, profile.miles_launcher, "train", "--run-id", job.run_id, "--mode", c.mode]
    argv += ["--enable-eval"] if c.eval.enabled else []
    actor_nodes = c.nodes - c.rollout_nodes if c.rollout_nodes else c.nodes
    argv += ["--num-nodes", str(c.nodes), "--actor-num-nodes", str(actor_nodes),
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
    spaced = sorted(k for k, v in env.items() if any(ch.isspace() for ch in v))
    if spaced:
        raise ValueError(f"--extra-env-vars is split on spaces by the launcher; {spaced} hold whitespace. Use the "
                         "train.py job (engines.miles.build_command), whose runtime env keeps values whole")
    return argv + ["--extra-env-vars", " ".join(f"{k}={v}" for k, v in env.items())]
