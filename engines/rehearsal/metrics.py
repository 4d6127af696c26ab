"""Miles' own logged metrics, read back from its driver's log (placeholder until the format is known)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class MilesMetrics:
    rollouts: dict[str, dict] = field(default_factory=dict)
    evals: list[dict] = field(default_factory=list)


def read_metrics(log: Path) -> MilesMetrics:
    return MilesMetrics()
