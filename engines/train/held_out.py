"""Held-out pass@k of one set of weights on the embedded engines: our rollout engine serving them behind its
SGLang-compatible HTTP server on 127.0.0.1, driven by the client code that drives real SGLang, graded as the
training run grades its held-out set (the run's TrainRunConfig: n_eval, eval_data, eval_reward, the loop's
eval_samples, max_new_tokens and seed). The embedded backend's `evaluate` step (engines/backends/embedded.py).

    held_out_eval("runs/x/weights/current", TrainRunConfig(n_eval=16))     # {"pass@1": ..., ...}
"""

from __future__ import annotations

import os
from typing import Any

from engines.train.run import ROLLOUT_API_KEY_ENV, TrainRunConfig, load_data_file, prompt_encoder


def held_out_eval(model_dir: str, config: TrainRunConfig) -> dict[str, Any]:
    """pass@k of `model_dir` on the run's held-out set: the synthetic one, or the first n_eval usable rows of
    eval_data (bad rows dropped and counted, as in training), graded by eval_reward (rl/reward_spec.py).
    Reward-function failures score 0 and are counted in `grader_errors`; too many fail it (rl/grading.py).
    V4RL_ROLLOUT_API_KEY, when set, protects the server as in training."""
    from transformers import AutoTokenizer

    from engines.rollout.engine import RolloutEngine
    from engines.rollout.server import RolloutServer
    from engines.rollout.sglang import SGLangClient
    from engines.train.actors import HTTPRollout
    from rl.loop import evaluate
    from rl.math_task import make_splits
    from rl.reward_spec import resolve_reward

    loop = config.loop
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    encode = prompt_encoder(tokenizer)
    if config.eval_data:
        data = load_data_file(config.eval_data, encode, base=model_dir, max_new_tokens=loop.max_new_tokens,
                              min_rows=config.n_eval, max_rows=config.n_eval, what="eval_data",
                              needed_by=f"n_eval={config.n_eval}", input_key=config.input_key,
                              label_key=config.label_key)
        prompts, labels = data.prompt_ids, data.labels
    else:
        _, rows = make_splits(0, config.n_eval, loop.seed)
        prompts, labels = [encode(r["prompt"]) for r in rows], [r["label"] for r in rows]
    api_key = os.environ.get(ROLLOUT_API_KEY_ENV) or None
    grader = resolve_reward(config.eval_reward, config.eval_data, "eval_reward").grader(
        max_error_ratio=config.max_grader_error_ratio)
    with RolloutServer(RolloutEngine(model_dir), api_key=api_key) as server, \
            SGLangClient(server.url, api_key=api_key, timeout=600) as client:
        return evaluate(HTTPRollout(client), prompts, labels, n=loop.eval_samples, max_new_tokens=loop.max_new_tokens,
                        seed=loop.seed + 99, decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                        grader=grader)
