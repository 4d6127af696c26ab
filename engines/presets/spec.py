"""What one RL run is made of: the `RunPreset` dataclass and its sections (data, eval, algorithm, Miles settings).

Pure data, no I/O and no torch: the planner (engines/layout), the launch plan (engines/launch) and the Miles job
builder (engines/miles) all read a preset, so it lives below all three and imports none of them. Named
presets are in `engines.presets.runs`.

Where v4rl deliberately differs from Miles' own launcher (`scripts/amd/run_deepseek_v4.py` at the pinned
commit), the difference is a field of `MilesSettings` with its reason; docs/cluster.md lists them in the table
"v4rl settings vs Miles' launcher".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from engines.layout import ModelShape, ParallelSpec, RolloutSpec, TrainSpec
from rl.correction_setting import RolloutCorrection
from rl.loss_setting import DEFAULT_LOSS_AGGREGATION, LossAggregation, check_loss_aggregation


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """The training prompts Miles reads (`--prompt-data`, `--input-key`, `--label-key`, `--rm-type`, ...)."""

    prompt_data: str = "dapo-math-17k/dapo-math-17k.jsonl"
    """--prompt-data: JSONL/parquet of {prompt, label} rows; a relative path is under the job's data_dir.
    Fix a "does not exist" preflight error by pointing the job's data_dir (or this path) at the file."""
    input_key: str = "prompt"
    """--input-key: the column holding the prompt (a string or an OpenAI-style message list)."""
    label_key: str = "label"
    """--label-key: the column holding the reference answer the reward compares with."""
    rm_type: str = "math"
    """--rm-type: Miles' rule-based reward (math = boxed answer graded like verl)."""
    apply_chat_template: bool = True
    """--apply-chat-template: render message-list prompts with the tokenizer's chat template."""
    chat_template_kwargs: str | None = '{"thinking_mode":"thinking"}'
    """--apply-chat-template-kwargs (a JSON object, passed as one argv token); None omits it."""
    rollout_shuffle: bool = True
    """--rollout-shuffle: shuffle the prompts each epoch."""
    balance_data: bool = True
    """--balance-data: balance tokens across data-parallel ranks (Karmarkar-Karp)."""
    temperature: float = 0.8
    """--rollout-temperature."""


@dataclass(frozen=True, kw_only=True)
class EvalSpec:
    """Periodic evaluation inside Miles (`--eval-interval`, `--eval-prompt-data name path ...`)."""

    enabled: bool = True
    """False omits every eval flag (Miles then never evaluates; v4rl's eval subflow has nothing to read)."""
    interval: int = 20
    """--eval-interval: evaluate every N rollouts (and before the first unless Miles is told to skip it)."""
    datasets: tuple[tuple[str, str], ...] = (("aime", "aime-2024/aime-2024.jsonl"),)
    """--eval-prompt-data as (name, path) pairs; a relative path is under the job's data_dir. The name is the
    metric prefix (`eval/<name>`, `eval/<name>-pass@k`). Miles asserts at least one when interval is set."""
    n_samples_per_prompt: int = 8
    """--n-samples-per-eval-prompt: samples per eval problem (pass@k up to k = this)."""
    n_problems: int | None = None
    """Problems per evaluation: the first N usable rows of the held-out set (the embedded engines, and what preflight
    requires of a given eval file). None: every row; Miles has no such flag and evaluates whole datasets."""
    max_response_len: int = 4096
    """--eval-max-response-len: the response budget of an eval sample."""
    top_p: float = 0.7
    """--eval-top-p."""


@dataclass(frozen=True, kw_only=True)
class AlgorithmSpec:
    """GRPO, TIS and the optimizer (Miles' launcher values by default)."""

    advantage_estimator: str = "grpo"
    """--advantage-estimator: grpo | gspo | reinforce_plus_plus | ppo."""
    kl_loss_coef: float = 0.0
    """--kl-loss-coef (0: no KL to the reference policy)."""
    kl_loss_type: str = "low_var_kl"
    """--kl-loss-type."""
    entropy_coef: float = 0.0
    """--entropy-coef."""
    eps_clip: float = 0.2
    """--eps-clip: PPO clip below 1."""
    eps_clip_high: float = 0.28
    """--eps-clip-high: DAPO's clip-higher above 1."""
    use_tis: bool = True
    """--use-tis: truncated importance sampling on the train/rollout logprob mismatch (the seed turns it on)."""
    rollout_correction: RolloutCorrection | None = None
    """The whole rollout correction (rl/correction_setting.py); engines/miles/train_args.py `correction_args`
    writes it as Miles' flags. None: the seed's, token TIS when use_tis (else none) with routing replay as
    miles.rollout_routing_replay. Set, it decides --use-tis and --use-rollout-routing-replay itself."""
    loss_aggregation: LossAggregation = DEFAULT_LOSS_AGGREGATION
    """How the policy loss averages its tokens (rl/loss_setting.py): sample-mean (each sample's token mean over
    the step's samples, Miles' default: no flag) or token-mean (--calculate-per-token-loss). The embedded trainer
    reads the same setting (TrainRunConfig.loss_aggregation); anything else is refused naming the two."""
    optimizer: str = "adam"
    """--optimizer."""
    lr: float = 1e-6
    """--lr."""
    lr_decay_style: str = "constant"
    """--lr-decay-style."""
    weight_decay: float = 0.1
    """--weight-decay."""
    adam_beta1: float = 0.9
    """--adam-beta1."""
    adam_beta2: float = 0.98
    """--adam-beta2."""

    def __post_init__(self) -> None:
        check_loss_aggregation(self.loss_aggregation, "algorithm.loss_aggregation")


RehearsalStage = Literal["rollout", "train", "full"]
"""A stage of `v4rl rehearse` (docs/rehearsal.md): rollout only, rollout then train, or the whole loop."""


@dataclass(frozen=True, kw_only=True)
class MilesSettings:
    """Choices where a Miles run could go two ways; each says what Miles' own launcher does."""

    fp8_training: bool = False
    """False: the actor trains in BF16 (`--bf16`), as the seed did. Miles main's AMD launcher defaults to FP8
    blockwise training (`--transformer-impl transformer_engine --fp8-format e4m3 --fp8-recipe blockwise`,
    `--train-env-vars {NVTE_FP8_BLOCK_SCALING_FP32_SCALES}`, `--no-gradient-accumulation-fusion`); True does that."""
    rollout_routing_replay: bool = False
    """--use-rollout-routing-replay (R3: training replays SGLang's MoE routing). On in Miles main's launcher,
    off in the seed's run; turn it on to follow main."""
    fault_tolerance: bool = False
    """--use-fault-tolerance (Miles restarts dead rollout engines in-job). On in Miles main's launcher; v4rl
    leaves it off because its task retries resume from the last checkpoint instead."""
    deterministic: bool = True
    """--deterministic-mode plus NCCL_ALGO=Ring, NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, CUBLAS_WORKSPACE_CONFIG
    (as Miles' launcher). False trades bitwise reproducibility for speed."""
    offload_train: bool | None = None
    """False passes --no-offload-train (keep the train weights on GPU while rolling out; Miles' launcher does
    this on 4 actor nodes with partial optimizer offload). None leaves Miles' default."""
    save_interval: int = 20
    """--save-interval: save every N rollouts (and at the end), so resume and eval have checkpoints. The
    seed's PR-branch launcher never saved (skip_saving); Miles main saves every 20."""
    save_retain_interval: int | None = 20
    """--save-retain-interval: older checkpoints off this grid are deleted; None keeps every save."""
    weight_update_buffer_bytes: int = 1 << 30
    """--update-weight-buffer-size for the broadcast weight update (Miles' launcher: 1 GiB)."""
    train_memory_margin_bytes: int = 3 << 30
    """--train-memory-margin-bytes (Miles' launcher: 3 GiB)."""
    sglang_watchdog_timeout_s: int = 1800
    """--sglang-watchdog-timeout (Miles' launcher: 1800 s; ROCm tunes GEMMs slowly on first use)."""
    generation: int = 1
    """Which Miles DeepSeek-V4 generation the job (and the converted checkpoint's names) is for; read from the
    user's checkout by engines/miles/generation.py (`v4rl plan --miles-dir`, the flow's miles_check_dir).
    1: Miles main 31f1ca961 + Megatron-LM 2e64d788b (plugin weight names, `--experimental-attention-variant
    dsv4`, pipeline stages by `--decoder-first/last-pipeline-num-layers`). 2: Miles e9e19b223 + Megatron-LM
    6184c094a (Megatron's weight names, `--dsv4-impl`; with hash-routed layers and PP > 1 Megatron's config
    build requires `--pipeline-model-parallel-layout`, which v4rl then writes from the same stage sizes)."""
    dsv4_impl: str = "miles"
    """--dsv4-impl, generation 2 only. "miles": the plugin's attention (BSHD, tilelang kernels, sparse context
    parallelism), the only one with tensor parallelism, what Miles defaults to. "megatron": Megatron's own
    dsv4_hybrid attention (THD); needs TP=1 (Miles refuses more) and a `--dsa-kernel-backend`: cudnn (Megatron's
    default) exists on CUDA only, so v4rl passes `none` (the PyTorch path) on other accelerators. Both read the
    same checkpoint names; their torch_dist training saves are not interchangeable."""
    rehearse: RehearsalStage | None = None
    """Preflight rehearsal: the `v4rl rehearse --stage` (rollout, train or full) the rl-pipeline runs on its own host
    before it submits the Ray job: Miles' own train.py on local Ray, v4rl's engine as its SGLang, this run's job
    changed only where a CPU must differ (docs/rehearsal.md), with the Miles checkout there (miles_check_dir, else
    $V4RL_MILES_DIR or the vendored pins). A failed rehearsal stops the run before any GPU is allocated. None: no
    rehearsal, every preset's default, because it costs minutes of the flow host's CPU (on 2 cores: rollout ~1.5
    min and ~5 GiB, full ~3-4 min and ~6.4 GiB) and needs Miles, Megatron-LM and SGLang sources there; turn it on
    for the first run of a Miles checkout, preset or layout. The embedded tiny-cpu preset has no Miles job and
    never rehearses."""


@dataclass(frozen=True, kw_only=True)
class RunPreset:
    """One named RL run: everything the planner, the launch plan and the Miles job need."""

    name: str
    description: str
    model: Callable[[], ModelShape]
    """Model shape provider (cheap: no torch)."""
    profile: str
    """Hardware profile name (engines.profiles)."""
    nodes: int
    """--num-nodes."""
    rollout_nodes: int
    """--rollout-num-nodes (0 = colocated); the actor gets the rest (--actor-num-nodes)."""
    gpus_per_node: int | None = None
    """Accelerators per node when not the profile's (cluster-rehearsal: 1 logical GPU per node of its local head);
    the `gpus_per_node` override wins over both."""
    parallel: ParallelSpec
    train: TrainSpec
    rollout: RolloutSpec
    hf_config: Callable[[], dict[str, Any]] | None = None
    """The model's config.json (DeepSeek release format) for building the Miles job before the checkpoint is
    at hand (launch plans); a job with a real --hf-checkpoint directory reads that directory's config.json."""
    num_rollout: int = 200
    """--num-rollout: rollout steps of the run."""
    seed: int = 0
    """Seed of the embedded run's data order, sampling and evaluation (v4rl's own; the Miles job keeps Megatron's
    --seed default)."""
    mode: str = "normal"
    """normal adds DAPO over-sampling and the nonzero-std filter (Miles' launcher --mode); debug_minimal not."""
    data: DataSpec = field(default_factory=DataSpec)
    eval: EvalSpec = field(default_factory=EvalSpec)
    algorithm: AlgorithmSpec = field(default_factory=AlgorithmSpec)
    miles: MilesSettings = field(default_factory=MilesSettings)

    @property
    def use_tis(self) -> bool:
        return self.algorithm.use_tis
