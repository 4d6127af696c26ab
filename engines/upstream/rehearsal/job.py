"""The rehearsal's Miles job: the job v4rl builds for the cluster preset, changed only where a CPU must differ.

`rehearsal_job` starts from engines/miles/command.py's `build_command` for the cluster preset (model flags
from the tiny checkpoint's config.json, so the model flags already differ from the cluster's Flash: that row is
listed once) and then applies SUBSTITUTIONS, each a flag with the value the rehearsal gives it and why. Every
applied change is a `Substitution` row (flag or variable, cluster value, rehearsal value, why); nothing else of
the cluster job changes: data keys, Miles' reward, GRPO + TIS flags, eval with pass@k, SGLang limits Miles checks.

The actor's Megatron layout is one of LAYOUTS (`RehearsalRequest.layout`, `v4rl rehearse --layout`): "1" (one
logical GPU, TP/PP/EP 1) or "pp2-ep2" (4 logical GPUs: PP 2 x DP 2, EP 2: 2 layers per stage, 2 experts per rank),
built by the cluster's own parallel-flag code (train_args.py megatron_parallel_args: generation 2's
--pipeline-model-parallel-layout included), each flag that differs from the cluster's a row.

    job = rehearsal_job(SEED_RUN, RehearsalPaths(...), engine_addr="127.0.0.1:31777", stage="rollout")
    job = rehearsal_job(SEED_RUN, paths, engine_addr=..., stage="train", layout="pp2-ep2")
    print(job.argv[:4]); print(substitution_table(job.substitutions))
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from engines.layout.specs import ParallelSpec
from engines.presets.spec import RunPreset
from engines.miles.command import MilesJob, build_command, parse_flags
from engines.miles.jobs import with_flags, without_flags

DEVICE = {"name": "AMD Instinct MI355X", "total_memory": 288 * 2**30, "capability": [9, 5]}
"""What torch.cuda answers in the rehearsal's processes (Megatron's validate_args asks): the cluster's MI355X."""
ROLLOUT_SIZES = {"num_rollout": 2, "rollout_batch_size": 2, "n_samples_per_prompt": 2, "rollout_max_response_len": 24,
                 "n_samples_per_eval_prompt": 4, "eval_max_response_len": 24, "eval_interval": 1}
"""A few rollouts of a few short samples: two rollouts of 2 prompts x 2 samples (GRPO groups of 2) with an eval
before and after each (4 prompts x 4 samples: pass@1/2/4). Miles' actor trains one sample per micro-batch, padded
to 256 tokens (--qkv-format bshd pads to the HCA ratio, 128; prompts are 129 tokens so the HCA layer compresses
one block), so a train step costs about 4 s a sample on 2 cores with Megatron's unfused attention."""


@dataclass(frozen=True)
class RehearsalLayout:
    """The actor's Megatron parallelism on Ray logical GPUs of this machine (gloo process groups)."""

    parallel: ParallelSpec
    """The parallel sizes the job is built with (engines/miles/train_args.py, as for the cluster)."""
    world: int
    """The actor's ranks (logical GPUs): TP x PP x CP x DP, and a multiple of ETP x EP x PP (Megatron's rule)."""
    why: str
    """What the layout rehearses (the substitution rows' reason)."""
    memory_gib: float = 5.1
    """Memory a rehearsal at this layout needs at its peak (stage full, the largest): the summed proportional set
    size of every process it starts, as measured (docs/rehearsal.md); less available refuses it before it starts."""

    def __post_init__(self) -> None:
        p = self.parallel
        if self.world % (p.tp * p.pp * p.cp) or self.world % (p.expert_tp * p.ep * p.pp):
            raise ValueError(f"rehearsal layout of {self.world} ranks: TP x PP x CP ({p.tp * p.pp * p.cp}) and "
                             f"ETP x EP x PP ({p.expert_tp * p.ep * p.pp}) must divide it")


LAYOUTS = {
    "1": RehearsalLayout(ParallelSpec(), 1, "one logical GPU for the actor (TP/PP/EP 1)"),
    "pp2-ep2": RehearsalLayout(ParallelSpec(tp=1, pp=2, ep=2, etp=1, cp=1), 4,
                               "layout pp2-ep2: 4 logical GPUs, PP 2 x DP 2 (2 of the tiny model's 4 layers per "
                               "stage), EP 2 (2 of its 4 experts per rank): the seed's PP and EP axes at the size "
                               "the tiny model splits", memory_gib=6.6),
}
"""The rehearsal's actor layouts, by `--layout` name. The cluster's own (the seed's PP4 with a 10-layer last stage,
EP 4) cannot split the tiny model's 4 layers and 4 experts, so each is a substitution row. Memory: layout 1's 5.1 GiB
is stage full's measured peak summed PSS (7.4 GiB summed RSS, 2026-12-07); pp2-ep2's 6.6 GiB is its measured peak
summed RSS (8.7-9.7 GiB) at the same PSS/RSS ratio, an estimate."""


def rehearsal_layout(name: str) -> RehearsalLayout:
    """LAYOUTS[name]; an unknown name is one line listing the known ones."""
    if name not in LAYOUTS:
        raise ValueError(f"--layout {name}: not a rehearsal layout; use one of {', '.join(LAYOUTS)}")
    return LAYOUTS[name]


@dataclass(frozen=True)
class RehearsalPaths:
    hf_checkpoint: Path
    """The tiny FP8 HF checkpoint (Miles reads config/tokenizer, v4rl's engine serves it)."""
    train_data: Path
    eval_data: Path
    work: Path
    """--save/--load, --ref-load (v4rl's converted torch_dist, stage train) and Miles' logs live under it."""
    rollout_data: Path | None = None
    """Miles' `--save-debug-rollout-data` (stage rollout) / `--load-debug-rollout-data` (stage train) directory:
    one `rollout_<id>.pt` per rollout, Miles' own dump (default: <work>/rollout-data)."""

    def rollout_template(self) -> str:
        return str((self.rollout_data or self.work / "rollout-data") / "rollout_{rollout_id}.pt")


@dataclass(frozen=True)
class Substitution:
    name: str
    cluster: str
    rehearsal: str
    why: str

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "cluster": self.cluster, "rehearsal": self.rehearsal, "why": self.why}


@dataclass(frozen=True)
class RehearsalJob:
    argv: list[str]
    env: dict[str, str]
    substitutions: list[Substitution] = field(default_factory=list)
    ray: dict[str, int] = field(default_factory=lambda: {"num_gpus": 2, "num_cpus": 4})
    """The local Ray head's logical resources (RaySession's num_gpus, num_cpus): the layout's GPUs (at least 2) and
    a CPU bundle per actor rank plus Miles' RolloutManager and its lock."""


def flag_text(values: list[str] | None) -> str:
    if values is None:
        return "(absent)"
    return " ".join(values) if values else "(set)"


def rehearsal_job(preset: RunPreset, paths: RehearsalPaths, *, engine_addr: str, stage: str = "rollout",
                  context_length: int, layout: str = "1") -> RehearsalJob:
    """The cluster job for `preset`, with the CPU substitutions applied and recorded, at LAYOUTS[layout]."""
    lay = rehearsal_layout(layout)
    idle_actor = stage == "rollout" and lay.world > 1
    if idle_actor:  # Miles' --debug-rollout-only sizes its idle actor from --rollout-num-gpus (ROLLOUT_ACTOR_ROW)
        lay = LAYOUTS["1"]
    p, world = lay.parallel, lay.world
    hf_config = json.loads((paths.hf_checkpoint / "config.json").read_text())
    cluster_job = build_command(preset, MilesJob.placeholder(preset, _profile(preset)), hf_config=None
                                if preset.hf_config is not None else hf_config)
    job = MilesJob(run_id="rehearsal", hf_checkpoint=str(paths.hf_checkpoint), ref_load=str(paths.work / "ref"),
                   save_dir=str(paths.work / "save"), miles_dir=".", log_dir=str(paths.work))
    # built at the rehearsal layout's parallelism: the cluster's PP4 stage sizes (a 10-layer last stage) cannot
    # split the tiny model's 4 layers, and generation 2 writes them into --pipeline-model-parallel-layout
    built = build_command(dataclasses.replace(preset, parallel=p), job, hf_config=hf_config)
    subs = [Substitution(f"--layout {layout} (stage rollout)", "(the job's layout)", "layout 1 (TP/PP/EP 1)",
                         ROLLOUT_ACTOR_WHY)] if idle_actor else []
    subs += [Substitution("model flags (--num-layers, --hidden-size, --num-experts, ...)",
                         "V4-Flash config.json", "tiny config.json (Flash's per-head dims, 4 layers, 4 experts)",
                         "a model a CPU runs; Miles' attention asserts Flash's per-head shapes, so those stay")]
    argv = list(built.argv)
    changes: list[tuple[str, object, str]] = [
        ("--hf-checkpoint", str(paths.hf_checkpoint), "the tiny checkpoint, served by v4rl's engine"),
        ("--prompt-data", str(paths.train_data), "a few prompts in Miles' format (same --input-key/--label-key)"),
        ("--eval-prompt-data", ["aime", str(paths.eval_data)], "a few eval prompts under the cluster's dataset name"),
        ("--ref-load", str(paths.work / "ref"), "v4rl's torch_dist conversion of the tiny checkpoint "
                                                "(checkpoints/convert.py, the names of this Miles generation)"),
        ("--load", str(paths.work / "save"), "work dir of this rehearsal"),
        ("--save", str(paths.work / "save"), "work dir of this rehearsal"),
        *[(f"--{k.replace('_', '-')}", v, "sizes a CPU decodes and trains in minutes")
          for k, v in ROLLOUT_SIZES.items()],
        ("--actor-num-nodes", 1, "one machine (Ray logical GPUs)"),
        ("--actor-num-gpus-per-node", world, f"one machine (Ray logical GPUs): {lay.why}"),
        ("--num-gpus-per-node", world, f"one machine (Ray logical GPUs): {lay.why}"),
        ("--rollout-num-gpus", 1, "one external engine (Miles counts engines from it)"),
        ("--apply-chat-template", False, "the tiny tokenizer has no chat template; prompts are sent as plain text"),
        ("--apply-chat-template-kwargs", False, "goes with --apply-chat-template"),
        ("--over-sampling-batch-size", False, "a random tiny model solves nothing: every group has equal rewards and "
                                              "dynamic sampling would drop them all, forever"),
        ("--dynamic-sampling-filter-path", False, "goes with --over-sampling-batch-size"),
        ("--tensor-model-parallel-size", p.tp, lay.why),
        ("--pipeline-model-parallel-size", p.pp, lay.why),
        ("--decoder-last-pipeline-num-layers", False, "no pipeline (PP 1)" if p.pp == 1 else
         f"the tiny model's {hf_config['num_hidden_layers']} layers split evenly over PP {p.pp}"),
        ("--expert-model-parallel-size", p.ep, lay.why),
        ("--distributed-backend", "gloo", "no NCCL/RCCL on a CPU: Megatron's process groups are gloo"),
    ]
    changes += _engine_changes(engine_addr, context_length)  # stage train starts no engine: Miles' parser still checks them
    if stage == "rollout":
        changes += [("--debug-rollout-only", True, "stage 1: Miles generates, rewards and evaluates; no actor"),
                    ("--save-debug-rollout-data", paths.rollout_template(),
                     "stage 1 keeps Miles' own dump of each rollout (samples, rollout logprobs) for stage train")]
    elif stage == "train":
        changes += TRAIN_CHANGES + [
            ("--load-debug-rollout-data", paths.rollout_template(),
             "stage 2 trains on stage 1's samples (Miles' own dump); Miles starts no SGLang engine")]
    elif stage == "full":
        changes += TRAIN_DEVICE_CHANGES + FULL_CHANGES
    else:
        raise ValueError(f"stage {stage!r}: the job is built for rollout, train or full")
    for flag, value, why in changes:
        before = parse_flags(argv).get(flag)
        shown = "(absent)" if value is False else "(set)" if value is True else flag_text(
            [str(v) for v in value] if isinstance(value, list) else [str(value)])
        if value is False:
            argv = without_flags(argv, [flag])
        else:
            argv = with_flags(argv, **{flag[2:].replace("-", "_"): value})
        cluster_value = flag_text(parse_flags(cluster_job.argv).get(flag))
        if cluster_value != shown or before is None:
            subs.append(Substitution(flag, cluster_value, shown, why))
    if stage != "train":  # the stages that start Miles' router
        subs.append(ROUTER_READY_ROW)
    subs = list({s.name: s for s in subs}.values())  # a flag changed twice (stage full's --num-rollout): the last
    layout = "--pipeline-model-parallel-layout"
    if layout in parse_flags(argv) or layout in parse_flags(cluster_job.argv):
        subs.append(Substitution(layout, flag_text(parse_flags(cluster_job.argv).get(layout)),
                                 flag_text(parse_flags(argv).get(layout)), "one pipeline stage (PP 1)" if p.pp == 1
                                 else f"{lay.why}; the string built as for the cluster (train_args.py "
                                      "pipeline_layout)"))
    env = {k: v for k, v in built.env.items() if "${" not in v and k != "PYTHONPATH"}
    if world > 1:  # gloo pairs between the actor's ranks listen on loopback only; a file rendezvous per job
        env["GLOO_SOCKET_IFNAME"] = "lo"
        env["V4RL_REHEARSAL_STORE_DIR"] = str(paths.work / "stores" / uuid.uuid4().hex[:12])
        subs.append(Substitution("GLOO_SOCKET_IFNAME", cluster_job.env.get("GLOO_SOCKET_IFNAME", "(unset)"), "lo",
                                 "the actor's gloo groups connect over 127.0.0.1 only"))
        subs.append(Substitution(
            "torch.distributed rendezvous of the actor's ranks", "env:// TCPStore on MASTER_ADDR:MASTER_PORT",
            "a FileStore under <work>/stores/, new for each job (bootstrap)",
            "torch's TCPStore server listens on every interface with no option to choose one; a file rendezvous "
            "keeps the rehearsal on loopback, the ranks and groups are Miles' and Megatron's own"))
        subs += [RENAMED_COLLECTIVES_ROW, SPLIT_SIZES_ROW]
    env["OMP_NUM_THREADS"] = str(actor_threads(world))
    subs.append(Substitution("OMP_NUM_THREADS", cluster_job.env.get("OMP_NUM_THREADS", RAY_THREADS),
                             env["OMP_NUM_THREADS"], THREADS_WHY))
    subs.append(Substitution("PYTHONPATH", cluster_job.env.get("PYTHONPATH", ""),
                             "bootstrap (CPU stand-ins) : Miles : Megatron-LM : SGLang 0.5.23 source : v4rl",
                             "stand-ins injected from outside (sitecustomize), Miles' files unmodified"))
    ray = {"num_gpus": max(2, world), "num_cpus": world + 3}
    subs.append(Substitution("Ray", "the user's cluster (--address)",
                             f"local head, logical GPUs (--num-gpus {ray['num_gpus']})",
                             "Miles' placement groups ask for GPUs; Ray accepts logical ones on a CPU machine"))
    subs.append(Substitution("NCCL_*/RCCL, *_SOCKET_IFNAME", "the cluster's", "(dropped)",
                             "no GPUs, no fabric: process groups are gloo on 127.0.0.1"))
    return RehearsalJob(argv=argv, env=env, substitutions=subs, ray=ray)


RAY_THREADS = "(unset: Ray sets an actor's to its reserved CPUs, 1 here)"
THREADS_WHY = ("the actor computes on the CPU: torch's intra-op threads are this machine's cores shared by the "
               "actor's ranks (Ray's default, one per reserved CPU, left a core idle while training); rollout and "
               "training take turns, so the cores are free")


def actor_threads(ranks: int) -> int:
    """torch threads per actor rank: this machine's cores over the ranks, at least 1."""
    return max(1, (os.cpu_count() or 1) // ranks)


ROUTER_READY_ROW = Substitution(
    "miles/ray/rollout/router_manager.py start_router: wait_for_server_ready", "30 s for the spawned sglang-router",
    "300 s (bootstrap)", "a fresh interpreter on 2 shared cores, beside the actor ranks' imports, took longer than "
    "30 s (--layout pp2-ep2, stage full: twice); the same wait, a dead router still fails at once")
RENAMED_COLLECTIVES_ROW = Substitution(
    "miles/utils/reloadable_process_group.py ReloadableProcessGroup", "forwards _allgather_base, "
    "_reduce_scatter_base, alltoall_base, ... (the torch of Miles' images)", "also all_gather_single, "
    "reduce_scatter_single, all_to_all_single (+ _coalesced), forwarded the same way (bootstrap)",
    "this machine's torch 2.13 calls the renamed methods on Miles' wrapper of each multi-rank group, which then hit "
    "the bare ProcessGroup base: 'No backend type associated with device type cpu' (Megatron's MoE dispatcher)")
SPLIT_SIZES_ROW = Substitution(
    "torch.distributed.all_to_all_single split sizes", "CPU tensors, as Megatron's MoE dispatcher passes them "
    "(the torch of Miles' images takes them)", "the same sizes as Python ints (bootstrap)", "this machine's torch "
    "2.13 binding takes only int sequences (TypeError in the EP all-to-all); the tensors exchanged are unchanged")
ROLLOUT_ACTOR_WHY = ("Miles' --debug-rollout-only sizes its idle actor from --rollout-num-gpus (arguments.py: "
                     "actor GPUs = min(8, rollout GPUs)): 1 for v4rl's one external engine, and Megatron cannot lay "
                     "PP 2 on 1 rank (parallel_state.py:735 world_size (1) is not divisible by 2); stage rollout "
                     "trains nothing, so its idle actor is built at layout 1 and the layout applies to train/full")


def _engine_changes(engine_addr: str, context_length: int) -> list[tuple[str, object, str]]:
    """v4rl's engine as Miles' external SGLang (the stages that generate)."""
    return [
        ("--rollout-num-gpus-per-engine", 1, "v4rl's engine is one process on one device"),
        ("--sglang-tp-size", 1, "v4rl's engine is one process on one device"),
        ("--sglang-ep-size", 1, "v4rl's engine is one process on one device"),
        ("--sglang-context-length", context_length, "the engine's context length (the tiny model's positions)"),
        ("--rollout-external", True, "v4rl's engine is Miles' SGLang: Miles uses engines it did not launch"),
        ("--rollout-external-engine-addrs", engine_addr, "`v4rl serve-rollout` on 127.0.0.1"),
        ("--worker-urls", f"http://{engine_addr}", "Miles registers no external engine with the router it launches "
                                                   "(sglang_engine.py _init_external): the router gets it at start"),
        ("--router-prometheus-host", "127.0.0.1", "the router's metrics bind 0.0.0.0 by default; loopback only"),
    ]


TRAIN_DEVICE_CHANGES: list[tuple[str, object, str]] = [
    ("--use-cpu-initialization", True, "Megatron allocates the model on the CPU (no GPU to initialise on)"),
    ("--no-gradient-accumulation-fusion", True, "the fused wgrad accumulation is a CUDA kernel (TE/apex)"),
    ("--optimizer-cpu-offload", False, "the optimizer already lives on the host: nothing to offload"),
    ("--use-precision-aware-optimizer", False, "TE FusedAdam's master weights and low-precision moments; the CPU "
                                               "stand-in of FusedAdam keeps fp32 moments on Megatron's fp32 main params"),
    ("--overlap-cpu-optimizer-d2h-h2d", False, "goes with --optimizer-cpu-offload"),
]
"""The device flags of the stages that train: what Megatron needs to build, load and train Miles' model on a CPU."""
TRAIN_CHANGES = [("--debug-train-only", True, "stage 2: Miles' Megatron actor trains on saved rollouts; no engine, "
                                              "no broadcast"), *TRAIN_DEVICE_CHANGES]
FULL_ROLLOUTS = 3
"""Stage full's --num-rollout: rollouts 0 and 1, then the kill, then rollout 2 resumed from --load."""
FULL_CHANGES: list[tuple[str, object, str]] = [
    ("--num-rollout", FULL_ROLLOUTS, "stage 3: 2 rollouts, a kill after rollout 1's save, 1 rollout resumed"),
    ("--save-interval", 1, "save after every rollout, so the killed run resumes from the last one"),
    ("--lr", 1e-3, "the cluster's 1e-6 moves no bf16 weight in two steps: a visible update makes each broadcast "
                   "(and the resumed checkpoint) carry weights the previous one did not"),
    ("--entropy-coef", 0.01, "a random tiny model earns reward 0, so every GRPO advantage (and the policy "
                             "gradient) is 0; the entropy term gives the step a nonzero gradient"),
]
"""Stage full (Miles' normal loop: broadcast, generate, train, save, eval) on top of the device flags."""


def _profile(preset: RunPreset):
    from engines.profiles import get_profile

    return get_profile(preset.profile)


def substitution_table(subs: list[Substitution], width: int = 120) -> str:
    """The rows as an aligned text table `width` columns wide. Flag and values are clipped at 60 characters (the
    --json report has them whole); the why is never cut: wrapped under its column, or on indented lines below its
    row when the values leave that column under 30 characters."""
    import textwrap

    rows = [("flag or variable", "cluster", "rehearsal", "why")] + [(s.name, s.cluster, s.rehearsal, s.why)
                                                                    for s in subs]
    clip = [tuple(c if len(c) <= 60 else c[:57] + "..." for c in row[:3]) + (row[3],) for row in rows]
    widths = [max(len(r[i]) for r in clip) for i in range(3)]
    start = sum(widths) + 6
    whole = {"break_on_hyphens": False, "break_long_words": False}  # a flag or a path stays one piece
    lines = []
    for row in clip:
        head = "  ".join(row[i].ljust(widths[i]) for i in range(3))
        if width - start >= 30:
            why = textwrap.wrap(row[3], width - start, **whole) or [""]
            lines += [f"{head}  {why[0]}"] + [" " * start + part for part in why[1:]]
        else:
            lines += [head.rstrip()] + textwrap.wrap(row[3], width, initial_indent="    ", subsequent_indent="    ",
                                                     **whole)
    return "\n".join(lines)
