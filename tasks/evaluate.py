"""Prefect task: held-out pass@k on the rollout engine serving given weights, over real HTTP (our
SGLang-compatible server on 127.0.0.1, exactly the client code that drives real SGLang)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE


@task(name="held-out-eval", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5, timeout_seconds=3 * 3600)
def held_out_eval(model_dir: str, *, n_eval: int, n_samples: int, seed: int, max_new_tokens: int = 8) -> dict:
    from transformers import AutoTokenizer

    from engines.rollout.engine import RolloutEngine
    from engines.rollout.server import RolloutServer
    from engines.rollout.sglang import SGLangClient
    from engines.train.actors import HTTPRollout
    from rl.loop import evaluate
    from rl.math_task import make_splits
    from rl.rewards import math_reward

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    _, rows = make_splits(0, n_eval, seed)
    prompts = [[tokenizer.bos_token_id] + tokenizer(r["prompt"], add_special_tokens=False).input_ids for r in rows]
    with RolloutServer(RolloutEngine(model_dir)) as server, SGLangClient(server.url, timeout=600) as client:
        return evaluate(HTTPRollout(client), prompts, [r["label"] for r in rows], n=n_samples,
                        max_new_tokens=max_new_tokens, seed=seed + 99,
                        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                        reward_fn=lambda text, label: math_reward(text, label, literal_only=True))
