"""The runtime environment of a Miles job: what every rank (driver, Megatron ranks, SGLang engines) gets.

It travels in `ray job submit --runtime-env-json {"env_vars": ...}`: Ray applies it to every worker process of
the job, whatever the environment was when each node ran `ray start`. Miles' own launcher forwards only
NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME and NCCL_DEBUG* there (conformance A10); v4rl puts the whole site
network (TP_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_IB_GID_INDEX) and the seed's RCCL settings there too.

Layers, later wins: Miles' base (what `execute_train` always sets), the profile's Miles launcher env (SGLang
kernel switches), the SGLang settings online updates need (engines/rollout/update_settings.py:
SGLANG_OPT_FP8_WO_A_GEMM=0, because SGLang's default fp8 wo_a path does not survive an update and needs
o_lora_rank % 128 == 0; Miles' AMD launcher leaves the default, its CUDA launcher sets 0), the deterministic-mode
variables, the profile's collective settings and the seed's
`--extra-env-vars` (flight recorder, transport tuning), the site's network, the job's extras, PYTHONPATH.
Values are strings kept whole: nothing is ever split on whitespace (conformance A12).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from engines.rollout.update_settings import wo_a_gemm_env

if TYPE_CHECKING:
    from engines.profiles import HardwareProfile
    from engines.presets.spec import RunPreset
    from engines.profiles.site import Site
    from engines.miles.command import MilesJob

DETERMINISTIC_ENV = {"NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
"""Miles' launcher adds these with --deterministic-mode (Megatron asserts NCCL_ALGO is one it knows)."""


def job_env(preset: "RunPreset", profile: "HardwareProfile", site: "Site", job: "MilesJob",
            model_config: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Every variable of the job's Ray runtime env; unset site values render as ${VAR} (launch plans).
    `model_config` is the model's config.json (its o_lora_rank decides SGLang's wo_a setting; None: unknown)."""
    master = site.resolved_master_addr or "${MASTER_ADDR}"
    env = {"PYTHONUNBUFFERED": "1",
           # Megatron asserts 1 with TP or CP > 1: kernels must queue in issue order for comm/compute overlap
           "CUDA_DEVICE_MAX_CONNECTIONS": "1",
           "no_proxy": f"127.0.0.1,{master}", "MASTER_ADDR": master}
    env.update(profile.miles_env)
    env.update(wo_a_gemm_env((model_config or {}).get("o_lora_rank")))
    if preset.miles.deterministic:
        env.update(DETERMINISTIC_ENV)
    env.update(profile.comm_env)
    env.update(profile.launcher_env)
    env.update(site.network_env(profile))
    env.update(site.extra_env)
    env.update(job.extra_env)
    bad = {k: v for k, v in env.items() if not isinstance(v, str) or "\n" in v}
    if bad:
        raise ValueError(f"runtime env values must be one-line strings; fix {sorted(bad)}")
    env["PYTHONPATH"] = f"{job.miles_dir}:{job.megatron_dir}"  # Miles first, then its Megatron-LM fork
    return env
