"""Hardware/engine profiles: what a cluster of one accelerator type needs to run DeepSeek-V4 RL with Miles.

A profile is data: accelerator and memory, the collective library and its environment (the seed's RCCL
transport and PyTorch flight-recorder settings for MI355X), the runtime backends per model component, the
FP8 flavour, the container and the Miles launcher. Site-specific values (interface names, IB HCAs, IPs) are
not in the profile; launch plans and the Miles job take them from an `engines.profiles.site.Site`.

    from engines.profiles import get_profile
    get_profile("mi355x").hbm_gb   # 288.0
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class Backend:
    """Which runtime path a model component takes on each side, and why it matters (the seed's Table 1)."""

    rollout: str
    training: str
    why: str


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """One accelerator type. Memory numbers are vendor nominal GB (1e9 B); override them for your nodes."""

    name: str
    """Registry key (`v4rl plan --profile NAME`)."""
    accelerator: str
    """Marketing name, e.g. "AMD Instinct MI355X"."""
    arch: str
    """Compiler target: gfx950 (MI355X), sm_90 (H200), cpu."""
    vendor: Literal["amd", "nvidia", "cpu"]
    hbm_gb: float
    """Device memory per accelerator (GB)."""
    gpus_per_node: int
    """Accelerators per node."""
    host_memory_gb: float
    """Host RAM per node assumed when planning optimizer offload; a typical platform, override with --host-memory-gb."""
    intra_node_gbps: float
    """Per-GPU collective bandwidth inside a node (GB/s, nominal): only used to rank layouts."""
    inter_node_gbps: float
    """Per-GPU bandwidth across nodes (GB/s, nominal): only used to rank layouts."""
    collective_backend: Literal["rccl", "nccl", "gloo"]
    """torch.distributed backend library (RCCL answers to the NCCL_* variables)."""
    fp8_dtype: Literal["e4m3fn", "e4m3fnuz"] | None
    """FP8 flavour the hardware computes in: OCP e4m3fn (MI355X/gfx950, H200) or e4m3fnuz (MI300X/gfx942,
    whose checkpoints must be converted: same bits mean half the value, max 240). None: no FP8 compute."""
    comm_env: dict[str, str] = field(default_factory=dict)
    """Fixed collective settings exported on every node (the seed's `export NCCL_IB_GID_INDEX=1`)."""
    site_env: tuple[str, ...] = ()
    """Variables whose values depend on the site (network interfaces, HCAs); launch plans fill them from a Site."""
    launcher_env: dict[str, str] = field(default_factory=dict)
    """The seed's `--extra-env-vars`: flight recorder (TORCH_NCCL_*/TORCH_FR_*) and transport tuning, in order."""
    miles_env: dict[str, str] = field(default_factory=dict)
    """What Miles' own launcher for this hardware puts into every rank's runtime env (SGLang's DeepSeek-V4
    kernel switches, NCCL_NVLS_ENABLE by NVLink presence); the Miles job carries it unchanged."""
    backends: dict[str, Backend] = field(default_factory=dict)
    """Runtime path per model component (mHC, hybrid attention, MoE, online weight update)."""
    docker_image: str | None = None
    """Container the run used; None = bring your own."""
    python: str = "python3"
    """Interpreter inside the container that runs the Miles launcher."""
    miles_launcher: str = "scripts/run_deepseek_v4.py"
    """Miles launcher script (relative to the Miles checkout) for DeepSeek-V4 on this hardware."""
    workspace: str = "/workspace/miles"
    """Miles checkout inside the container; logs and flight-recorder dumps go here."""
    megatron_workspace: str = "/root/Megatron-LM"
    """Megatron-LM checkout inside the container (Miles' launchers' --megatron-path default); on PYTHONPATH."""
    notes: str = ""
    """What was validated on this profile and what was not."""


def flight_recorder_env(dump_dir: str) -> dict[str, str]:
    """PyTorch's NCCL/RCCL flight recorder and timeout dumps (the seed's launcher settings; backend-independent):
    a collective that stalls leaves its trace in `<dump_dir>/nccl_fr_trace_*` instead of hanging silently."""
    return {
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "200000",
        "TORCH_FR_BUFFER_SIZE": "200000",
        "TORCH_NCCL_DESYNC_DEBUG": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"{dump_dir}/nccl_fr_trace_",
    }


def _registry() -> dict[str, HardwareProfile]:
    from engines.profiles.h200 import H200
    from engines.profiles.mi355x import MI355X

    cpu = HardwareProfile(name="cpu", accelerator="CPU (embedded engines)", arch="cpu", vendor="cpu", hbm_gb=16.0,
                          gpus_per_node=1, host_memory_gb=16.0, intra_node_gbps=20.0, inter_node_gbps=1.0,
                          collective_backend="gloo", fp8_dtype=None, miles_launcher="",
                          notes="The tiny-cpu preset: our CPU rollout engine and trainer, no Miles; "
                                "'device memory' is the RAM budget the planner checks.")
    return {p.name: p for p in (MI355X, H200, cpu)}


PROFILES: dict[str, HardwareProfile] = _registry()


def get_profile(name: str) -> HardwareProfile:
    """The named profile; ValueError listing the known names otherwise."""
    try:
        return PROFILES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown hardware profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None
