"""Prefect task: fail fast before anything expensive: the parallel layout fits (engines/layout), the artifact store
takes the run's uploads (a probe object written and deleted: engines/artifact_store check_store), every CPU step
of the preset's pipeline fits this machine's memory for the checkpoint (engines/layout/cpu_fit.py), the data
loads (with enough usable rows; bad rows are counted and named), and each dataset's reward works: a built-in
grader on its golden cases, a user's reward function on one sample of its data (rl/reward_spec.py).

Then the run's backend checks its own engines (engines/backends `Backend.check`): the Miles backend builds the
job exactly as it will be submitted and has Miles' own parser check it on CPU (engines/backends/miles.py):
a missing site parameter (RAY_ADDRESS, MASTER_ADDR, an interface), a layout Miles cannot run, a Miles checkout
that rejects a flag, a value Miles resolves differently or a dataset file that does not exist stops the run here,
before anything is submitted."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from engines.backends import Backend


@task(name="preflight", cache_policy=NO_CACHE)
def preflight(preset: str, seed: int = 0, *, backend: Backend, hf_checkpoint: str = "", train_data: str = "",
              eval_data: str = "", prompts_per_step: int = 1, n_eval: int = 1, max_new_tokens: int = 8,
              reward: str = "auto", eval_reward: str = "auto", input_key: str = "prompt",
              label_key: str = "label", store_url: str = "", store_prefix: str = "", endpoint_url: str | None = None,
              secret_block: str | None = None) -> dict:
    """`backend`: the run's engines (flows/params.py PipelineParams.backend); their own checks come last.
    `store_url` .. `secret_block`: where the run's artifacts go (tasks/upload.py upload_artifacts' arguments)."""
    from engines.miles.launch import preflight_plan
    from rl.math_task import make_splits

    log = get_run_logger()
    plan = preflight_plan(preset, dict(backend.overrides))  # InfeasibleLayout naming each rule and fix
    if store_url:  # ArtifactStoreError naming the store and the fix, before any engine starts (not at the upload)
        from engines.artifact_store import check_store
        from tasks.upload import resolve_credentials

        warning = check_store(store_url, store_prefix, endpoint_url=endpoint_url, **resolve_credentials(secret_block))
        if warning:
            log.warning("artifact store: %s", warning)
        log.info("artifact store %s: writable (probe object written and deleted)", store_url)
    if hf_checkpoint:  # raises CpuFitError naming the step, its estimate and this machine's memory
        from engines.layout.cpu_fit import check_cpu_fit

        fits = check_cpu_fit(hf_checkpoint, backend.cpu_steps)
        log.info("CPU steps fit: %s", ", ".join(f"{s.step} ~{s.bytes / 1e9:.1f} GB" for s in fits))
    train, held_out = make_splits(64, 16, seed)
    out = {"feasible": plan.feasible, "train_rows": len(train), "eval_rows": len(held_out),
           "layout": str(getattr(plan, "layout", ""))}
    files = (("train_data", train_data, prompts_per_step, f"prompts_per_step={prompts_per_step}"),
             ("eval_data", eval_data, n_eval, f"n_eval={n_eval}"))
    for what, path, needed, needed_by in files:
        if path:  # raises DatasetError naming the file, the counts per reason and the fix
            report = _check_data_file(path, hf_checkpoint, max_new_tokens, needed, what, needed_by, input_key,
                                      label_key)
            log.info("%s: %s", what, report.summary())
            out[f"{what}_rows"] = report.n_kept
            out[f"{what}_dropped"] = dict(report.dropped)
    for what, spec, path, synthetic in (("reward", reward, train_data, train[0]),
                                        ("eval_reward", eval_reward, eval_data, held_out[0])):
        # raises RewardCheckFailed
        out[f"{what}_cases_checked"] = _check_reward(spec, what, path, synthetic, input_key, label_key)
    out.update(backend.check(log=log.info))  # MilesRejected, SiteError, SGLangUpdateRejected: not retried
    return out


def _check_reward(spec: str, what: str, data_file: str, synthetic: dict, input_key: str = "prompt",
                  label_key: str = "label") -> int:
    """A built-in on its golden cases; a user's function on the first row of its data (or the synthetic task's)."""
    from rl.datasets import load_prompt_dataset
    from rl.reward_spec import check_reward, resolve_reward

    choice = resolve_reward(spec, data_file, what)
    prompt, label = synthetic["prompt"], synthetic["label"]
    if data_file and choice.takes_prompt:
        first = load_prompt_dataset(data_file, input_key=input_key, label_key=label_key)[0][0]
        prompt, label = first.prompt_text, first.label
    return check_reward(choice, prompt, label, what)


def _check_data_file(path: str, hf_checkpoint: str, max_new_tokens: int, needed: int, what: str, needed_by: str,
                     input_key: str = "prompt", label_key: str = "label"):
    from transformers import AutoTokenizer

    from engines.train.run import load_data_file, prompt_encoder

    tokenizer = AutoTokenizer.from_pretrained(hf_checkpoint)
    encode = prompt_encoder(tokenizer)
    return load_data_file(path, encode, base=hf_checkpoint, max_new_tokens=max_new_tokens, min_rows=needed,
                          what=what, needed_by=needed_by, input_key=input_key, label_key=label_key).report
