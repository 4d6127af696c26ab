"""Deployment entrypoint for tests: the rl-pipeline flow with its cluster-only steps replaced
(tests/cluster_stand_in.py `replace_cluster_only_steps`), so a Prefect worker runs the cluster path's training
against the stand-in for `ray job submit`. Used by tests/test_cluster_flow.py's cancel test only.

    prefect deploy tests/cluster_flow_entry.py:rl_pipeline --name cluster-stand-in --pool <pool>
"""

from __future__ import annotations

import flows.rl_pipeline as _pipeline
from tests.cluster_stand_in import replace_cluster_only_steps

replace_cluster_only_steps(_pipeline)
rl_pipeline = _pipeline.rl_pipeline
