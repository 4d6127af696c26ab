"""Which engines run the rl-pipeline's steps for a run preset: the preset's hardware profile picks them.

    embedded   a CPU profile (tiny-cpu): our rollout engine behind SGLang's API and the transformers trainer;
               the alignment gate and the held-out evaluation load the model on this host
    miles      a GPU profile (dsv4-flash-mi355x, ...): Miles on the existing Ray cluster trains and evaluates,
               the alignment gate runs SGLang and Megatron there; this host only converts and verifies

The flow body is the same for both (flows/rl_pipeline.py); its tasks ask `pipeline_backend` which engine to
drive, and preflight sizes `cpu_steps` against this machine's memory (engines/layout/cpu_fit.py).

    pipeline_backend("tiny-cpu").cpu_steps            # ('convert', 'verify', 'cpu-align', 'cpu-eval')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class PipelineBackend:
    """The engines of one preset's pipeline."""

    name: Literal["embedded", "miles"]
    cpu_steps: tuple[str, ...]
    """Steps that load the model on the host running the flow (engines/layout/cpu_fit.py CPU_STEPS)."""

    @property
    def on_cluster(self) -> bool:
        return self.name == "miles"


EMBEDDED = PipelineBackend("embedded", ("convert", "verify", "cpu-align", "cpu-eval"))
MILES = PipelineBackend("miles", ("convert", "verify"))


def pipeline_backend(preset_name: str) -> PipelineBackend:
    """EMBEDDED for a preset on a CPU profile, MILES for one on GPUs (ValueError for an unknown preset)."""
    from engines.profiles import get_profile
    from engines.presets.runs import get_run_preset

    return EMBEDDED if get_profile(get_run_preset(preset_name).profile).vendor == "cpu" else MILES
