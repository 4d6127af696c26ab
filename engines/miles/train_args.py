"""The non-model flags of Miles' `train.py`, section by section, in the order Miles' launcher writes them.

Each function maps one part of the run preset (engines/presets/spec.py) to Miles/Megatron/SGLang flags; every
value comes from the preset, the planner's cluster, the profile or the job's paths, so any layout the planner
accepts gets a complete argv (the seed's TP1 PP4 EP4 on 2 + 2 nodes included, which Miles' own launcher has
no preset for). Constants are Miles' launcher's (scripts/amd/run_deepseek_v4.py at 31f1ca961, the same file at
e9e19b223) and say so. Where Miles' two DeepSeek-V4 generations differ (MilesSettings.generation: the
`--dsv4-impl` choice, the pipeline layout string) the functions take the preset's generation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engines.miles.model_args import num
from rl.correction_setting import MIS_ALTERNATIVE, MIS_EXAMPLE
from rl.loss_setting import miles_loss_flags

if TYPE_CHECKING:
    from engines.layout import ClusterSpec
    from engines.profiles import HardwareProfile
    from engines.presets.spec import RunPreset
    from engines.miles.command import MilesJob
    from rl.correction_setting import RolloutCorrection

DYNAMIC_SAMPLING_FILTER = "miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"
OVER_SAMPLING_BATCH_SIZE = 512
"""--over-sampling-batch-size in --mode normal (Miles' launcher: 512 prompts drawn to fill 32 nonzero-std groups)."""


def data_path(job: "MilesJob", path: str) -> str:
    """A preset's dataset path: absolute as given, relative under the job's data_dir."""
    return path if path.startswith(("/", "${")) else f"{job.data_dir}/{path}"


def checkpoint_args(preset: "RunPreset", job: "MilesJob") -> list[str]:
    """Model sources and checkpoints: our torch_dist as --ref-load, Miles' own saves in --load/--save."""
    m = preset.miles
    args = ["--hf-checkpoint", job.hf_checkpoint, "--ref-load", job.ref_load, "--load", job.save_dir,
            "--save", job.save_dir, "--save-interval", str(m.save_interval)]
    return args + (["--save-retain-interval", str(m.save_retain_interval)] if m.save_retain_interval else [])


def rollout_args(preset: "RunPreset", job: "MilesJob") -> list[str]:
    """Prompts, reward, rollout sizes and sampling."""
    d, t = preset.data, preset.train
    args = ["--label-key", d.label_key] + (["--apply-chat-template"] if d.apply_chat_template else [])
    args += (["--rollout-shuffle"] if d.rollout_shuffle else []) + ["--rm-type", d.rm_type]
    args += ["--num-rollout", str(preset.num_rollout), "--rollout-batch-size", str(t.rollout_batch_size),
             "--n-samples-per-prompt", str(t.n_samples_per_prompt), "--rollout-temperature", num(d.temperature),
             "--num-steps-per-rollout", str(t.num_steps_per_rollout)]
    args += ["--balance-data"] if d.balance_data else []
    if preset.mode == "normal":  # DAPO: over-sample prompts, drop groups whose rewards are all equal
        args += ["--over-sampling-batch-size", str(OVER_SAMPLING_BATCH_SIZE),
                 "--dynamic-sampling-filter-path", DYNAMIC_SAMPLING_FILTER]
    args += ["--prompt-data", data_path(job, d.prompt_data), "--input-key", d.input_key,
             "--rollout-max-response-len", str(t.max_response_len)]
    return args + (["--apply-chat-template-kwargs", d.chat_template_kwargs] if d.chat_template_kwargs else [])


def optimizer_args(preset: "RunPreset") -> list[str]:
    """Adam and where its state lives (optimizer offload to host RAM, as the planner sized it)."""
    a, t = preset.algorithm, preset.train
    args = ["--optimizer", a.optimizer, "--lr", num(a.lr), "--lr-decay-style", a.lr_decay_style,
            "--weight-decay", num(a.weight_decay), "--adam-beta1", num(a.adam_beta1), "--adam-beta2", num(a.adam_beta2)]
    if t.optimizer_offload > 0:
        args += ["--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--overlap-cpu-optimizer-d2h-h2d"]
        args += ["--optimizer-offload-fraction", num(t.optimizer_offload)] if t.optimizer_offload < 1 else []
    return args + (["--no-offload-train"] if preset.miles.offload_train is False else [])


ICEPOP_FUNCTION = "miles.backends.training_utils.loss_hub.corrections.icepop_function"
"""--custom-tis-function-path of IcePop (Miles' own token mask, in both DeepSeek-V4 generations)."""
MILES_TIS_CLIP = (0.0, 2.0)
"""Miles' defaults of --tis-clip-low / --tis-clip (arguments.py): bounds equal to them are not written."""


def preset_correction(preset: "RunPreset") -> "RolloutCorrection":
    """The preset's rollout correction: AlgorithmSpec.rollout_correction, or the seed's (use_tis, R3 setting)."""
    from rl.correction_setting import RolloutCorrection

    if preset.algorithm.rollout_correction is not None:
        return preset.algorithm.rollout_correction
    return RolloutCorrection(mode="tis" if preset.algorithm.use_tis else "none",
                             routing_replay=preset.miles.rollout_routing_replay)


def correction_args(preset: "RunPreset") -> list[str]:
    """The rollout correction as Miles' flags: tis `--use-tis` with the clip bounds, icepop the same with Miles'
    `icepop_function`, OPSM `--use-opsm --opsm-delta`; routing replay goes with misc_args. The MIS modes need
    Miles' MIS example, which the pinned Miles trees lack: refused with one line naming the alternative."""
    c = preset_correction(preset)
    if c.mode in MIS_ALTERNATIVE:
        raise ValueError(f"preset {preset.name}: rollout_correction {c.mode!r} needs Miles' {MIS_EXAMPLE} "
                         f"(mis.py), which the pinned Miles generations do not carry; use "
                         f"{MIS_ALTERNATIVE[c.mode]!r} on the cluster, or run {c.mode} on tiny-cpu")
    args: list[str] = []
    if c.mode in ("tis", "icepop"):
        low, high = c.clip_bounds
        args += ["--use-tis"] + (["--tis-clip", num(high)] if high != MILES_TIS_CLIP[1] else [])
        args += ["--tis-clip-low", num(low)] if low != MILES_TIS_CLIP[0] else []
        args += ["--custom-tis-function-path", ICEPOP_FUNCTION] if c.mode == "icepop" else []
    return args + (["--use-opsm", "--opsm-delta", num(c.opsm_delta)] if c.opsm else [])


def grpo_args(preset: "RunPreset") -> list[str]:
    """The policy-gradient loss: GRPO advantages, clip range, KL/entropy terms, the loss aggregation, the rollout
    correction."""
    a = preset.algorithm
    args = ["--advantage-estimator", a.advantage_estimator, "--kl-loss-coef", num(a.kl_loss_coef),
            "--kl-loss-type", a.kl_loss_type, "--entropy-coef", num(a.entropy_coef), "--eps-clip", num(a.eps_clip),
            "--eps-clip-high", num(a.eps_clip_high)]
    return args + miles_loss_flags(a.loss_aggregation) + correction_args(preset)


def wandb_args(job: "MilesJob") -> list[str]:
    """W&B logging when the job names a project; the API key never enters the argv (workers read WANDB_API_KEY)."""
    if not job.wandb_project:
        return []
    args = ["--use-wandb", "--wandb-project", job.wandb_project, "--wandb-group", job.run_id]
    return args + (["--wandb-team", job.wandb_team] if job.wandb_team else []) + ["--disable-wandb-random-suffix"]


def pipeline_layout(num_layers: int, pp: int, first: int | None, last: int | None) -> str:
    """Megatron's `--pipeline-model-parallel-layout` for these stage sizes: `E` (embedding) on the first stage,
    `t*N` decoder layers per stage, `L` (output layer and loss) on the last, stages split by `|`; the seed's
    PP4 with a 10-layer last stage is `Et*11|t*11|t*11|t*10L`."""
    from engines.layout.rules import pipeline_split

    stages, why = pipeline_split(num_layers, pp, first, last)
    if why:
        raise ValueError(why)
    body = [f"t*{n}" for n in stages]
    return "|".join(("E" if i == 0 else "") + b + ("L" if i == len(body) - 1 else "") for i, b in enumerate(body))


def needs_pipeline_layout(preset: "RunPreset", hash_layers: int) -> bool:
    """Generation 2's Megatron refuses hash-routed MoE layers with PP > 1 unless the layout is given (its
    TransformerConfig asserts `pipeline_model_parallel_layout must be set`, conformance C7)."""
    return preset.miles.generation == 2 and preset.parallel.pp > 1 and hash_layers > 0


MEGATRON_VOCAB_DIVISIBLE_BY = 128
"""Megatron's default --make-vocab-size-divisible-by: the vocab is padded to a multiple of this x TP."""


def padded_vocab(vocab: int, tp: int, divisible_by: int = MEGATRON_VOCAB_DIVISIBLE_BY) -> int:
    """Megatron's `_vocab_size_with_padding`: the vocab rounded up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def vocab_divisor(vocab: int, tp: int) -> int:
    """The largest power of two <= Megatron's default whose multiple by TP divides the vocab: Megatron then pads
    nothing. Pad rows are not inert in Miles: its loader fills them with zeros and its logprob softmax runs over the
    padded width, so each zero logit moves every token's logprob (0.020 nats on the tiny model's 500 -> 512;
    docs/conformance.md "Megatron conformance"). 1 when TP does not divide the vocab (padding cannot be avoided)."""
    divisor = MEGATRON_VOCAB_DIVISIBLE_BY
    while divisor > 1 and vocab % (divisor * tp):
        divisor //= 2
    return divisor


def vocab_args(preset: "RunPreset", vocab: int) -> list[str]:
    """`--make-vocab-size-divisible-by` only where Megatron's default would pad this vocab at the preset's TP
    (Flash's 129,280 at TP 4 -> 64; at TP 1 nothing is passed, as Miles' launcher)."""
    tp = preset.parallel.tp
    if padded_vocab(vocab, tp) == vocab:
        return []
    return ["--make-vocab-size-divisible-by", str(vocab_divisor(vocab, tp))]


def megatron_parallel_args(preset: "RunPreset", *, num_layers: int | None = None, hash_layers: int = 0) -> list[str]:
    """The Megatron parallel flags of the actor (what every trainer rank is started with). Stage sizes go as
    `--decoder-first/last-pipeline-num-layers`, or as one `--pipeline-model-parallel-layout` where the Miles
    generation needs it (`needs_pipeline_layout`; `num_layers` then required)."""
    p = preset.parallel
    args = ["--tensor-model-parallel-size", str(p.tp)] + (["--sequence-parallel"] if p.sp else [])
    args += ["--pipeline-model-parallel-size", str(p.pp)]
    if needs_pipeline_layout(preset, hash_layers):
        if num_layers is None:
            raise ValueError("the pipeline layout needs the model's num_layers (config.json num_hidden_layers)")
        args += ["--pipeline-model-parallel-layout",
                 pipeline_layout(num_layers, p.pp, p.first_stage_layers, p.last_stage_layers)]
    else:
        if p.first_stage_layers is not None:
            args += ["--decoder-first-pipeline-num-layers", str(p.first_stage_layers)]
        if p.last_stage_layers is not None:
            args += ["--decoder-last-pipeline-num-layers", str(p.last_stage_layers)]
    # DeepSeek-V4 in Miles supports only all-gather CP (hf_validate_args asserts it when CP > 1)
    args += ["--context-parallel-size", str(p.cp)] + (["--allgather-cp"] if p.cp > 1 else [])
    return args + ["--expert-model-parallel-size", str(p.ep), "--expert-tensor-parallel-size", str(p.expert_tp)]


def dsv4_args(preset: "RunPreset", profile: "HardwareProfile") -> list[str]:
    """Generation 2's DeepSeek-V4 implementation choice (MilesSettings.dsv4_impl); nothing for generation 1."""
    m = preset.miles
    if m.generation not in (1, 2):
        raise ValueError(f"preset {preset.name}: miles.generation={m.generation!r}; Miles' DeepSeek-V4 generations "
                         "are 1 (31f1ca961) and 2 (e9e19b223); set miles_generation 1 or 2")
    if m.dsv4_impl not in ("miles", "megatron"):
        raise ValueError(f"preset {preset.name}: miles.dsv4_impl={m.dsv4_impl!r}; use miles or megatron")
    if m.generation == 1:
        if m.dsv4_impl != "miles":
            raise ValueError(f"preset {preset.name}: dsv4_impl={m.dsv4_impl!r} needs Miles' second DeepSeek-V4 "
                             "generation (e9e19b223 or later; set miles_generation 2); generation 1 has only "
                             "the plugin implementation")
        return []
    if m.dsv4_impl == "megatron" and preset.parallel.tp != 1:
        raise ValueError(f"preset {preset.name}: dsv4_impl='megatron' needs tensor parallel size 1 (Miles refuses "
                         f"TP={preset.parallel.tp}); set tp 1 or dsv4_impl 'miles'")
    args = ["--dsv4-impl", m.dsv4_impl]
    # Megatron's fused DSA kernels are cuDNN (CUDA only); elsewhere its PyTorch path
    return args + (["--dsa-kernel-backend", "none"] if m.dsv4_impl == "megatron" and profile.vendor != "nvidia" else [])


def perf_args(preset: "RunPreset", *, num_layers: int | None = None, hash_layers: int = 0) -> list[str]:
    """Parallel layout, activation recompute, micro-batches.

    Miles trains DeepSeek-V4 with `--qkv-format bshd` (misc_args), which forbids dynamic batch sizes, so
    micro-batches are one sample each; --max-tokens-per-gpu still bounds log-prob passes (conformance A5).
    """
    t = preset.train
    if t.micro_batching != "per-sample":
        raise ValueError(f"preset {preset.name}: train.micro_batching={t.micro_batching!r}, but Miles trains DeepSeek-V4 "
                         "with --qkv-format bshd, which forbids dynamic (packed) batches; set micro_batching="
                         "'per-sample' (one sample per micro-batch, --micro-batch-size 1)")
    args = megatron_parallel_args(preset, num_layers=num_layers, hash_layers=hash_layers)
    if t.recompute == "full":
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    elif t.recompute == "selective":
        args += ["--recompute-granularity", "selective"]
    return args + ["--micro-batch-size", "1", "--max-tokens-per-gpu", str(t.max_tokens_per_gpu)]


def eval_args(preset: "RunPreset", job: "MilesJob") -> list[str]:
    """In-job evaluation: cadence, datasets (`name path` pairs), samples and response budget."""
    e = preset.eval
    if not e.enabled:
        return []
    args = ["--eval-interval", str(e.interval), "--eval-top-p", num(e.top_p), "--eval-prompt-data"]
    for name, path in e.datasets:
        args += [name, data_path(job, path)]
    # --log-passrate: without it Miles logs no eval/<dataset>-pass@k (only the mean reward)
    return args + ["--n-samples-per-eval-prompt", str(e.n_samples_per_prompt),
                   "--eval-max-response-len", str(e.max_response_len), "--log-passrate"]


def sglang_args(preset: "RunPreset") -> list[str]:
    """Rollout engines: GPUs and parallelism per engine, router health checks, and the SGLang limits the planner
    sized memory with (Miles' launcher leaves those at SGLang's defaults; v4rl passes what it checked)."""
    r = preset.rollout
    # One SGLang server per engine (--sglang-dp-size 1: SGLang's weight-sync routes assert dp_size == 1);
    # RolloutSpec.engine_dp is DP attention inside it, SGLang 0.5.23's --attn-dp-size (conformance B18)
    args = ["--rollout-num-gpus-per-engine", str(r.engine_tp), "--sglang-tp-size", str(r.engine_tp),
            "--sglang-dp-size", "1", "--sglang-ep-size", str(r.engine_ep)]
    args += ["--sglang-attn-dp-size", str(r.engine_dp)] if r.engine_dp > 1 else []
    args += ["--router-health-success-threshold", "1", "--router-health-check-interval-secs", "15",
             "--router-health-failure-threshold", "40"]
    return args + ["--sglang-max-running-requests", str(r.max_running_requests),
                   "--sglang-max-total-tokens", str(r.max_total_tokens),
                   "--sglang-context-length", str(r.context_length)]


R3_PAUSE_MODE = "in_place"
"""--pause-generation-mode with routing replay. Miles' default `retract` (both pinned generations define the flag:
abort | retract | in_place) re-prefills a request retracted for a weight update, and SGLang then returns the new
weights' routes beside the logprobs sampled under the old ones (radixark/miles#3277, open): replay would train
on routes that did not produce those tokens. `in_place` freezes the request with its KV and routes."""


def routing_replay_args(preset: "RunPreset") -> list[str]:
    """R3 (--use-rollout-routing-replay), always with R3_PAUSE_MODE; nothing when replay is off."""
    if not preset_correction(preset).routing_replay:
        return []
    return ["--use-rollout-routing-replay", "--pause-generation-mode", R3_PAUSE_MODE]


def misc_args(preset: "RunPreset", cluster: "ClusterSpec", profile: "HardwareProfile") -> list[str]:
    """Placement, weight updates, DeepSeek-V4 training switches, precision, the named Miles settings."""
    m, r = preset.miles, preset.rollout
    args = ["--update-weight-buffer-size", str(m.weight_update_buffer_bytes),
            "--actor-num-nodes", str(cluster.actor_nodes), "--actor-num-gpus-per-node", str(cluster.gpus_per_node),
            "--num-gpus-per-node", str(cluster.gpus_per_node),
            "--train-memory-margin-bytes", str(m.train_memory_margin_bytes),
            "--sglang-mem-fraction-static", num(r.mem_fraction_static),
            "--sglang-watchdog-timeout", str(m.sglang_watchdog_timeout_s),
            "--accumulate-allreduce-grads-in-fp32", "--model-name", "deepseekv4",  # deepseekv4: the mbridge name
            "--qkv-format", "bshd", "--moe-router-freeze-gate", "--freeze-e-score-correction-bias",
            "--rollout-health-check-interval", "300", "--rollout-health-check-timeout", "300"]
    args += ["--colocate"] if cluster.colocated else ["--rollout-num-gpus", str(cluster.rollout_gpus)]
    args += ["--use-fault-tolerance"] if m.fault_tolerance else []
    args += routing_replay_args(preset)
    args += ["--deterministic-mode"] if m.deterministic else []
    if not m.fp8_training:
        return args + ["--bf16"]
    args += ["--transformer-impl", "transformer_engine", "--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "blockwise",
             "--train-env-vars", '{"NVTE_FP8_BLOCK_SCALING_FP32_SCALES":"0"}']
    # ROCm's Transformer Engine MoE FP8 lacks fused wgrad accumulation (Miles' AMD launcher)
    return args + (["--no-gradient-accumulation-fusion"] if profile.vendor == "amd" else [])
