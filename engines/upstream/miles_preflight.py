"""Preflight against the user's Miles: run Miles' own `parse_args` on the exact argv v4rl will submit, on CPU.

In a subprocess (engines.upstream.sources.engine_python): Megatron-LM (`--megatron-dir` / $V4RL_MEGATRON_DIR /
the pinned tarball) first on sys.path so its `megatron/` wins over the pip megatron-core, then Miles
(`--miles-dir` / $V4RL_MILES_DIR / the pinned tarball) and SGLang 0.5.23's source with its extra pure-Python
packages (sglang-router, polars, ...); GPU-only imports are stubbed only where their import fails, plus
`sglang.srt.entrypoints.openai.encoding_dsv4`, which Miles main imports and upstream 0.5.23 lacks (it comes
from Miles' sglang-miles branch). `torch.cuda.get_device_capability/get_device_properties` answer as the
profile's accelerator, and the process runs with the job's runtime env, which Megatron asserts on. The probe
(probes/parse_args_probe.py) reports every rejected flag; this module then compares what Miles resolved with
what v4rl meant (parallel sizes, batch and sample counts, eval datasets, save interval, TIS, offload,
precision) and checks the job's local inputs (config.json, dataset files).

    report = check_job(SEED_RUN, job, site=site)          # ~40 s on 2 cores (Miles imports torch + Megatron)
    report.ok, report.rejected, report.mismatches
    reports = check_commands([run, eval_only], SEED_RUN, job, cluster=cluster, profile=profile)  # one import

Several argvs of one Miles generation, accelerator and runtime env are parsed in one probe process
(check_requests), each afresh and answered on its own; check_command and check_job are the one-argv case.

Nothing here is imported by the library at startup: `v4rl plan` without `--miles-dir` never runs it.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from engines.layout import ClusterSpec
from engines.profiles import HardwareProfile, get_profile
from engines.presets.runs import layout_input
from engines.presets.spec import RunPreset
from engines.profiles.site import Site
from engines.miles.command import MilesCommand, MilesJob, build_command
from engines.miles.train_args import data_path

PROBE = Path(__file__).with_name("probes") / "parse_args_probe.py"
MILES_STUB_ROOTS = ("megatron.bridge", "mbridge", "amdsmi", "mooncake", "sglang.srt.entrypoints.openai.encoding_dsv4")
"""Beyond engines.upstream.stubs.GPU_ONLY_ROOTS: Megatron-Bridge and mbridge (pinned git installs in Miles' image),
AMD's SMI bindings, Mooncake, and the DeepSeek-V4 chat encoder of Miles' SGLang branch."""
DEVICES: dict[str, dict[str, Any]] = {  # what torch.cuda reports on the target accelerator
    "mi355x": {"name": "AMD Instinct MI355X", "capability": [9, 5], "total_memory": 288 * 10**9},
    "h200": {"name": "NVIDIA H200", "capability": [9, 0], "total_memory": 141 * 10**9},
}


class MilesRejected(ValueError):
    """Miles' own parser rejects v4rl's job, resolves it differently, or its inputs are missing (not retried)."""


@dataclass
class MilesCheck:
    """What Miles' own parser made of v4rl's job."""

    accepted: bool
    """parse_args (and Miles'/Megatron's validation) returned without error."""
    rejected: list[str]
    """Flags Miles' parser does not know or refused (a Miles checkout of another version shows up here)."""
    error: str
    mismatches: list[str] = field(default_factory=list)
    """'<name>: v4rl meant X, Miles resolved Y' for each value Miles resolved differently."""
    problems: list[str] = field(default_factory=list)
    """Local inputs that cannot work (config.json, dataset files), each with the parameter and the fix."""
    resolved: dict[str, Any] = field(default_factory=dict)
    stubbed: list[str] = field(default_factory=list)
    miles_dir: str = ""
    megatron_dir: str = ""
    stage: str = ""
    """Where the probe stopped: parse | validate | config (Megatron's TransformerConfig built) | import."""
    generation: int = 0
    """The Miles DeepSeek-V4 generation of miles_dir (engines/miles/generation.py)."""

    @property
    def ok(self) -> bool:
        return self.accepted and not self.mismatches and not self.problems

    def summary(self) -> str:
        if self.ok:
            return f"Miles ({self.miles_dir}) accepts the job; every checked value resolved as v4rl meant"
        lines = [f"Miles ({self.miles_dir}) " + ("parses v4rl's job, but:" if self.accepted
                                                 else "rejects v4rl's job (nothing was submitted):")]
        lines += [f"  rejected flag {f}: not an option of this Miles (v4rl builds for Miles 31f1ca961 with "
                  "Megatron-LM 2e64d788b, or e9e19b223 with 6184c094a; check out a pair or point "
                  "--miles-dir/--megatron-dir at one)" for f in self.rejected]
        if not self.accepted and not self.rejected:  # error is one line already (engine_error)
            lines.append(f"  {' '.join(self.error.split()) or 'failed'}")
        lines += [f"  {m}" for m in self.mismatches] + [f"  {p}" for p in self.problems]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "accepted": self.accepted, "rejected": self.rejected, "error": self.error,
                "mismatches": self.mismatches, "problems": self.problems, "resolved": self.resolved,
                "stubbed": self.stubbed, "miles_dir": self.miles_dir, "megatron_dir": self.megatron_dir,
                "stage": self.stage, "generation": self.generation}


def expected_values(preset: RunPreset, job: MilesJob, cluster: ClusterSpec,
                    command: MilesCommand | None = None) -> dict[str, Any]:
    """What v4rl means each checked Miles argument to resolve to (after Miles' own defaults and fallbacks)."""
    p, t, e, m = preset.parallel, preset.train, preset.eval, preset.miles
    has_tracker = (Path(job.save_dir) / "latest_checkpointed_iteration.txt").is_file()
    layout = (command.flag_values().get("--pipeline-model-parallel-layout") or [None])[-1] if command else None
    generation_values: dict[str, Any] = {}
    if m.generation == 2:  # Miles' normalize_dsv4_args picks the attention variant from the impl
        generation_values = {"dsv4_impl": m.dsv4_impl, "experimental_attention_variant":
                             "dsv4_hybrid" if m.dsv4_impl == "megatron" else "dsv4"}
    if layout is not None:  # the stage split travels as the layout string; Megatron leaves first/last unset
        generation_values["pipeline_model_parallel_layout"] = layout
    return {**generation_values,
        "tensor_model_parallel_size": p.tp, "pipeline_model_parallel_size": p.pp,
        "decoder_first_pipeline_num_layers": None if layout else p.first_stage_layers,
        "decoder_last_pipeline_num_layers": None if layout else p.last_stage_layers, "context_parallel_size": p.cp,
        "expert_model_parallel_size": p.ep, "expert_tensor_parallel_size": p.expert_tp, "sequence_parallel": p.sp,
        "actor_num_nodes": cluster.actor_nodes, "actor_num_gpus_per_node": cluster.gpus_per_node,
        "rollout_num_gpus": cluster.rollout_gpus, "rollout_num_gpus_per_engine": preset.rollout.engine_tp,
        "sglang_tp_size": preset.rollout.engine_tp, "sglang_dp_size": 1, "sglang_ep_size": preset.rollout.engine_ep,
        "sglang_attn_dp_size": preset.rollout.engine_dp,
        "colocate": cluster.colocated, "num_rollout": preset.num_rollout, "rollout_batch_size": t.rollout_batch_size,
        "n_samples_per_prompt": t.n_samples_per_prompt, "num_steps_per_rollout": t.num_steps_per_rollout,
        "global_batch_size": t.global_batch, "micro_batch_size": 1, "use_dynamic_batch_size": False,
        "rollout_max_response_len": t.max_response_len,
        "eval_interval": e.interval if e.enabled else None,
        "eval_datasets": [(name, data_path(job, path), e.n_samples_per_prompt, e.max_response_len, e.top_p)
                          for name, path in e.datasets] if e.enabled else [],
        "save": job.save_dir, "save_interval": m.save_interval,
        # Miles loads --load only when it holds a tracker, else --ref-load as a finetune start (arguments.py)
        "load": job.save_dir if has_tracker else job.ref_load, "ref_load": job.ref_load,
        **correction_values(preset), "optimizer_cpu_offload": t.optimizer_offload > 0,
        "optimizer_offload_fraction": t.optimizer_offload if 0 < t.optimizer_offload < 1 else 1.0,
        "bf16": True, "fp8": "e4m3" if m.fp8_training else None,
        "use_fault_tolerance": m.fault_tolerance,
        "deterministic_mode": m.deterministic, "qkv_format": "bshd", "lr": preset.algorithm.lr,
        "calculate_per_token_loss": preset.algorithm.loss_aggregation == "token-mean",
    }


def correction_values(preset: RunPreset) -> dict[str, Any]:
    """What Miles must resolve the rollout correction's flags to (train_args.correction_args, routing_replay_args:
    replay pauses in place), and the custom TIS function it must be able to import (the probe imports it with
    Miles' own load_function)."""
    from engines.miles.train_args import ICEPOP_FUNCTION, R3_PAUSE_MODE, preset_correction

    c = preset_correction(preset)
    weighted = c.mode in ("tis", "icepop")
    low, high = c.clip_bounds if weighted else (0.0, 2.0)
    return {"use_tis": weighted, "tis_clip": high, "tis_clip_low": low,
            "custom_tis_function_path": ICEPOP_FUNCTION if c.mode == "icepop" else None,
            "use_opsm": c.opsm, "opsm_delta": c.opsm_delta if c.opsm else 1e-4,
            "use_rollout_routing_replay": c.routing_replay,
            **({"pause_generation_mode": R3_PAUSE_MODE} if c.routing_replay else {})}


def compare_resolved(expected: dict[str, Any], resolved: dict[str, Any]) -> list[str]:
    """One line per value Miles resolved differently from v4rl's meaning."""
    out = []
    for key, want in expected.items():
        got = resolved.get(key)
        if key == "eval_datasets":
            got = [(d.get("name"), d.get("path"), d.get("n_samples_per_eval_prompt"), d.get("max_response_len"),
                    d.get("top_p")) for d in (got or [])]
            want = [tuple(w) for w in want]
        if not _same(want, got):
            out.append(f"{key}: v4rl meant {want!r}, Miles resolved {got!r}")
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return abs(float(a) - float(b)) <= 1e-12 * max(1.0, abs(float(a)))
    return a == b


def local_problems(preset: RunPreset, job: MilesJob, *, check_data: bool) -> list[str]:
    """Inputs of the job that exist (or not) on this machine: dataset files when `check_data`."""
    if not check_data:
        return []
    files = [("prompt_data (--prompt-data)", data_path(job, preset.data.prompt_data))]
    if preset.eval.enabled:
        files += [(f"eval dataset {name!r} (--eval-prompt-data)", data_path(job, path))
                  for name, path in preset.eval.datasets]
    return [f"{what}: {path} does not exist; fix the path (train_data / eval_data / data_dir) so the cluster "
            "nodes can read it" for what, path in files if not Path(path).is_file()]


@dataclass(frozen=True)
class CheckRequest:
    """One built Miles job to check: its command and what it was built from (what Miles must resolve it to)."""

    command: MilesCommand
    preset: RunPreset
    job: MilesJob
    cluster: ClusterSpec
    profile: HardwareProfile


def check_requests(requests: Sequence[CheckRequest], *, miles_dir: str | Path | None = None,
                   megatron_dir: str | Path | None = None, check_data: bool = False,
                   timeout: float = 900.0) -> list[MilesCheck]:
    """Run Miles' parse_args on each request's command and compare (see the module docstring); one MilesCheck per
    request, in order. The requests of one Miles generation, accelerator and runtime env share one probe process
    (Miles + Megatron imported once, ~20 s, then a few seconds per argv), each argv parsed afresh and answered
    on its own; a probe process that dies mid-way answers the argv it was on with its error, and the argvs after
    it go to a fresh process. `timeout` bounds each probe process.

    Raises engines.upstream.sources.EngineSourceMissing when Miles, Megatron-LM or SGLang cannot be found.
    """
    from engines.miles.pins import MILES_GENERATIONS
    from engines.upstream.sources import megatron_tree, miles_tree, sglang_paths
    from engines.miles.generation import detect_generation

    checks: list[MilesCheck | None] = [None] * len(requests)
    trees: dict[int, tuple[Path, Path, Any]] = {}
    groups: dict[tuple[int, str, str], list[int]] = {}
    for i, r in enumerate(requests):
        wanted = r.preset.miles.generation
        if wanted not in trees:
            pins = MILES_GENERATIONS.get(wanted, MILES_GENERATIONS[1])  # the pinned trees of its generation
            miles = miles_tree(miles_dir, pins[0])
            trees[wanted] = (miles, megatron_tree(megatron_dir, pins[1]), detect_generation(miles))
        miles, megatron, generation = trees[wanted]
        if generation.generation != wanted:  # the argv cannot fit: say so before a 40 s parse
            mismatch = (f"the job is built for Miles' DeepSeek-V4 generation {wanted}, but {miles} is "
                        f"{generation.label} ({generation.evidence}); set miles_generation {generation.generation} "
                        "(`v4rl plan --miles-dir` and the flow's miles_check_dir detect it), and convert with the "
                        "same --miles-dir")
            checks[i] = MilesCheck(accepted=False, rejected=[], error=mismatch, miles_dir=str(miles),
                                   megatron_dir=str(megatron), generation=generation.generation)
            continue
        env = {k: v for k, v in r.command.env.items() if k != "PYTHONPATH"}  # the cluster's paths mean nothing here
        key = (wanted, json.dumps(_device(r.profile), sort_keys=True), json.dumps(env, sort_keys=True))
        groups.setdefault(key, []).append(i)
    for (wanted, device, env), members in groups.items():
        miles, megatron, generation = trees[wanted]
        answers = _probe([requests[i] for i in members], [megatron, miles, *sglang_paths()], json.loads(device),
                         json.loads(env), timeout)
        for i, answer in zip(members, answers):
            r = requests[i]
            check = MilesCheck(accepted=answer["accepted"], rejected=answer["rejected"], error=answer["error"],
                               resolved=answer.get("resolved") or {}, stubbed=answer.get("stubbed", []),
                               miles_dir=str(miles), megatron_dir=str(megatron), stage=answer.get("stage", ""),
                               generation=generation.generation)
            if check.accepted:
                check.mismatches = compare_resolved(expected_values(r.preset, r.job, r.cluster, r.command),
                                                    check.resolved)
            check.problems = local_problems(r.preset, r.job, check_data=check_data)
            checks[i] = check
    return [c for c in checks if c is not None]


def check_commands(commands: Sequence[MilesCommand], preset: RunPreset, job: MilesJob, *, cluster: ClusterSpec,
                   profile: HardwareProfile, **options: Any) -> list[MilesCheck]:
    """check_requests on commands built for one preset and job (the jobs engines/miles/jobs.py derives from
    one training job); options: check_requests'."""
    return check_requests([CheckRequest(c, preset, job, cluster, profile) for c in commands], **options)


def check_command(command: MilesCommand, preset: RunPreset, job: MilesJob, *, cluster: ClusterSpec,
                  profile: HardwareProfile, **options: Any) -> MilesCheck:
    """check_requests on one command (options: check_requests')."""
    return check_requests([CheckRequest(command, preset, job, cluster, profile)], **options)[0]


def job_request(preset: RunPreset, job: MilesJob, *, site: Site | None = None,
                cluster: ClusterSpec | None = None) -> CheckRequest:
    """The job built exactly as it would be submitted, as a CheckRequest."""
    profile = get_profile(preset.profile)
    cluster = cluster or layout_input(preset, profile=profile).cluster
    command = build_command(preset, job, site=site, cluster=cluster, profile=profile)
    return CheckRequest(command, preset, job, cluster, profile)


def check_job(preset: RunPreset, job: MilesJob, *, site: Site | None = None, cluster: ClusterSpec | None = None,
              **options: Any) -> MilesCheck:
    """Build the job exactly as it would be submitted and check it (options: check_requests')."""
    return check_requests([job_request(preset, job, site=site, cluster=cluster)], **options)[0]


def _device(profile: HardwareProfile) -> dict[str, Any]:
    if profile.name not in DEVICES:
        raise ValueError(f"profile {profile.name!r} has no accelerator description for Miles' parser; known: "
                         f"{', '.join(DEVICES)} (add it to engines/upstream/miles_preflight.py DEVICES)")
    return DEVICES[profile.name]


def _probe(requests: Sequence[CheckRequest], paths: list[Path], device: dict[str, Any], env: dict[str, str],
           timeout: float) -> list[dict[str, Any]]:
    """The probe's answer for each request's argv, from as few processes as it takes (one unless one dies)."""
    from engines.upstream.sources import engine_python
    from engines.upstream.stubs import GPU_ONLY_ROOTS

    answers: list[dict[str, Any]] = []
    code = f"import runpy, sys; sys.argv[0] = {str(PROBE)!r}; runpy.run_path({str(PROBE)!r}, run_name='__main__')"
    with tempfile.TemporaryDirectory(prefix="v4rl-miles-preflight-") as tmp:
        argvs = [_local_hf_checkpoint(r.command.argv, r.preset, r.job, Path(tmp) / f"argv{i}")
                 for i, r in enumerate(requests)]
        while len(answers) < len(argvs):  # each round answers at least the argv it starts with
            request = Path(tmp) / f"request{len(answers)}.json"
            request.write_text(json.dumps({"argvs": argvs[len(answers):], "device": device, "build_config": True}))
            done = engine_python(code, paths, args=[str(request)], stub_roots=(*GPU_ONLY_ROOTS, *MILES_STUB_ROOTS),
                                 env=env, cwd=tmp, timeout=timeout, check=False)
            answers += _answers(done, len(argvs) - len(answers))
    return answers


def _local_hf_checkpoint(argv: list[str], preset: RunPreset, job: MilesJob, tmp: Path) -> list[str]:
    """Miles reads --hf-checkpoint's config.json while parsing; when the directory is not on this machine
    (a plan, or a cluster-only path) a temporary one holding the config the job was built from stands in."""
    if Path(job.hf_checkpoint).is_dir():
        return argv
    if preset.hf_config is None:
        raise ValueError(f"{job.hf_checkpoint} is not a directory here and preset {preset.name!r} has no "
                         "config.json; point hf_checkpoint at the FP8 HF checkpoint")
    stand_in = tmp / "hf-checkpoint"
    stand_in.mkdir(parents=True)
    (stand_in / "config.json").write_text(json.dumps(preset.hf_config()))
    i = argv.index("--hf-checkpoint")
    return [*argv[:i + 1], str(stand_in), *argv[i + 2:]]


def _answers(done, n: int) -> list[dict[str, Any]]:
    """The probe's answers to its `n` argvs in order, each error one line with Miles' own last words (that argv's
    stderr: argparse, asserts). A process that died on an argv answers it with its exit and leaves the rest for
    another process; one that died before its first argv answers all `n` so."""
    from engines.upstream.sources import engine_error
    from engines.upstream.probes.parse_args_probe import ITEM, MARKER

    out, err = done.stdout or "", done.stderr or ""
    logs = err.split(f"{ITEM} ")  # [startup, "0\n<argv 0's stderr>", "1\n...", ...]
    stderr = {int(part.split("\n", 1)[0]): logs[0] + part.split("\n", 1)[-1] for part in logs[1:]
              if part.split("\n", 1)[0].isdigit()}
    answers = []
    for chunk in out.split(MARKER)[1:]:
        answer = json.loads(chunk.strip().splitlines()[0])
        i = answer.pop("index")
        if not answer["accepted"] and not answer["rejected"]:
            answer["error"] = engine_error(stderr.get(i, err), answer.pop("log", ""), exception=answer.get("error"))
        answers.append(answer)
    if len(answers) < len(stderr) or not stderr:  # it died on argv len(answers), or before its first
        last = out.rsplit(MARKER, 1)[-1].split("\n", 2)[-1] if answers else out
        died = {"accepted": False, "rejected": [], "error": f"the Miles probe exited {done.returncode} without an "
                f"answer: {engine_error(stderr.get(len(answers), err), last)}"}
        answers += [dict(died) for _ in range(1 if stderr else n)]
    return answers
