"""`v4rl train`'s settings under their flag names: the library (TrainRunConfig, rl/datasets.py, rl/reward_spec.py)
names a problem by its config field (`rollout_expert_dtype='bf16'`, `train_data ... prompts_per_step=128`), which
is right for the Prefect form and the flow parameters, but a command-line user typed `--rollout-expert-dtype` and
`--prompts-per-step`. Every setting is checked up front, so all of a command line's mistakes come back at once.

    problems = setting_problems(reward="nope", eval_reward="auto", rollout_expert_dtype="bf16",
                                rollout_weights="fp8")  # two lines
    as_flags("train_data has only 2 usable rows ... (prompts_per_step=128)")  # '--train-data ... (--prompts-per-step=128)'
"""

from __future__ import annotations

import re

FIELDS = ("train_data", "eval_data", "prompts_per_step", "n_samples", "n_eval", "eval_interval", "eval_reward",
          "max_grader_error_ratio", "rollout_expert_dtype", "rollout_weights", "dynamic_sampling", "lr")
"""TrainRunConfig / LoopConfig fields that are `v4rl train` flags of the same name with dashes (input_key and
label_key are not here: the data loader's message names both spellings itself)."""

_FIELD = re.compile(r"(?<![\w/.-])(" + "|".join(FIELDS) + r")(?![\w/-]|\.\w)")  # not in a/train_data.jsonl
_REWARD = re.compile(r"(?<![\w/.-])reward(?==)")  # the bare word "reward" is prose; `reward=` is the setting


def as_flags(message: str) -> str:
    """The message with each config field name replaced by its flag (`train_data` -> `--train-data`); a name inside
    a path (`/data/train_data.jsonl`) is left alone."""
    message = _FIELD.sub(lambda m: "--" + m.group(1).replace("_", "-"), message)
    return _REWARD.sub("--reward", message)


def setting_problems(*, reward: str, eval_reward: str, rollout_expert_dtype: str,
                     rollout_weights: str) -> list[str]:
    """One line per setting the run would refuse (the same checks TrainRunConfig makes), named by its flag."""
    from engines.train.run import EXPERT_DTYPES, ROLLOUT_WEIGHTS
    from rl.reward_spec import check_reward_spec

    problems = []
    for flag, spec in (("--reward", reward), ("--eval-reward", eval_reward)):
        try:
            check_reward_spec(spec, flag)
        except ValueError as exc:
            problems.append(str(exc))
    if rollout_expert_dtype not in EXPERT_DTYPES:
        problems.append(f"--rollout-expert-dtype {rollout_expert_dtype!r} is not a routed-expert storage the rollout "
                        f"engine serves; choose one of {', '.join(EXPERT_DTYPES)}")
    if rollout_weights not in ROLLOUT_WEIGHTS:
        problems.append(f"--rollout-weights {rollout_weights!r} is not a way the rollout engine serves the linears; "
                        f"choose fp8 (FP8 rollout, as on the cluster) or bf16 (unquantized)")
    return problems
