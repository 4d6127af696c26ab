"""AMD Instinct MI355X (gfx950, CDNA4): the hardware of the seed run (4 nodes x 8, ROCm 7.2, RCCL).

Every environment value below is copied from the seed's launch command: the `export`s that do not depend on
the site (NCCL_IB_GID_INDEX=1 for RoCE v2), the interface/HCA variables it exports with site values, and the
`--extra-env-vars` string in its order (PyTorch flight recorder so a stalled RCCL collective leaves a trace,
HIP hardware queues, RCCL P2P chunk size). The backends are the seed appendix's Table 1.
"""

from __future__ import annotations

from engines.profiles import Backend, HardwareProfile, flight_recorder_env

MI355X = HardwareProfile(
    name="mi355x",
    accelerator="AMD Instinct MI355X",
    arch="gfx950",
    vendor="amd",
    hbm_gb=288.0,
    gpus_per_node=8,
    host_memory_gb=3072.0,  # typical 8x MI355X OAM platforms ship 24 x 128 GB DDR5; set yours
    intra_node_gbps=537.6,  # 7 Infinity Fabric links x 153.6 GB/s bidirectional: 537.6 GB/s per direction
    inter_node_gbps=50.0,  # one 400 Gb/s NIC per GPU
    collective_backend="rccl",
    fp8_dtype="e4m3fn",  # gfx950 computes OCP FP8; fnuz is MI300X (gfx942) only
    comm_env={"NCCL_IB_GID_INDEX": "1"},
    site_env=("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "NCCL_IB_HCA"),
    launcher_env={**flight_recorder_env("/workspace/miles"),
        "GPU_MAX_HW_QUEUES": "2",
        "NCCL_P2P_NET_CHUNKSIZE": "262144",
    },
    miles_env={  # Miles 31f1ca961 scripts/amd/run_deepseek_v4.py `train` (ROCm / AITER / TileLang switches)
        "NCCL_NVLS_ENABLE": "0",  # no NVLink SHARP on Infinity Fabric
        "SGLANG_SKIP_CHECKPOINT_LOAD_CHECK": "1",
        "SGLANG_DSV4_FP4_EXPERTS": "0",  # the FP8-expert repackage
        "SGLANG_HACK_FLASHMLA_BACKEND": "unified_kv_triton",
        "SGLANG_OPT_USE_COMPRESSOR_V2": "true",  # unified_kv lives in compressor_v2 only
        "SGLANG_OPT_USE_TILELANG_INDEXER": "true",
        "SGLANG_OPT_USE_JIT_NORM": "true",
        "SGLANG_OPT_USE_FUSED_COMPRESS": "true",
        "SGLANG_HEALTH_CHECK_TIMEOUT": "120",
        "AITER_BF16_FP8_MOE_BOUND": "0",
    },
    backends={
        "mhc": Backend(rollout="AITER mHC pre/post",
                       training="TileKernels pre; explicit PyTorch/HIP post-mix",
                       why="keeps the residual-stream mapping visible and comparable across engines"),
        "hybrid_attention": Backend(
            rollout="ROCm fused MLA decode; Triton sliding-window preparation; fused compressor and "
                    "paged-compressor paths; TileLang indexer",
            training="Miles DeepSeek-V4 attention in BF16",
            why="covers local and compressed attention through different execution stacks"),
        "moe_routing": Backend(rollout="Triton FP8 MoE; fused hash top-k", training="Megatron MoE and router path",
                               why="requires the same deterministic hash-routing semantics on both sides"),
        "online_weight_update": Backend(
            rollout="distributed weight update inside /begin_weight_update + /end_weight_update (upstream SGLang's "
                    "form of the patched post_process_weights route)",
            training="Miles broadcast update from the BF16 actor",
            why="rebuilds quantization-dependent runtime state before generation resumes"),
    },
    docker_image="rlsys/miles:rocm7.2-mi35x-dsv4",
    python="/opt/venv/bin/python3",
    miles_launcher="scripts/amd/run_deepseek_v4.py",
    workspace="/workspace/miles",
    notes="Validated by the seed: 2 rollout + 2 actor nodes, TP1 PP4 EP4, 100+ steps without collective stalls.",
)
