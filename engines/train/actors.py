"""The two sides of a run as plain classes that Ray hosts as actors (engines/train/cluster.py places them):

  TrainerWorker   transformers trainer (BF16 autocast, fp32 master, AdamW): GRPO steps, weight export as an
                  HF FP8 directory (routed experts as the rollout engine serves them), training checkpoints
                  (torch_dist weights + optimizer/RNG/cursor).
  RolloutWorker   our rollout engine behind its SGLang-compatible HTTP server on 127.0.0.1; the driver talks
                  to it over real HTTP (HTTPRollout), exactly as it would talk to real SGLang.

Nothing here imports Ray: the classes also run in-process (tests, `v4rl train --no-ray`). Their settings arrive
typed (TrainerConfig, GRPOConfig, EngineConfig), pickled by Ray as they are, never as dicts rebuilt on the far side.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from checkpoints.hf import load_hf_checkpoint, save_hf_checkpoint
from engines.rollout.api import EngineConfig
from engines.runs.checkpointing import latest_step, load_training_checkpoint, save_training_checkpoint
from engines.train.trainer import Sample, Trainer, TrainerConfig
from rl.grpo import GRPOConfig
from rl.loop import Completion, Group


class TrainerWorker:
    def __init__(self, base_dir: str, trainer_config: TrainerConfig, grpo_config: GRPOConfig, checkpoint_root: str,
                 seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.base_dir = Path(base_dir)
        self.cfg, native = load_hf_checkpoint(base_dir)
        self.trainer = Trainer.from_native(self.cfg, native, trainer_config)
        self.grpo = grpo_config
        self.checkpoint_root = Path(checkpoint_root)

    def ping(self) -> int:
        return os.getpid()

    def resume(self) -> dict[str, Any]:
        """Load the latest training checkpoint if there is one; returns its step and extra state (or step 0)."""
        step = latest_step(self.checkpoint_root)
        if step is None:
            if self.trainer.step:  # a rollback before the first checkpoint: back to the base weights
                _, native = load_hf_checkpoint(self.base_dir)
                self.trainer = Trainer.from_native(self.cfg, native, self.trainer.config)
            return {"step": 0, "extra": {}}
        state = load_training_checkpoint(self.checkpoint_root, step, self.cfg)
        self.trainer.model.load_state_dict(_to_transformers(state["master"], self.cfg), strict=False)
        self.trainer.load_state(state["trainer"])
        torch.set_rng_state(state["rng"])
        return {"step": step, "extra": state["extra"]}

    def train_step(self, groups: list[Group], advantages: list[list[float]]) -> dict[str, float]:
        samples = [Sample(g.prompt_ids, c.output_ids, c.output_logprobs, r, gi, advantage=a,
                          routed_experts=c.routed_experts)
                   for gi, (g, adv) in enumerate(zip(groups, advantages))
                   for c, r, a in zip(g.completions, g.rewards, adv)]
        return self.trainer.grpo_step(samples, self.grpo)

    def export(self, path: str) -> None:
        """Updated weights in the format the rollout engine serves (HF FP8 linears, UE8M0 scales, routed experts
        as `TrainerConfig.rollout_expert_dtype`: the run's TrainRunConfig.rollout_expert_dtype, the format the
        engine was started with), written atomically."""
        out = Path(path)
        with tempfile.TemporaryDirectory() as tok:
            for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                if (self.base_dir / name).exists():
                    shutil.copy(self.base_dir / name, tok)
            save_hf_checkpoint(out, self.cfg, self.trainer.native_state(),
                               weight_format=self.trainer.config.rollout_weight_format,
                               expert_dtype=self.trainer.config.rollout_expert_dtype, scale_fmt="ue8m0",
                               tokenizer_dir=tok, overwrite=True)

    def save(self, step: int, extra: dict) -> str:
        return str(save_training_checkpoint(self.checkpoint_root, step, self.cfg, self.trainer.native_state(),
                                            trainer_state=self.trainer.state(), rng=torch.get_rng_state(),
                                            extra=extra))


def _to_transformers(native: dict, cfg) -> dict:
    from checkpoints.names import native_to_transformers

    return native_to_transformers(native, cfg)


class RolloutWorker:
    """Our engine + its HTTP server on 127.0.0.1 in this process; `url()` is what the driver talks to."""

    def __init__(self, model_dir: str, engine_config: EngineConfig | None = None, api_key: str | None = None) -> None:
        from engines.rollout.engine import RolloutEngine
        from engines.rollout.server import RolloutServer

        self.engine = RolloutEngine(model_dir, engine_config or EngineConfig())
        self.server = RolloutServer(self.engine, host="127.0.0.1", port=0, api_key=api_key).start()

    def url(self) -> str:
        return self.server.url

    def ping(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        self.server.stop()


class HTTPRollout:
    """The loop's Rollout over SGLang's HTTP API (our server or real SGLang): generate, then update + gate."""

    def __init__(self, client, *, fidelity_probe: list[list[int]] | None = None,
                 routed_experts_top_k: int | None = None) -> None:
        """`routed_experts_top_k`: ask for the experts every token was routed to (routing replay; the server needs
        --enable-return-routed-experts) and decode them with this top_k; None: do not ask."""
        self.client = client
        self.fidelity_probe = fidelity_probe or []
        self.routed_experts_top_k = routed_experts_top_k

    def generate(self, prompts, *, n: int, temperature: float, max_new_tokens: int, seed: int) -> list[list[Completion]]:
        params = {"temperature": temperature, "max_new_tokens": max_new_tokens, "n": n, "sampling_seed": seed}
        want_routes = self.routed_experts_top_k is not None
        outs = self.client.generate_ids(prompts, params, return_logprob=True, return_routed_experts=want_routes)
        if len(outs) != len(prompts) * n:
            raise RuntimeError(f"rollout returned {len(outs)} outputs for {len(prompts)} prompts x n={n}")
        done = [Completion(o.output_ids, o.output_logprobs, o.finish_type,
                           self._routes(o, len(prompts[i // n])) if want_routes else None)
                for i, o in enumerate(outs)]
        return [done[i * n:(i + 1) * n] for i in range(len(prompts))]

    def _routes(self, out, prompt_len: int):
        """SGLang's base64 int32 routed experts -> a [prompt + output - 1, layers, top_k] tensor."""
        import base64

        if out.routed_experts is None:
            raise RuntimeError("routing replay asked the rollout for routed experts and got none: serve it with "
                               "--enable-return-routed-experts (SGLang and v4rl serve-rollout alike)")
        rows = prompt_len + len(out.output_ids) - 1
        flat = torch.frombuffer(bytearray(base64.b64decode(out.routed_experts)), dtype=torch.int32)
        if flat.numel() % (rows * self.routed_experts_top_k):
            raise RuntimeError(f"routed experts of {flat.numel()} ids do not fit {rows} tokens x top_k "
                               f"{self.routed_experts_top_k}")
        return flat.view(rows, -1, self.routed_experts_top_k)

    def load_weights(self, path: str, version: str) -> dict[str, Any]:
        """Update from disk while generation is paused; the server rebuilds runtime state before resuming."""
        self.client.pause_generation("in_place")
        try:
            self.client.begin_weight_update()
            result = self.client.update_weights_from_disk(path, weight_version=version)
            self.client.end_weight_update()
        finally:
            self.client.continue_generation()
        return result if isinstance(result, dict) else {"result": result}
