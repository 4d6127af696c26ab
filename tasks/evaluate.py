"""Prefect tasks: held-out pass@k of the weights at one step.

`held_out_eval` (embedded engines): the rollout engine serving given weights, over real HTTP (our
SGLang-compatible server on 127.0.0.1, exactly the client code that drives real SGLang).
`miles_eval` (cluster): Miles' own evaluation of the step's checkpoint (engines/train/miles/pipeline.py
`evaluate_step`: the record Miles logged during training, else its eval-only job), read back into the same
eval/step_XXXXXX.json.

The held-out set is the synthetic one, or the first n_eval usable rows of `eval_data` (bad rows dropped and
counted, as in training), graded by `eval_reward` (auto: literal for the synthetic set, math-verify for
eval_data; rl/reward_spec.py). Reward-function failures score 0, are counted in the result's `grader_errors`, and
too many fail the task (rl/grading.py). V4RL_ROLLOUT_API_KEY, when set, protects the server as in training."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE


def _transient(task, task_run, state) -> bool:
    """Retry a crash or a timeout once, never a bad input (a ValueError: bad eval data, an unknown reward)."""
    try:
        state.result()
    except (ValueError, TypeError):
        return False
    except Exception:  # noqa: BLE001 - anything else may pass on a second try
        return True
    return False


@task(name="held-out-eval", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5, timeout_seconds=3 * 3600,
      retry_condition_fn=_transient)
def held_out_eval(model_dir: str, *, n_eval: int, n_samples: int, seed: int, max_new_tokens: int = 8,
                  eval_data: str = "", max_grader_error_ratio: float = 0.25, eval_reward: str = "auto",
                  input_key: str = "prompt", label_key: str = "label") -> dict:
    import os

    from transformers import AutoTokenizer

    from engines.rollout.engine import RolloutEngine
    from engines.rollout.server import RolloutServer
    from engines.rollout.sglang import SGLangClient
    from engines.train.actors import HTTPRollout
    from engines.train.run import ROLLOUT_API_KEY_ENV, load_data_file, prompt_encoder
    from rl.loop import evaluate
    from rl.math_task import make_splits
    from rl.reward_spec import resolve_reward

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    encode = prompt_encoder(tokenizer)
    if eval_data:
        data = load_data_file(eval_data, encode, base=model_dir, max_new_tokens=max_new_tokens, min_rows=n_eval,
                              max_rows=n_eval, what="eval_data", needed_by=f"n_eval={n_eval}", input_key=input_key,
                              label_key=label_key)
        prompts, labels = data.prompt_ids, data.labels
    else:
        _, rows = make_splits(0, n_eval, seed)
        prompts, labels = [encode(r["prompt"]) for r in rows], [r["label"] for r in rows]
    api_key = os.environ.get(ROLLOUT_API_KEY_ENV) or None
    grader = resolve_reward(eval_reward, eval_data, "eval_reward").grader(max_error_ratio=max_grader_error_ratio)
    with RolloutServer(RolloutEngine(model_dir), api_key=api_key) as server, \
            SGLangClient(server.url, api_key=api_key, timeout=600) as client:
        return evaluate(HTTPRollout(client), prompts, labels, n=n_samples, max_new_tokens=max_new_tokens,
                        seed=seed + 99, decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                        grader=grader)


@task(name="miles-eval", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=60, timeout_seconds=6 * 3600)
def miles_eval(cluster: dict, step: int) -> dict:
    """eval/step_XXXXXX.json of `step` from Miles (`cluster`: flows/rl_pipeline.py `_miles`)."""
    from prefect import get_run_logger

    from engines.train.miles.pipeline import ClusterRun, evaluate_step

    return evaluate_step(ClusterRun.from_miles(cluster), step, on_line=get_run_logger().info)
