"""The automation that marks zombie flow runs Crashed (a self-hosted Prefect server has none built in).

A flow run whose process dies (kill -9, node loss) stays Running forever and holds its deployment's
concurrency slot. Flow runs send a heartbeat event every PREFECT_FLOWS_HEARTBEAT_FREQUENCY seconds (180 by
default in 3.9); this automation fires when a running flow run has sent no heartbeat for `within` seconds
(keep it above twice the frequency: a heartbeat emitted between Completed and process exit is a known false
positive) and sets the run to Crashed, which frees the slot and lets a new run resume the run key.

    python -m flows.automations             # create or update it on the server in PREFECT_API_URL
"""

from __future__ import annotations

from datetime import timedelta

NAME = "v4rl-crash-zombie-flow-runs"

ZOMBIE_WINDOW_S: int = 600
"""Seconds without a heartbeat after which a running flow run is marked Crashed: 10 minutes, over three
heartbeats at Prefect's default 180 s frequency, so a loaded node's late heartbeat never crashes a live run.
A caller with a shorter PREFECT_FLOWS_HEARTBEAT_FREQUENCY may pass a shorter window (above twice the frequency
in production; a heartbeat came over 45 s late on a loaded 2-core machine: tests/test_fault_worker_kill.py
uses 105 s with 30 s heartbeats and deletes the automation afterwards)."""


def zombie_automation(within_seconds: int = ZOMBIE_WINDOW_S):
    if within_seconds <= 0:
        raise ValueError(f"flows/automations.py: within_seconds must be a positive number of seconds, not "
                         f"{within_seconds}; the default is ZOMBIE_WINDOW_S ({ZOMBIE_WINDOW_S})")
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture

    return Automation(
        name=NAME,
        description="Mark flow runs Crashed when their heartbeats stop (the process died).",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
                    "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"},
            match={"prefect.resource.id": ["prefect.flow-run.*"]},
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=within_seconds),
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED,
                                    message=f"no heartbeat for {within_seconds}s: the flow run's process died")],
    )


def ensure_zombie_automation(within_seconds: int = ZOMBIE_WINDOW_S):
    """Create the automation, or replace an existing one of the same name."""
    from prefect.automations import Automation

    try:
        Automation.read(name=NAME).delete()
    except ValueError:  # not there yet
        pass
    return zombie_automation(within_seconds).create()


if __name__ == "__main__":
    print(ensure_zombie_automation())
