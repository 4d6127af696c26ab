"""Prefect task: fail fast before anything expensive: the parallel layout fits (engines/layout), every CPU step
of the preset's pipeline fits this machine's memory for the checkpoint (engines/layout/cpu_fit.py), the data
loads (with enough usable rows; bad rows are counted and named), and the reward grades its golden cases right."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

GOLDEN = [("\\boxed{85}", "85", 1.0), ("The answer is \\boxed{85}.", "85", 1.0), ("\\boxed{84}", "85", 0.0),
          ("85", "85", 0.0), ("\\boxed{\\frac{1}{2}}", "0.5", 1.0)]


@task(name="preflight", cache_policy=NO_CACHE)
def preflight(preset: str, seed: int = 0, *, hf_checkpoint: str = "", train_data: str = "", eval_data: str = "",
              prompts_per_step: int = 1, n_eval: int = 1, max_new_tokens: int = 8) -> dict:
    from engines.launch import preflight_plan
    from rl.math_task import make_splits
    from rl.rewards import grade

    plan = preflight_plan(preset)  # raises InfeasibleLayout naming each violated rule and its fix
    if hf_checkpoint:  # raises CpuFitError naming the step, its estimate and this machine's memory
        from engines.backends import pipeline_backend
        from engines.layout.cpu_fit import check_cpu_fit

        fits = check_cpu_fit(hf_checkpoint, pipeline_backend(preset).cpu_steps)
        get_run_logger().info("CPU steps fit: %s", ", ".join(f"{s.step} ~{s.bytes / 1e9:.1f} GB" for s in fits))
    wrong = [(r, label, want, grade(r, label).reward) for r, label, want in GOLDEN if grade(r, label).reward != want]
    if wrong:
        raise RuntimeError(f"reward function misgrades its golden cases: {wrong}")
    train, held_out = make_splits(64, 16, seed)
    out = {"feasible": plan.feasible, "golden_cases": len(GOLDEN), "train_rows": len(train),
           "eval_rows": len(held_out), "layout": str(getattr(plan, "layout", ""))}
    files = (("train_data", train_data, prompts_per_step, f"prompts_per_step={prompts_per_step}"),
             ("eval_data", eval_data, n_eval, f"n_eval={n_eval}"))
    for what, path, needed, needed_by in files:
        if path:  # raises DatasetError naming the file, the counts per reason and the fix
            report = _check_data_file(path, hf_checkpoint, max_new_tokens, needed, what, needed_by)
            get_run_logger().info("%s: %s", what, report.summary())
            out[f"{what}_rows"] = report.n_kept
            out[f"{what}_dropped"] = dict(report.dropped)
    return out


def _check_data_file(path: str, hf_checkpoint: str, max_new_tokens: int, needed: int, what: str, needed_by: str):
    from transformers import AutoTokenizer

    from engines.train.run import load_data_file, prompt_encoder

    tokenizer = AutoTokenizer.from_pretrained(hf_checkpoint)
    encode = prompt_encoder(tokenizer)
    return load_data_file(path, encode, base=hf_checkpoint, max_new_tokens=max_new_tokens, min_rows=needed,
                          what=what, needed_by=needed_by).report
