"""Side-by-side benchmarks against named peers; each writes JSON with ratios measured in one run."""

from __future__ import annotations

import os
import platform
from typing import Any


def load_average() -> float | None:
    """1-minute load average (None where the platform has none): benchmarks on shared machines report it."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def machine_info() -> dict[str, Any]:
    import torch

    return {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "load_avg_1m_at_start": load_average()}

