"""Prefect task: the cross-engine alignment gate, run by the run's backend (engines/backends `Backend.align`):

  embedded  engines/align: our rollout engine generates once, the trainer (from torch_dist, BF16) and
            transformers' reference rescore the same tokens, and the first diverging layer and sub-block is named;
  miles     engines/align/cluster.py: SGLang generates once, Megatron rescores the same tokens through Miles'
            train-only debug run on the cluster; nothing of the model loads on this host.

Both gate on the same thresholds and write the same JSON report into the run directory; over threshold fails
the pipeline."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from engines.backends import Backend


class AlignmentFailed(RuntimeError):
    pass


@task(name="align", cache_policy=NO_CACHE, timeout_seconds=3 * 3600)
def align(hf_dir: str, torch_dist_dir: str, json_out: str, *, backend: Backend, prompts: int = 16,
          threshold: float = 0.09, artifact_key: str | None = None) -> dict:
    """`backend`: the run's engines (flows/params.py PipelineParams.backend)."""
    from engines.align import AlignConfig

    report = backend.align(hf_dir, torch_dist_dir, AlignConfig(n_prompts=prompts, mean_threshold=threshold),
                           log=get_run_logger().info)
    tmp = Path(json_out).with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(json_out)
    from engines.align.report import markdown

    create_markdown_artifact(f"# Alignment: {'passed' if report['passed'] else 'FAILED'}\n\n{markdown(report)}",
                             key=artifact_key, description="rollout vs trainer alignment")
    if not report["passed"]:
        raise AlignmentFailed(f"alignment over threshold: {'; '.join(report.get('failures', []))} "
                              f"(report: {json_out})")
    return report
