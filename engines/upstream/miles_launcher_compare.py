"""v4rl's Miles job against Miles' own launcher, flag by flag and variable by variable.

`scripts/amd/run_deepseek_v4.py train` at the pinned Miles is recorded (nothing executed:
probes/record_launcher.py) for a layout it has a preset for, v4rl builds its job for the same layout with the
launcher's path conventions, and every train.py flag, every runtime-env variable and the submit's address are
compared. What may differ is the committed allow-list below: each entry names the v4rl setting (or the
conformance finding) that makes the difference intentional. Anything else is a DIFF. The recorded Miles' DeepSeek-V4
generation (engines/miles/generation.py) decides which job v4rl builds and which allow-list applies.

    rows = compare_with_launcher(MILES_1NODE_RUN, miles_dir="/path/to/miles")
    v4rl plan --preset dsv4-flash-mi355x-1node --compare-launcher [--miles-dir DIR]     # the table; exit 2 on a DIFF
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.layout import ClusterSpec
from engines.profiles import get_profile
from engines.presets.runs import layout_input
from engines.presets.spec import RunPreset
from engines.profiles.site import Site
from engines.miles.command import MilesCommand, MilesJob, build_command, parse_flags

PROBE = Path(__file__).with_name("probes") / "record_launcher.py"
LAUNCHER = "scripts/amd/run_deepseek_v4.py"
MODEL_NAME = "DeepSeek-V4-Flash-FP8"
"""The launcher's --model-name default; its torch_dist directory is `<model_dir>/<MODEL_NAME>_torch_dist`."""

# What v4rl's job may do differently from Miles' launcher, and why (kind, key) -> reason. Keep each reason a
# pointer to the setting or finding that decides it; a difference not listed here fails the comparison.
ALLOWED: dict[tuple[str, str], str] = {
    # named settings (engines/presets/spec.py; docs/cluster.md "v4rl settings vs Miles' launcher")
    ("argv", "--transformer-impl"): "MilesSettings.fp8_training=False: BF16 actor as in the seed (launcher: FP8)",
    ("argv", "--fp8-format"): "MilesSettings.fp8_training=False",
    ("argv", "--fp8-recipe"): "MilesSettings.fp8_training=False",
    ("argv", "--train-env-vars"): "MilesSettings.fp8_training=False (NVTE_FP8_BLOCK_SCALING_FP32_SCALES)",
    ("argv", "--no-gradient-accumulation-fusion"): "MilesSettings.fp8_training=False (ROCm TE FP8 workaround)",
    ("argv", "--use-rollout-routing-replay"): "MilesSettings.rollout_routing_replay=False, as the seed ran",
    ("argv", "--use-fault-tolerance"): "MilesSettings.fault_tolerance=False: v4rl's task retries resume instead",
    ("argv", "--use-tis"): "AlgorithmSpec.use_tis=True: the seed's TIS (the launcher only with --enable-mis)",
    ("argv", "--log-passrate"): "EvalSpec: pass@k per eval dataset, which the run directory, report and nightly "
                                "verdict read (the launcher logs the mean eval reward only)",
    # v4rl passes what its planner checked; the launcher leaves SGLang's defaults
    ("argv", "--sglang-max-running-requests"): "RolloutSpec.max_running_requests: the planner sized memory with it",
    ("argv", "--sglang-max-total-tokens"): "RolloutSpec.max_total_tokens: the planner sized the KV pool with it",
    ("argv", "--sglang-context-length"): "RolloutSpec.context_length: the planner checked prompt + response fits",
    # the seed's RCCL and flight-recorder settings (engines/profiles/mi355x.py), delivered to every rank
    **{("env", key): "HardwareProfile.comm_env / launcher_env: the seed's RCCL and flight-recorder settings"
       for key in ("NCCL_IB_GID_INDEX", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_TRACE_BUFFER_SIZE",
                   "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DESYNC_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                   "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "GPU_MAX_HW_QUEUES", "NCCL_P2P_NET_CHUNKSIZE")},
    # conformance C8/C9: SGLang's default fp8 wo_a path does not survive an online update (the reshaped scale is
    # never restored) and needs o_lora_rank % 128 == 0; Miles' CUDA launcher sets 0 too, its AMD one leaves it
    ("env", "SGLANG_OPT_FP8_WO_A_GEMM"): "engines/rollout/update_settings.py: 0 so online updates reproduce a "
                                         "fresh load (conformance C9)",
    # docs/conformance.md "Megatron conformance": Miles' logprob softmax runs over Megatron's padded vocab (zero-filled rows)
    ("argv", "--make-vocab-size-divisible-by"): "train_args.vocab_args: a divisor at which Megatron pads no vocab "
                                               "row at this TP (129,280 at TP 4: 64)",
    # conformance A10: the launcher forwards only NCCL/GLOO_SOCKET_IFNAME; v4rl gives every rank the site network
    ("env", "TP_SOCKET_IFNAME"): "Site.network_env: in the runtime env for every rank (conformance A10)",
    ("env", "NCCL_IB_HCA"): "Site.network_env: in the runtime env for every rank (conformance A10)",
    # conformance A15: the launcher submits to the inherited RAY_ADDRESS; v4rl names the Site's explicitly
    ("submit", "--address"): "Site.ray_address passed explicitly (conformance A15)",
}
_GEN2_LAYOUT = ("Miles' DeepSeek-V4 generation 2: Megatron-LM 6184c094a's config build refuses hash MoE layers with "
                "PP > 1 unless --pipeline-model-parallel-layout is set (conformance C7); v4rl writes the same stage "
                "sizes as a layout, the launcher's --decoder-first/last-pipeline-num-layers fail there")
ALLOWED_GEN2: dict[tuple[str, str], str] = {
    **ALLOWED,
    ("argv", "--dsv4-impl"): "MilesSettings.dsv4_impl: v4rl names the implementation it checked (the launcher "
                             "leaves Miles' default, miles)",
    ("argv", "--pipeline-model-parallel-layout"): _GEN2_LAYOUT,
    ("argv", "--decoder-first-pipeline-num-layers"): _GEN2_LAYOUT,
    ("argv", "--decoder-last-pipeline-num-layers"): _GEN2_LAYOUT,
}
"""The allow-list against a generation-2 Miles (e9e19b223 ships the same AMD launcher as 31f1ca961; its model
script no longer passes --experimental-attention-variant, and neither does v4rl's generation-2 job)."""


@dataclass(frozen=True)
class Row:
    """One compared key: a train.py flag, a runtime-env variable or a submit option."""

    kind: str
    key: str
    launcher: str | None
    v4rl: str | None
    status: str
    """same | allowed | DIFF"""
    reason: str = ""


@dataclass
class Comparison:
    preset: str
    rows: list[Row]
    launcher_error: str = ""
    launcher_argv: tuple[str, ...] = ()
    launcher_commands: tuple[str, ...] = ()
    """What else the launcher runs on its node before submitting (v4rl never does: conformance A16)."""
    generation: int = 1
    """The Miles DeepSeek-V4 generation of the recorded tree (v4rl's job is built for it)."""

    @property
    def diffs(self) -> list[Row]:
        return [r for r in self.rows if r.status == "DIFF"]

    @property
    def ok(self) -> bool:
        return not self.launcher_error and not self.diffs

    def to_json(self) -> dict[str, Any]:
        return {"preset": self.preset, "ok": self.ok, "generation": self.generation,
                "launcher_error": self.launcher_error,
                "launcher_argv": list(self.launcher_argv), "launcher_commands": list(self.launcher_commands),
                "rows": [r.__dict__ for r in self.rows]}


def record_launcher(miles_dir: Path, argv: list[str], env: dict[str, str], *, launcher: str = LAUNCHER,
                    run_id: str = "v4rl-compare", timeout: float = 600.0) -> dict[str, Any]:
    """Miles' launcher `argv` recorded in a subprocess (see probes/record_launcher.py for the answer's keys)."""
    from engines.upstream.sources import engine_error, engine_python, launcher_cli_paths

    with tempfile.TemporaryDirectory(prefix="v4rl-launcher-record-") as tmp:
        request = Path(tmp) / "request.json"
        request.write_text(json.dumps({"miles_dir": str(miles_dir), "launcher": launcher, "argv": argv, "env": env,
                                       "run_id": run_id, "sandbox": tmp}))
        code = f"import runpy, sys; sys.argv[0] = {str(PROBE)!r}; runpy.run_path({str(PROBE)!r}, run_name='__main__')"
        done = engine_python(code, [*launcher_cli_paths(), miles_dir], args=[str(request)], stub_roots=(),
                             cwd=tmp, timeout=timeout, check=False)
    from engines.upstream.probes.record_launcher import MARKER

    if MARKER not in (done.stdout or ""):
        raise RuntimeError(f"recording Miles' launcher {launcher} in {miles_dir} failed (exit {done.returncode}): "
                           f"{engine_error(done.stderr, done.stdout)}")
    return json.loads(done.stdout.split(MARKER, 1)[1].strip().splitlines()[0])


@dataclass(frozen=True)
class _Paths:
    """One set of paths both sides use, in the launcher's conventions."""

    hf_checkpoint: str = "/root/models/DeepSeek-V4-Flash-FP8"
    model_dir: str = "/root/models"
    save_dir: str = "/root/models"
    data_dir: str = "/root/datasets"
    megatron_path: str = "/root/Megatron-LM"
    run_id: str = "v4rl-compare"


def launcher_train_argv(preset: RunPreset, cluster: ClusterSpec, paths: _Paths = _Paths()) -> list[str]:
    """The launcher's `train` options for the preset's layout (the rest are the launcher's own choices)."""
    return ["train", "--mode", preset.mode, "--num-nodes", str(cluster.nodes),
            "--rollout-num-nodes", str(cluster.rollout_nodes), "--num-gpus-per-node", str(cluster.gpus_per_node),
            "--hf-checkpoint", paths.hf_checkpoint, "--model-dir", paths.model_dir, "--save-dir", paths.save_dir,
            "--data-dir", paths.data_dir, "--megatron-path", paths.megatron_path, "--run-id", paths.run_id]


def v4rl_command(preset: RunPreset, miles_dir: Path, site: Site, cluster: ClusterSpec,
                 paths: _Paths = _Paths()) -> MilesCommand:
    """v4rl's job for the preset with the launcher's path conventions (so paths compare equal)."""
    job = MilesJob(run_id=paths.run_id, hf_checkpoint=paths.hf_checkpoint,
                   ref_load=f"{paths.model_dir}/{MODEL_NAME}_torch_dist",
                   save_dir=f"{paths.save_dir}/{paths.run_id}/checkpoints", miles_dir=str(miles_dir),
                   megatron_dir=paths.megatron_path, data_dir=paths.data_dir)
    return build_command(preset, job, site=site, cluster=cluster)


def compare_with_launcher(preset: RunPreset, *, miles_dir: str | Path | None = None,
                          site: Site | None = None) -> Comparison:
    """Record Miles' launcher for the preset's layout and compare it with v4rl's job (see the module docstring)."""
    import dataclasses

    from engines.miles.pins import MILES_GENERATIONS
    from engines.upstream.sources import miles_tree
    from engines.miles.generation import detect_generation

    tree = miles_tree(miles_dir, MILES_GENERATIONS.get(preset.miles.generation, MILES_GENERATIONS[1])[0])
    generation = detect_generation(tree).generation  # v4rl's job for the Miles whose launcher is recorded
    if generation != preset.miles.generation:
        preset = dataclasses.replace(preset, miles=dataclasses.replace(preset.miles, generation=generation))
    site = site or Site(ray_address="http://10.0.0.1:8265", master_addr="10.0.0.1", socket_ifname="ens50f0",
                        ib_hca="rdma0,rdma1")
    cluster = layout_input(preset, profile=get_profile(preset.profile)).cluster
    argv = launcher_train_argv(preset, cluster)
    env = {"MILES_SCRIPT_EXTERNAL_RAY": "1", "RAY_ADDRESS": site.resolved_ray_address or "",
           "MASTER_ADDR": site.resolved_master_addr or "", "NCCL_SOCKET_IFNAME": site.socket_ifname or "",
           "GLOO_SOCKET_IFNAME": site.gloo_socket_ifname or site.socket_ifname or ""}
    recorded = record_launcher(tree, argv, {k: v for k, v in env.items() if v})
    if recorded["exit_code"] != 0 or not recorded["submit"]:
        return Comparison(preset.name, [], launcher_error=recorded["error"] or "the launcher submitted nothing",
                          launcher_argv=tuple(argv))
    ours = v4rl_command(preset, tree, site, cluster)
    others = tuple(c for c in recorded["commands"] if "ray job submit" not in c)
    allowed = ALLOWED_GEN2 if generation == 2 else ALLOWED
    return Comparison(preset.name, compare(recorded["submit"], ours, site, allowed), launcher_argv=tuple(argv),
                      launcher_commands=others, generation=generation)


def compare(submit: dict[str, Any], ours: MilesCommand, site: Site,
            allowed: dict[tuple[str, str], str] = ALLOWED) -> list[Row]:
    """Rows for every flag, variable and submit option either side has."""
    rows = [_row("submit", "script", submit["script"], ours.script, allowed),
            _row("submit", "--address", submit["address"], site.resolved_ray_address, allowed)]
    theirs, mine = parse_flags(submit["argv"]), ours.flag_values()
    for flag in dict.fromkeys([*theirs, *mine]):
        rows.append(_row("argv", flag, _show(theirs.get(flag)), _show(mine.get(flag)), allowed))
    for key in dict.fromkeys([*submit["env"], *ours.env]):
        rows.append(_row("env", key, submit["env"].get(key), ours.env.get(key), allowed))
    return rows


def _show(values: list[str] | None) -> str | None:
    return None if values is None else " ".join(values)


def _row(kind: str, key: str, launcher: str | None, v4rl: str | None,
         allowed: dict[tuple[str, str], str] = ALLOWED) -> Row:
    if _equal(launcher, v4rl):
        return Row(kind, key, launcher, v4rl, "same")
    reason = allowed.get((kind, key))
    return Row(kind, key, launcher, v4rl, "allowed" if reason else "DIFF", reason or "")


def _equal(a: str | None, b: str | None) -> bool:
    """Equal as argparse would see them: token by token, numbers by value (`0.00` == `0`)."""
    if a is None or b is None:
        return a is b
    ta, tb = a.split(" "), b.split(" ")
    return len(ta) == len(tb) and all(x == y or _num_equal(x, y) for x, y in zip(ta, tb))


def _num_equal(x: str, y: str) -> bool:
    try:
        return float(x) == float(y)
    except ValueError:
        return False
