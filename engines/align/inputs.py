"""What `v4rl align` compares: held-out prompts, one rollout per prompt, and the trainer's weights.

  held_out_prompts   the first N problems of the run's held-out math set (rl/math_task.py, the same
                     200-problem eval split `v4rl train` evaluates on), tokenized with the checkpoint's
                     tokenizer as `v4rl train` does: BOS + prompt.
  generate           our rollout engine (engines/rollout/engine.py, holding the HF FP8/FP4 weights as
                     stored) samples one response per prompt with a fixed seed and reports the RAW
                     logprob of each sampled token; returns those rollouts and an fp32 copy of the
                     engine's own weights for the layer-by-layer comparison.
  load_torch_dist    a torch_dist directory (release or training iteration, either Miles generation's
                     Megatron names) read through megatron-core into native names, after checking it
                     holds the same model as the HF directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from checkpoints.names import megatron_to_native
from checkpoints.megatron_io import megatron_load, megatron_tensor_metadata
from checkpoints.torch_dist import Box, hf_config_of, megatron_specs, resolve_iteration_dir, stored_megatron_names
from engines.model import DeepseekV4, ModelConfig

HELD_OUT_PROBLEMS = 200
"""Size of the held-out split `v4rl train` evaluates on (TrainRunConfig.n_eval); align draws its first N."""


class AlignError(ValueError):
    """Align cannot run on these inputs; the message names the input and what to do."""


@dataclass(frozen=True)
class Rollout:
    """One generated sequence: the tokens every engine rescores, and the rollout engine's logprobs of them."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str


def held_out_prompts(tokenizer, n: int, seed: int, bos_token_id: int) -> list[list[int]]:
    """Token ids (BOS + prompt) of the first n held-out math problems for `seed`."""
    from rl.math_task import make_splits

    if n < 1:
        raise AlignError(f"--prompts must be >= 1, got {n}")
    _, rows = make_splits(0, max(n, HELD_OUT_PROBLEMS), seed)
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else bos_token_id
    return [[bos] + tokenizer(r["prompt"], add_special_tokens=False).input_ids for r in rows[:n]]


def generate(model_dir: str | Path, *, n_prompts: int, seed: int, temperature: float, max_new_tokens: int,
             dtype: str) -> tuple[list[Rollout], DeepseekV4]:
    """Sample one response per held-out prompt on our rollout engine; also return its weights as an fp32 model."""
    from engines.rollout.engine import EngineConfig, RequestSpec, RolloutEngine
    from engines.rollout.sampling import SamplingParams
    from engines.rollout.weights import prepare_runtime_model, rebuild_runtime

    engine = RolloutEngine(model_dir, EngineConfig(dtype=dtype))
    try:
        if engine.tokenizer is None:
            raise AlignError(f"{model_dir} ships no tokenizer (tokenizer.json / tokenizer_config.json); align "
                             "tokenizes the held-out prompts with the checkpoint's own tokenizer")
        prompts = held_out_prompts(engine.tokenizer, n_prompts, seed, engine.cfg.bos_token_id)
        params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)
        specs = [RequestSpec(rid=f"align-{i}", input_ids=p, sampling=params, seed=seed * 1_000_003 + i,
                             return_logprob=True) for i, p in enumerate(prompts)]
        outs = engine.generate(specs)
        fp32 = prepare_runtime_model(engine.cfg, torch.float32)
        rebuild_runtime(fp32, engine.store, rocm_fnuz=engine.config.rocm_fnuz)
    finally:
        engine.shutdown()
    rollouts = [Rollout(list(o.input_ids), list(o.output_ids), list(o.output_logprobs), o.finish_reason["type"])
                for o in outs]
    return rollouts, fp32


def load_torch_dist(path: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Native-named fp32 weights of a torch_dist checkpoint, loaded by megatron-core; must hold the model `cfg`."""
    try:
        d = resolve_iteration_dir(path)
        raw = hf_config_of(d)
        if raw is not None and ModelConfig.from_hf_dict(raw) != cfg:
            raise AlignError(f"{d} holds a different model than --model (the config stored in common.pt differs "
                             "from config.json); convert this HF directory with `v4rl convert` and align those two")
        stored = megatron_tensor_metadata(d)
        names = stored_megatron_names(stored, where=str(d))  # either Miles generation's names
        specs = megatron_specs(cfg, names)
        missing = [k for k in specs if k not in stored]
        wrong = [k for k in specs if k in stored and tuple(stored[k].shape) != tuple(specs[k].shape)]
        if missing or wrong:
            bad = missing[0] if missing else f"{wrong[0]} {tuple(stored[wrong[0]].shape)}"
            raise AlignError(f"{d} does not hold this model's tensors ({len(missing)} missing, {len(wrong)} of another "
                             f"shape, e.g. {bad}); was it converted from --model?")
        boxes = [Box(key, (0,) * len(spec.shape), spec.shape) for key, spec in specs.items()]
        tensors = megatron_load(d, boxes, specs)
    except AlignError:
        raise
    except (OSError, ValueError) as exc:  # TorchDistError is a ValueError
        raise AlignError(f"cannot read the torch_dist checkpoint {path}: {exc}") from exc
    native = megatron_to_native({b.key: t for b, t in zip(boxes, tensors)}, cfg, names)
    # tid2eid is int32 on disk (as Miles holds it); native tables are int64, what the models index with
    return {k: v.float() if v.is_floating_point() else v.to(torch.int64) for k, v in native.items()}
