"""The TRL side of `v4rl bench e2e`: TRL's `GRPOTrainer` on the shared settings, one GRPO step per turn.

`trl_config` maps bench/e2e_settings.py's `E2ESettings` onto TRL's `GRPOConfig` (what differs from `v4rl train`
and why is listed in `DIFFERENCES`); `reward_function` is v4rl's synthetic-task grader in TRL's reward-function
form; `run_side` runs the trainer in a child process that bench/e2e.py started, taking a step only when the
parent hands it the turn, timing it, and saving its weights at the evaluation steps.

The model is the one a TRL user gets: transformers' stock `DeepseekV4ForCausalLM` (torch Sinkhorn, no v4rl
kernels), holding the base checkpoint's weights in fp32, trained under TRL's BF16 autocast, generating with
transformers `generate` (its DynamicCache) on the whole generation batch at once.

    python -m pytest tests/test_e2e_bench.py -q      # a two-step smoke run of both sides
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path
from typing import Any

from bench.e2e_settings import E2ESettings, step_prompts, synthetic_grader, v4rl_config

DIFFERENCES = {
    "tis": "v4rl reweights each token by TIS (its rollout engine samples from FP8 weights, its trainer computes "
           "in BF16); TRL generates with the training model itself, so there is no engine mismatch to correct "
           "(TRL's importance-sampling correction exists only for vLLM)",
    "rollout_weights": "v4rl samples from the FP8 export it serves (FP8 linears and experts, UE8M0 scales) and its "
                       "trainer forwards with the same FP8 weights (quantization_aware); TRL samples and trains on "
                       "fp32 master weights under BF16 autocast",
    "adv_eps": "group std + 1e-6 (v4rl, Miles) against + 1e-4 (TRL's fixed epsilon)",
    "micro_batches": "v4rl packs micro-batches of one prompt length up to max_tokens_per_gpu with each prompt "
                     "forwarded once per micro-batch; TRL forwards full padded sequences in micro-batches of "
                     "per_device_train_batch_size completions (chosen to fill the same token budget)",
    "weight_sync": "v4rl exports FP8 weights and loads them into its rollout server every step (timed in its "
                   "step); TRL has no separate rollout engine",
}
"""Settings both sides cannot share, and why (the JSON carries them)."""


TRL_LOSS_TYPE = {"token-mean": "dapo", "sample-mean": "grpo"}
"""TRL's loss_type of each v4rl loss aggregation (tests/test_trl_loss_parity.py checks both on TRL's own loss)."""

TRL_PIN = "trl==1.16.0"
"""What pyproject's `bench` extra installs: the newest TRL, checked against transformers 5.23 and torch 2.13."""


def require_trl() -> str:
    """TRL's version, or a clear error saying how to install it."""
    try:
        import trl
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(f"v4rl bench e2e needs TRL ({TRL_PIN}); install the bench extra: "
                                  ".venv/bin/pip install -e '.[bench]'", name="trl") from exc
    return trl.__version__


def reward_function(completions: list[str], label: list[str], **kwargs: Any) -> list[float]:
    """v4rl's synthetic-task reward as a TRL reward function: 1.0 when the last \\boxed{} holds the label as a
    plain number, else 0.0. TRL passes the dataset's `label` column by name.

    >>> reward_function(["\\\\boxed{85}", "\\\\boxed{47+38}", "85"], label=["85", "85", "85"])
    [1.0, 0.0, 0.0]
    """
    return synthetic_grader().grade(list(completions), list(label), where="TRL reward").rewards


def micro_batch_size(settings: E2ESettings, longest_sequence: int) -> int:
    """The largest divisor of a step's samples whose padded micro-batch (size x longest prompt + response) fits
    v4rl's max_tokens_per_gpu: TRL then takes one optimizer step per GRPO step over every sample.

    >>> micro_batch_size(E2ESettings(prompts_per_step=128, n_samples=8), longest_sequence=45)
    128
    """
    samples = settings.prompts_per_step * settings.n_samples
    fitting = [d for d in range(1, samples + 1) if samples % d == 0 and d * longest_sequence <= settings.max_tokens_per_gpu]
    return max(fitting or [1])


def trl_config(settings: E2ESettings, output_dir: str, longest_prompt: int):
    """TRL's GRPOConfig for the shared settings: one generation of prompts x samples and one AdamW step per
    GRPO step, the settings' loss aggregation (token-mean: TRL's "dapo", sample-mean: its "grpo", which averages
    each micro-batch's sample means and divides by the accumulation steps: equal micro-batches make that the
    step's sample mean) with v4rl's clip range, no KL term, v4rl's optimizer, CPU."""
    from trl import GRPOConfig

    from engines.train.trainer import TrainerConfig
    from rl.grpo import GRPOConfig as V4rlGRPO

    s, ours, optimizer = settings, V4rlGRPO(), TrainerConfig()
    batch = micro_batch_size(s, longest_prompt + s.max_new_tokens)
    return GRPOConfig(
        output_dir=output_dir, use_cpu=True, bf16=True, seed=s.seed, report_to=[], disable_tqdm=True,
        max_steps=s.steps, logging_steps=1, save_strategy="no", dataloader_num_workers=0,
        # one generation batch = the step's prompts x samples; accumulated micro-batches = one optimizer step
        num_generations=s.n_samples, per_device_train_batch_size=batch,
        gradient_accumulation_steps=s.prompts_per_step * s.n_samples // batch, num_iterations=1,
        shuffle_dataset=False,  # the dataset is already in v4rl's step order
        max_completion_length=s.max_new_tokens, temperature=s.temperature, top_p=1.0, top_k=0,
        learning_rate=s.lr, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        adam_beta1=optimizer.betas[0], adam_beta2=optimizer.betas[1], weight_decay=optimizer.weight_decay,
        max_grad_norm=ours.max_grad_norm,
        loss_type=TRL_LOSS_TYPE[s.loss_aggregation], epsilon=ours.clip_low, epsilon_high=ours.clip_high,
        beta=0.0,  # v4rl: no KL term
        scale_rewards="group" if v4rl_config(s).loop.normalize_std else "none", mask_truncated_completions=False,
        router_aux_loss_coef=0.0,  # v4rl has no load-balancing loss; TRL would add the model config's
        activation_checkpointing=False,  # TRL defaults to recomputing activations; v4rl does not (recompute off)
    )


def run_side(conn, settings_dict: dict[str, Any], out_dir: str) -> None:
    """Child-process entry: build TRL's trainer, then per step wait for the turn, train, report, snapshot.

    Messages to the parent: ("ready", setup_s), ("step", step, seconds, phases), ("done", log_history),
    ("error", traceback). From the parent: "go" (take the next step); anything else, or the socket closing, stops
    the side (the parent also terminates it by pid when it fails)."""
    try:
        _run(conn, E2ESettings(**settings_dict), Path(out_dir))
    except BaseException:  # the parent re-raises it as the TRL side's failure, with this traceback
        conn.send(("error", traceback.format_exc()))
        raise


def _run(conn, settings: E2ESettings, out_dir: Path) -> None:
    t0 = time.perf_counter()
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from bench.e2e_snapshots import save_snapshot
    from checkpoints.hf import load_hf_checkpoint
    from engines.train.hf_model import reference_from_native
    from engines.train.run import prompt_encoder

    torch.manual_seed(settings.seed)
    tokenizer = AutoTokenizer.from_pretrained(settings.base)
    rows = step_prompts(settings)
    encode = prompt_encoder(tokenizer)
    # TRL tokenizes the prompt text as given (special tokens on); v4rl prepends BOS itself. A tokenizer that adds
    # no BOS (engines/tiny_base) gets it in the text.
    adds_bos = tokenizer(rows[0]["prompt"])["input_ids"] == encode(rows[0]["prompt"])
    texts = [r["prompt"] if adds_bos else tokenizer.bos_token + r["prompt"] for r in rows]
    for text, row in zip(texts, rows):
        if tokenizer(text)["input_ids"] != encode(row["prompt"]):
            raise ValueError(f"TRL would tokenize {row['prompt']!r} differently from v4rl train; the bench needs "
                             "both sides to see the same prompt tokens")
    cfg, native = load_hf_checkpoint(settings.base)
    model = reference_from_native(cfg, native)
    longest_prompt = max(len(encode(r["prompt"])) for r in rows)
    args = trl_config(settings, str(out_dir / "trl-output"), longest_prompt)
    dataset = Dataset.from_list([{"prompt": t, "label": r["label"]} for t, r in zip(texts, rows)])
    phases: dict[str, float] = {}
    seen: list[str] = []
    snapshots = set(settings.eval_steps())
    per_step = settings.prompts_per_step

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer with its rollout phases timed: generation, and generation + reward + advantages."""

        def _generate(self, prompts):
            start = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                phases["generate_s"] = phases.get("generate_s", 0.0) + time.perf_counter() - start

        def _generate_and_score_completions(self, inputs):
            seen.extend(x["prompt"] for x in inputs)
            start = time.perf_counter()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                phases["rollout_s"] = phases.get("rollout_s", 0.0) + time.perf_counter() - start

    class Turns(TrainerCallback):
        """Take a step only on the parent's turn; time it; check it trained on v4rl's prompts of the same step;
        snapshot the weights at the evaluation steps."""

        def on_train_begin(self, args, state, control, **kwargs):
            conn.send(("ready", time.perf_counter() - t0))

        def on_step_begin(self, args, state, control, **kwargs):
            if conn.recv() != "go":
                raise RuntimeError("the bench stopped the TRL side")
            phases.clear()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            seconds = time.perf_counter() - self.start
            step = state.global_step
            expected = texts[(step - 1) * per_step:step * per_step] * settings.n_samples
            if sorted(seen) != sorted(expected):
                raise RuntimeError(f"TRL step {step} generated for other prompts than v4rl train's step {step}; "
                                   "the comparison needs both on the same data")
            seen.clear()
            conn.send(("step", step, seconds, dict(phases)))
            if step in snapshots:
                save_snapshot(out_dir / "snapshots" / "trl", step, trainer.model, settings.base)

    save_snapshot(out_dir / "snapshots" / "trl", 0, model, settings.base)
    trainer = TimedGRPOTrainer(model=model, reward_funcs=reward_function, args=args, train_dataset=dataset,
                               processing_class=tokenizer, callbacks=[Turns()])
    trainer.train()
    conn.send(("done", [dict(row) for row in trainer.state.log_history]))


if __name__ == "__main__":
    from multiprocessing.connection import Connection

    parser = argparse.ArgumentParser(description="The TRL side of v4rl bench e2e (started by bench/e2e.py).")
    parser.add_argument("--fd", type=int, required=True, help="file descriptor of the socket to the bench")
    parser.add_argument("--out", required=True, help="directory for TRL's output and weight snapshots")
    parser.add_argument("--settings", required=True, help="E2ESettings as JSON")
    cli = parser.parse_args()
    run_side(Connection(cli.fd), json.loads(cli.settings), cli.out)
