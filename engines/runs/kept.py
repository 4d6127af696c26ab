"""What an interrupted run left in its directory and what the same command does next, in words for the user who
pressed Ctrl-C: the last checkpoint (the rerun resumes after it), the metric rows and evaluations past it (written,
but the rerun drops them and trains those steps again, engines/train/run.py), or no checkpoint at all (it starts
over at step 1).

    kept_after_interrupt(Path("runs/grpo"))
    # 'kept: checkpoint step 10 in runs/grpo/checkpoints, metrics of steps 1-12, evaluations of steps [0, 10];
    #  a rerun of the same command resumes at step 11 and trains again what came after step 10 (dropping 2 metric rows)'
"""

from __future__ import annotations

from pathlib import Path

from engines.runs.checkpointing import latest_step
from engines.runs.runlog import RunLog


def kept_after_interrupt(run_dir: Path) -> str:
    """One sentence: the run directory's checkpoint, metrics and evaluations, and where a rerun starts."""
    runlog = RunLog(run_dir)
    steps = [row["step"] for row in runlog.metrics()] if runlog.metrics_path.exists() else []
    evals = [e["step"] for e in runlog.evals()] if runlog.eval_dir.exists() else []
    checkpoint = latest_step(run_dir / "checkpoints") or 0
    metrics = f"metrics of steps {steps[0]}-{steps[-1]}" if steps else "no metric rows"
    kept = f"{metrics}, evaluations of steps {evals}" if evals else metrics
    past = [s for s in steps if s > checkpoint]
    past_evals = [s for s in evals if s > checkpoint]
    redone = f"{len(past)} metric row{'s' if len(past) != 1 else ''}"
    redone += f" and the evaluations of steps {past_evals}" if past_evals else ""
    if not checkpoint:
        return (f"kept: no checkpoint yet in {run_dir / 'checkpoints'} ({kept}); a rerun of the same command starts "
                "over at step 1" + (f" and drops the {redone}" if past or past_evals else ""))
    return (f"kept: checkpoint step {checkpoint} in {run_dir / 'checkpoints'}, {kept}; a rerun of the same command "
            f"resumes at step {checkpoint + 1}" + (f" and trains again what came after step {checkpoint} (dropping "
                                                  f"{redone})" if past or past_evals else ""))
