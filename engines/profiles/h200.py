"""NVIDIA H200 (sm_90, 141 GB HBM3e, NVLink): the hardware of Miles' own DeepSeek-V4 recipe (8 x 8 GPUs).

Not validated by our seed. The PyTorch flight-recorder settings are backend-independent, so they carry over
from the MI355X run; the ROCm-only knobs (GPU_MAX_HW_QUEUES, RoCE GID index) and the RCCL chunk-size tuning
do not. The backends are Miles' NVIDIA path (scripts/run_deepseek_v4.py), described, not measured here.
"""

from __future__ import annotations

from engines.profiles import Backend, HardwareProfile, flight_recorder_env

H200 = HardwareProfile(
    name="h200",
    accelerator="NVIDIA H200",
    arch="sm_90",
    vendor="nvidia",
    hbm_gb=141.0,
    gpus_per_node=8,
    host_memory_gb=2048.0,  # DGX/HGX H200 ship 2 TB
    intra_node_gbps=450.0,  # NVLink 4: 900 GB/s bidirectional per GPU
    inter_node_gbps=50.0,  # one 400 Gb/s InfiniBand NIC per GPU
    collective_backend="nccl",
    fp8_dtype="e4m3fn",
    comm_env={},
    site_env=("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "NCCL_IB_HCA"),
    launcher_env=flight_recorder_env("/root/shared_data"),
    miles_env={  # Miles 31f1ca961 scripts/run_deepseek_v4.py `train` (CUDA), Flash
        "NCCL_NVLS_ENABLE": "1",  # HGX H200 has NVLink (the launcher probes nvidia-smi topo)
        "SGLANG_SKIP_CHECKPOINT_LOAD_CHECK": "1",
        "SGLANG_DSV4_FP4_EXPERTS": "0",
        "SGLANG_HEALTH_CHECK_TIMEOUT": "120",
        "SGLANG_DG_CACHE_DIR_PER_PROCESS": "1",
        "SGLANG_OPT_FP8_WO_A_GEMM": "0",
    },
    backends={
        "hybrid_attention": Backend(rollout="SGLang dsv4 attention backend, CUDA branch (FlashMLA / TRT-LLM kernels)",
                                    training="Miles DeepSeek-V4 attention (TileLang sparse-MLA and indexer kernels)",
                                    why="same semantics as the ROCm path through CUDA kernels"),
        "moe_routing": Backend(rollout="SGLang FP8 MoE", training="Megatron MoE and router path",
                               why="hash routing must match across engines"),
        "online_weight_update": Backend(rollout="distributed weight update + begin/end_weight_update",
                                        training="Miles broadcast update from the BF16 actor",
                                        why="rebuilds FP8 runtime state after each update"),
    },
    docker_image=None,
    python="python3",
    miles_launcher="scripts/run_deepseek_v4.py",
    workspace="/root/miles",
    megatron_workspace="/root/Megatron-LM",
    notes="Miles' recipe: TP8 PP8 EP8 on 64 GPUs (legal only through MoE parallel folding); not run by us.",
)
