"""The evaluate subflow: held-out pass@1/2/4/8 (unbiased), truncation rate and mean response length of the
weights at one step, written to <run_dir>/eval/step_XXXXXX.json and shown as a table artifact.
A step already evaluated is not evaluated again (its JSON is the record). With `cluster` settings Miles
evaluates (tasks/evaluate.py `miles_eval`): it usually has, in the training job that ended at this step.

    python -c "from flows.evaluate import evaluate; evaluate('runs/x', 'runs/x/weights/current', 10)"
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_table_artifact

from tasks.evaluate import held_out_eval, miles_eval


@flow(name="evaluate", log_prints=True)
def evaluate(run_dir: str, model_dir: str, step: int, n_eval: int = 100, n_samples: int = 8, seed: int = 0,
             artifact_key: str | None = None, metric_sinks: list[str] | None = None, eval_data: str = "",
             max_grader_error_ratio: float = 0.25, eval_reward: str = "auto",
             cluster: dict | None = None, input_key: str = "prompt", label_key: str = "label") -> dict:
    from engines.train.runlog import RunLog
    from engines.train.sinks import open_sinks

    path = Path(run_dir) / "eval" / f"step_{step:06d}.json"
    if path.exists():
        print(f"step {step} already evaluated: {path}")
        return json.loads(path.read_text())
    if cluster is not None:  # Miles' record of the step, written by the recorder (its own step key dropped)
        result = {k: v for k, v in miles_eval(cluster, step).items() if k != "step"}
    else:
        result = held_out_eval(model_dir, n_eval=n_eval, n_samples=n_samples, seed=seed, eval_data=eval_data,
                               max_grader_error_ratio=max_grader_error_ratio,
                               eval_reward=eval_reward, input_key=input_key, label_key=label_key)
        with open_sinks(metric_sinks or [], run_dir) as sinks:  # the training's dashboards get the eval too
            RunLog(run_dir, sinks=sinks).write_eval(step, result)
    create_table_artifact([{"step": step, **{k: round(v, 4) if isinstance(v, float) else v
                                              for k, v in result.items() if not isinstance(v, dict)}}],
                          key=artifact_key, description=f"held-out evaluation at step {step}")
    print(f"step {step}: " + ", ".join(f"{k} {result[k]:.3f}" for k in ("pass@1", "pass@8") if k in result))
    return {"step": step, **result}
