"""The rl-pipeline's engines behind one interface: every task calls `backend.<step>(...)` and never asks which
engines it drives. A run preset's hardware profile picks the backend (`backend_name`); flows/params.py
`PipelineParams.backend` builds it once per flow run and hands the same object to every task.

    embedded   engines/backends/embedded.py EmbeddedBackend, a CPU profile (tiny-cpu): our rollout engine behind
               SGLang's API and the transformers trainer on this host; the alignment gate and the held-out
               evaluation load the model here
    miles      engines/backends/miles.py MilesBackend, a GPU profile (dsv4-flash-mi355x, ...): one Miles job
               on the existing Ray cluster trains and evaluates, the alignment gate runs SGLang and Megatron
               there; this host only converts and verifies

    backend_name("tiny-cpu")                                  # 'embedded'
    PipelineParams.preset_defaults("tiny-cpu").backend()      # EmbeddedBackend(run_dir=..., config=...)

The two implementations are adapters in this package, each step one call into the package that owns the engine
(engines/train, engines/align, engines/miles); they satisfy `Backend` structurally. They sit here, not in
engines/train, because the embedded one calls engines/align, which itself imports engines/train.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from engines.align import AlignConfig
    from engines.runs.stopping import StopRequest

BackendName = Literal["embedded", "miles"]
Log = Callable[[str], None]


@runtime_checkable
class Backend(Protocol):
    """The steps of one run that depend on its engines; each returns the JSON-ready record the task publishes."""

    @property
    def run_dir(self) -> str:
        """This host's run directory: metrics.jsonl, eval/, checkpoints or the Miles log."""

    @property
    def steps(self) -> int:
        """Training steps (rollouts) of the whole run."""

    @property
    def cpu_steps(self) -> tuple[str, ...]:
        """Steps that load the model on the host running the flow (engines/layout/cpu_fit.py CPU_STEPS); preflight
        checks they fit this machine's memory."""

    @property
    def overrides(self) -> Mapping[str, Any]:
        """Planner overrides of the preset (engines.presets.runs OVERRIDES keys) that preflight's layout check
        plans with."""

    @property
    def megatron_names(self) -> str:
        """The torch_dist key names the convert task writes (plugin or megatron: what this backend's trainer
        loads)."""

    @property
    def eval_task(self) -> str:
        """Name of the Prefect task in tasks/evaluate.py that runs `evaluate` with this backend's retry policy."""

    def check(self, *, log: Log) -> dict[str, Any]:
        """Preflight's checks of the engines themselves (the Miles job as Miles parses it, ...), beyond the checks
        of layout, memory, data and reward every run gets; raises naming what to fix."""

    def align(self, hf_dir: str, torch_dist_dir: str, config: AlignConfig, *, log: Log) -> dict[str, Any]:
        """The alignment gate's report (engines/align schema) for the converted checkpoint."""

    def train(self, *, log: Log, on_step: Callable[[int, dict], None], stop: StopRequest) -> dict[str, Any]:
        """Train (or resume) the whole run, the engine evaluating into eval/ and checkpointing as it goes;
        {"resumed_from", "last_step", ...}. `on_step(step, metrics)` as steps complete; a set `stop` ends it."""

    def evaluate(self, step: int, model_dir: str, *, log: Log) -> dict[str, Any]:
        """Held-out pass@k of the weights at `step`, written to eval/step_XXXXXX.json and returned (Miles evaluates
        the step's checkpoint and ignores `model_dir`)."""


def backend_name(preset_name: str) -> BackendName:
    """embedded for a preset on a CPU profile, miles for one on GPUs (ValueError for an unknown preset)."""
    from engines.presets.runs import get_run_preset
    from engines.profiles import get_profile

    return "embedded" if get_profile(get_run_preset(preset_name).profile).vendor == "cpu" else "miles"
