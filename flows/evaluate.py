"""The evaluate subflow: held-out pass@1/2/4/8 (unbiased), truncation rate and mean response length of the
weights at one step, published as a table artifact row and the run's pass@k-over-steps plot (plots/pass_at_k.png,
also a markdown artifact).

In the rl-pipeline the training engine evaluates itself (the embedded trainer, or Miles on the cluster) and
writes <run_dir>/eval/step_XXXXXX.json; the flow starts this subflow as soon as that file lands, while training
goes on, and the subflow publishes it (its JSON is the record: a step already evaluated is not evaluated again).
Called for a step nobody evaluated, the run's backend evaluates it (tasks/evaluate.py): the embedded rollout
engine serving `model_dir` over HTTP, or Miles' eval-only job on the step's checkpoint.

    from flows.evaluate import evaluate
    from flows.params import PipelineParams
    p = PipelineParams.preset_defaults("tiny-cpu", run_key="x")
    evaluate(str(p.run_dir), str(p.run_dir / "weights" / "current"), 10, p.backend())
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from engines.backends import Backend
from tasks.evaluate import eval_task


@flow(name="evaluate", log_prints=True)
def evaluate(run_dir: str, model_dir: str, step: int, backend: Backend, artifact_key: str | None = None) -> dict:
    """Publish (evaluating first when nobody has) step `step` of the run in `run_dir`, whose engines are `backend`
    (flows/params.py PipelineParams.backend); `model_dir`: the weights the embedded engines evaluate."""
    if Path(run_dir).resolve() != Path(backend.run_dir).resolve():
        raise ValueError(f"evaluate: run_dir {run_dir} is not the backend's run directory {backend.run_dir}; build "
                         "the backend from the same PipelineParams (params.backend())")
    path = Path(run_dir) / "eval" / f"step_{step:06d}.json"
    if path.exists():  # the training engine evaluated it (or an earlier run of this subflow did): publish it
        print(f"step {step} evaluated by the training engine: {path}")
        record = json.loads(path.read_text())
    else:  # the backend writes eval/step_XXXXXX.json and returns it
        record = eval_task(backend)(backend, step, model_dir)
    result = {k: v for k, v in record.items() if k != "step"}
    create_table_artifact([{"step": step, **{k: round(v, 4) if isinstance(v, float) else v
                                              for k, v in result.items() if not isinstance(v, dict)}}],
                          key=artifact_key, description=f"held-out evaluation at step {step}")
    _publish_plot(run_dir, step, artifact_key)
    print(f"step {step}: " + ", ".join(f"{k} {result[k]:.3f}" for k in ("pass@1", "pass@8") if k in result))
    regression = _regression_check(run_dir, step, result)
    return {"step": step, **result, "regression": regression}


def _regression_check(run_dir: str, step: int, result: dict) -> dict:
    """The run's regression check as each evaluation lands (rl/verdict.py evaluation_regression): a pass@1 drop
    below the best earlier evaluation beyond the noise is logged as a warning while training goes on; the nightly
    verdict at the end judges the run against earlier nights."""
    from prefect import get_run_logger

    from engines.runs.runlog import RunLog
    from rl.verdict import evaluation_regression

    check = evaluation_regression({"step": step, **result}, RunLog(run_dir).evals())
    if check["status"] == "regressed":
        get_run_logger().warning(
            "step %d: held-out pass@1 %.3f is %.3f below step %s's %.3f, more than the noise band %.3f "
            "(2 standard errors of the difference); training goes on, the report and the nightly verdict show it",
            step, check["pass@1"], check["drop"], check["best_step"], check["best_pass@1"], check["band"])
    return check


def _publish_plot(run_dir: str, step: int, artifact_key: str | None) -> None:
    """pass@k over every step evaluated so far: plots/pass_at_k.png, and a markdown artifact embedding it."""
    import base64

    from engines.runs.report import plot_pass_at_k
    from engines.runs.runlog import RunLog

    plot = plot_pass_at_k(RunLog(run_dir).evals(), Path(run_dir) / "plots" / "pass_at_k.png")
    if plot is None:
        return
    image = base64.b64encode(plot.read_bytes()).decode()
    create_markdown_artifact(f"## Held-out pass@k up to step {step}\n\n![pass@k](data:image/png;base64,{image})\n",
                             key=f"{artifact_key}-plot" if artifact_key else None,
                             description=f"held-out pass@k over steps, up to step {step}")
