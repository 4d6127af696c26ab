"""Real SGLang on GPU clusters: launch `python -m sglang.launch_server` on Ray nodes, and sync weights
from a trainer over NCCL/RCCL with `/init_weights_update_group` + `/update_weights_from_distributed`.

Launch: `SGLangServerSpec.from_preset(model_path, preset, profile)` takes the engine sizes from a run
preset and the environment from a hardware profile, `build_launch_command` turns it into the
command line, and `launch_sglang_servers` starts one Ray actor per engine (num_gpus = tp_size), each
running the server on its node and reporting its URL; the fleet is handed back only once every
server answers /health, and is stopped (process groups killed) on any failure. The environment sets
SGLANG_RETURN_ORIGINAL_LOGPROB=1 so real SGLang returns the RAW logprobs our embedded engine returns, and
SGLANG_OPT_FP8_WO_A_GEMM=0 while SGLang's default fp8 wo_a path cannot round-trip an online update
(`update_settings.py`; the profile's env may set it back).

Weight sync (SGLang 0.5.23's protocol, reference/miles-sglang-megatron.md §2.2, conformance.md B17): the
trainer is rank 0 of a dedicated process group (TCP store at master_address:master_port, prefixed by the
group name); engine i's TP ranks are 1 + sum(tp sizes before i) onward. A push is always one session, the
order Miles uses: /pause_generation (the caller's job: SGLang keeps generating during a session, and
tokens from half-updated weights would be trained on), /begin_weight_update (restores the canonical
layout), one /update_weights_from_distributed per bucket (SGLang refuses them outside a session) while
the tensors are broadcast from rank 0 in the same order, /end_weight_update (rebuilds the quantized
runtime state), /continue_generation. A failure closes the session and leaves generation paused. The
announced dtype is the tensor's own and its bytes travel untouched (float8 as a uint8 view, `wire_view`),
so FP8 E4M3 weights, packed FP4 (int8) and UE8M0 scales arrive as the same bits, never value-converted;
names are SGLang's (`sglang_named_tensors`). SGLang serves weight-sync routes only with `--dp-size 1`;
attention data parallelism inside an engine is `--attn-dp-size` (B18).

The launch and the sync need GPUs (tests marked `gpu`); the command line, the bucket metadata and
the process-group protocol (gloo) are tested on CPU.

    spec = SGLangServerSpec.from_preset("ckpt/hf-fp8", preset, profile)
    fleet = launch_sglang_servers(spec, num_engines=2)
    sync = DistributedWeightSync(fleet.clients, master_address=ip, master_port=29555, engine_world_sizes=[8, 8])
    sync.connect(); sync.push(sglang_named_tensors(state, cfg), weight_version="10")
"""

from __future__ import annotations

import inspect
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from checkpoints.names import native_to_sglang_name
from engines.rollout.sglang_pin import sglang_version
from engines.rollout.fused_pairs import update_buckets
from engines.rollout.sglang import SGLangClient, SGLangError
from engines.rollout.update_settings import wo_a_gemm_env


@dataclass(kw_only=True)
class SGLangServerSpec:
    """Everything one `sglang.launch_server` process needs (sizes from a preset, env/flags from a profile)."""

    model_path: str
    """HF FP8 checkpoint directory, readable on every rollout node."""
    tp_size: int = 8
    """GPUs per engine (one Ray actor reserves this many)."""
    ep_size: int = 1
    """--ep-size: expert parallelism inside the engine (must divide tp_size)."""
    attn_dp_size: int = 1
    """--attn-dp-size: data-parallel attention groups inside the TP group (the FFN stays tensor parallel); must
    divide tp_size. The run presets' `engine_dp` means this."""
    dp_size: int = 1
    """--dp-size: data-parallel REPLICAS of the whole model inside one server. SGLang's weight-sync routes
    assert dp_size == 1, so an RL rollout engine keeps 1 and scales out with more engines instead."""
    mem_fraction_static: float = 0.8
    max_running_requests: int | None = None
    max_total_tokens: int | None = None
    context_length: int | None = None
    weight_version: str = "default"
    api_key: str | None = None
    deterministic: bool = False
    """--enable-deterministic-inference (SGLang honours sampling_seed only then)."""
    sglang_version: str | None = field(default_factory=sglang_version)
    """The SGLang version the servers must report (/server_info `version`): pyproject's `cluster` pin, the one the
    conformance suite checks v4rl against. A fleet running another is refused; None skips the check."""
    o_lora_rank: int | None = None
    """The served model's o_lora_rank (config.json; `from_preset` fills it): decides SGLANG_OPT_FP8_WO_A_GEMM
    (update_settings.py). None: not known here, the setting is chosen as for a model the default path fails."""
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment (the profile's); wins over v4rl's SGLang settings."""
    python: str = sys.executable

    @classmethod
    def from_preset(cls, model_path: str, preset: Any, profile: Any = None, **overrides: Any) -> "SGLangServerSpec":
        """Sizes from a run preset's rollout section (`engines.miles.launch.RunPreset.rollout`: engine_tp, engine_ep,
        engine_dp (DP attention, so --attn-dp-size), max_running_requests, max_total_tokens, context_length,
        mem_fraction_static); environment
        and interpreter from a hardware profile (`engines.profiles.HardwareProfile`: comm_env, launcher_env,
        python). Keyword overrides win."""
        r = preset.rollout
        fields: dict[str, Any] = dict(
            model_path=str(model_path), tp_size=r.engine_tp, ep_size=r.engine_ep, attn_dp_size=r.engine_dp,
            max_running_requests=r.max_running_requests, max_total_tokens=r.max_total_tokens,
            context_length=r.context_length, mem_fraction_static=r.mem_fraction_static,
            o_lora_rank=_o_lora_rank(model_path, getattr(preset, "hf_config", None)))
        if profile is not None:
            fields["env"] = {**profile.comm_env, **profile.launcher_env}
            fields["python"] = profile.python
        fields.update(overrides)
        return cls(**fields)

    def __post_init__(self) -> None:
        sizes = {"tp_size": self.tp_size, "ep_size": self.ep_size, "attn_dp_size": self.attn_dp_size,
                 "dp_size": self.dp_size}
        bad = {k: v for k, v in sizes.items() if v < 1}
        if bad:
            raise ValueError(f"SGLang parallel sizes must be >= 1; got {bad}")
        for name in ("ep_size", "attn_dp_size"):
            if self.tp_size % sizes[name]:
                raise ValueError(f"{name}={sizes[name]} must divide tp_size={self.tp_size} (SGLang splits the TP "
                                 f"group into {name} groups); pick a divisor of {self.tp_size}")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must lie in (0, 1); got {self.mem_fraction_static}")


def build_launch_command(spec: SGLangServerSpec, *, host: str | None = None, port: int | None = None) -> list[str]:
    """The `python -m sglang.launch_server ...` argv for one engine (host/port left out when None: Miles
    starts its engines in-process and picks them itself)."""
    cmd = [spec.python, "-m", "sglang.launch_server", "--model-path", spec.model_path]
    if host is not None and port is not None:
        cmd += ["--host", host, "--port", str(port)]
    cmd += ["--tp-size", str(spec.tp_size), "--mem-fraction-static", str(spec.mem_fraction_static),
            "--trust-remote-code", "--weight-version", spec.weight_version]
    for flag, value in (("--ep-size", spec.ep_size if spec.ep_size > 1 else None),
                        ("--attn-dp-size", spec.attn_dp_size if spec.attn_dp_size > 1 else None),
                        ("--dp-size", spec.dp_size if spec.dp_size > 1 else None),
                        ("--max-running-requests", spec.max_running_requests),
                        ("--max-total-tokens", spec.max_total_tokens), ("--context-length", spec.context_length),
                        ("--api-key", spec.api_key)):
        if value is not None:
            cmd += [flag, str(value)]
    if spec.deterministic:
        cmd.append("--enable-deterministic-inference")
    return cmd + list(spec.extra_args)


def _o_lora_rank(model_path: str, preset_config: Any) -> int | None:
    """o_lora_rank of the served model: its config.json when readable here, else the preset's config."""
    path = Path(model_path) / "config.json"
    try:
        raw = json.loads(path.read_text()) if path.is_file() else (preset_config() if preset_config else {})
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read the model's config.json ({exc}); fix or replace the file") from exc
    rank = raw.get("o_lora_rank")
    return int(rank) if rank is not None else None


def launch_env(spec: SGLangServerSpec, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Process environment: the caller's, then the SGLang settings online updates need (update_settings.py),
    then the profile's, then RAW logprobs (as our engine returns)."""
    env = dict(os.environ if base is None else base)
    env.update(wo_a_gemm_env(spec.o_lora_rank))
    env.update(spec.env)
    env["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
    return env


# ---------------------------------------------------------------------------------------------- Ray
class SGLangServerProcess:
    """One SGLang server process on the node this (Ray actor) object lives on."""

    def __init__(self, spec: SGLangServerSpec) -> None:
        self.spec = spec
        self.proc: subprocess.Popen | None = None
        self.log_path = ""
        self.url = ""

    def start(self) -> str:
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        log = tempfile.NamedTemporaryFile(prefix="sglang-", suffix=".log", delete=False)
        self.log_path = log.name
        self.proc = subprocess.Popen(build_launch_command(self.spec, host=host, port=port), env=launch_env(self.spec),
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://{host}:{port}"
        return self.url

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def log_tail(self, lines: int = 80) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: the scheduler/detokenizer children too
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout)


@dataclass
class SGLangFleet:
    actors: list[Any]
    urls: list[str]
    clients: list[SGLangClient]

    def stop(self) -> None:
        import ray

        for c in self.clients:
            c.close()
        ray.get([a.stop.remote() for a in self.actors])


def launch_sglang_servers(spec: SGLangServerSpec, num_engines: int, *, ready_timeout: float = 1800.0) -> SGLangFleet:
    """Start `num_engines` servers on the Ray cluster (one actor each, tp_size GPUs); wait until all are healthy."""
    import ray

    actor_cls = ray.remote(num_gpus=spec.tp_size, num_cpus=1)(SGLangServerProcess)
    actors = [actor_cls.remote(spec) for _ in range(num_engines)]
    urls = ray.get([a.start.remote() for a in actors])
    clients = [SGLangClient(u, api_key=spec.api_key) for u in urls]
    fleet = SGLangFleet(actors, urls, clients)
    deadline = time.monotonic() + ready_timeout
    try:
        for actor, client in zip(actors, clients):
            while not client.health():
                code = ray.get(actor.returncode.remote())
                if code is not None or time.monotonic() > deadline:
                    tail = ray.get(actor.log_tail.remote())
                    why = f"exited with code {code}" if code is not None else f"not healthy after {ready_timeout}s"
                    raise SGLangError(f"SGLang server {client.base_url} {why}; command: "
                                      f"{shlex.join(build_launch_command(spec, host='<node>', port=0))}\n{tail}")
                time.sleep(2.0)
            check_sglang_version(client, spec.sglang_version)
    except BaseException:
        fleet.stop()
        raise
    return fleet


def check_sglang_version(client: SGLangClient, expected: str | None) -> None:
    """Refuse a server whose SGLang is not the pinned one: what v4rl sends was proven against that version only."""
    if expected is None:
        return
    running = client.server_info().get("version")
    if running != expected:
        raise SGLangError(f"{client.base_url} runs SGLang {running}, but v4rl is pinned to {expected} (pyproject.toml "
                          f"`cluster` extra): install sglang=={expected} on the rollout nodes, or bump the pin and "
                          "rerun the conformance suite (tests/conformance), which names what changed")


# ---------------------------------------------------------------------------------------------- weight sync
def init_weight_sync_group(*, backend: str, master_address: str, master_port: int, world_size: int, rank: int,
                           group_name: str, timeout_s: float = 600.0):
    """Join SGLang's weight-update process group (the rendezvous SGLang's server side runs for its ranks)."""
    from torch.distributed.distributed_c10d import (
        Backend, PrefixStore, _new_process_group_helper, _world, rendezvous)

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    options = "backend_options" if "backend_options" in inspect.signature(_new_process_group_helper).parameters \
        else "pg_options"
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, timeout=timeout, **{options: None})
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def bucket_metadata(bucket: Sequence[tuple[str, torch.Tensor]]) -> dict[str, list]:
    """`names`, `dtypes` (torch dtype names, e.g. "float8_e4m3fn"), `shapes` of one broadcast bucket."""
    return {"names": [n for n, _ in bucket], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket]}


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors in order into buckets of at most bucket_bytes (a larger unit gets a bucket alone), each of
    SGLang's fused pairs (compressor wkv+wgate, attention wq_a+wkv and their scales) inside one bucket:
    `fused_pairs.update_buckets`, the grouping every distributed push uses."""
    return update_buckets(named, bucket_bytes)


def wire_view(t: torch.Tensor) -> torch.Tensor:
    """What goes on the wire: float8 tensors (E4M3 weights, UE8M0 scales) as their bytes (a uint8 view;
    gloo and some NCCL builds have no float8 types), everything else as is. Never a value conversion."""
    t = t.contiguous()
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t


def receive_bucket(group: Any, metadata: Mapping[str, Sequence[Any]]) -> list[tuple[str, torch.Tensor]]:
    """Receiving side of one bucket (what a rank > 0 does after /update_weights_from_distributed):
    allocate each tensor from the announced dtype and shape, receive its bytes from rank 0."""
    import torch.distributed as dist

    out = []
    for name, dtype, shape in zip(metadata["names"], metadata["dtypes"], metadata["shapes"]):
        t = torch.empty(tuple(shape), dtype=getattr(torch, dtype))
        dist.broadcast(wire_view(t), src=0, group=group)
        out.append((name, t))
    return out


def sglang_named_tensors(encoded: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Native on-disk names (`X.weight`, `X.scale`, from checkpoints.hf.encode_tensor) -> SGLang's HF names
    (`model.layers...weight`, `...weight_scale_inv`; `...wo_a.scale`, see below), tensors untouched (same dtype,
    same bits)."""
    for name, t in encoded:
        if name.endswith(".scale"):
            weight = native_to_sglang_name(name[: -len(".scale")] + ".weight")
            # wo_a keeps the `.scale` spelling: with SGLANG_OPT_FP8_WO_A_GEMM=0 (what v4rl runs, update_settings.py)
            # SGLang's load_weights first dequantizes wo_a, pairing `.wo_a.weight` with `.wo_a.scale` only (a
            # `weight_scale_inv` would be dropped and the FP8 bytes loaded unscaled); its name remap turns a
            # self_attn `.scale` into `.weight_scale_inv` otherwise, so the default path takes the same name
            leaf = "scale" if weight.endswith(".wo_a.weight") else "weight_scale_inv"
            yield weight[: -len("weight")] + leaf, t
        else:
            yield native_to_sglang_name(name), t


class DistributedWeightSync:
    """Trainer side (rank 0) of NCCL/RCCL weight sync to one or more SGLang engines."""

    def __init__(self, clients: Sequence[SGLangClient], *, master_address: str, master_port: int,
                 engine_world_sizes: Sequence[int], group_name: str = "weight_update_group", backend: str = "nccl",
                 timeout_s: float = 600.0) -> None:
        if len(clients) != len(engine_world_sizes):
            raise ValueError(f"{len(clients)} clients but {len(engine_world_sizes)} engine world sizes")
        self.clients, self.sizes = list(clients), list(engine_world_sizes)
        self.master_address, self.master_port = master_address, master_port
        self.group_name, self.backend, self.timeout_s = group_name, backend, timeout_s
        self.group = None
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.clients)))

    @property
    def world_size(self) -> int:
        return 1 + sum(self.sizes)

    def connect(self) -> None:
        """Join every engine's weight-update group (each must run with --dp-size 1, SGLang's condition)."""
        for c in self.clients:
            dp = c.server_info().get("dp_size", 1)
            if dp != 1:
                raise SGLangError(f"{c.base_url} runs with dp_size={dp}; SGLang serves weight updates only with "
                                  "--dp-size 1 (use --attn-dp-size for DP attention, more engines for replicas)")
        offsets = [1 + sum(self.sizes[:i]) for i in range(len(self.sizes))]
        calls = [self._pool.submit(c.init_weights_update_group, master_address=self.master_address,
                                   master_port=self.master_port, rank_offset=o, world_size=self.world_size,
                                   group_name=self.group_name, backend=self.backend)
                 for c, o in zip(self.clients, offsets)]
        self.group = init_weight_sync_group(backend=self.backend, master_address=self.master_address,
                                            master_port=self.master_port, world_size=self.world_size, rank=0,
                                            group_name=self.group_name, timeout_s=self.timeout_s)
        for f in calls:
            f.result()

    def push(self, named: Iterable[tuple[str, torch.Tensor]], *, weight_version: str | None = None,
             bucket_bytes: int = 1 << 30, pause_mode: str = "retract") -> int:
        """Broadcast all tensors bucket by bucket in one weight-update session with generation paused (see the
        module docstring); returns the number of buckets. `pause_mode` retract (Miles' default) recomputes the
        paused requests' KV under the new weights and lets the last bucket flush the cache; in_place keeps
        their KV, so no bucket asks for a flush (SGLang would refuse it with requests in place)."""
        if self.group is None:
            raise RuntimeError("call connect() before push()")
        if pause_mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause_mode must be abort, retract or in_place; got {pause_mode!r}")
        batches = list(buckets(named, bucket_bytes))
        self._everywhere("pause_generation", pause_mode)
        self._everywhere("begin_weight_update")
        try:
            for k, bucket in enumerate(batches):
                last = k == len(batches) - 1
                self._send_bucket(bucket, flush_cache=last and pause_mode != "in_place",
                                  weight_version=weight_version if last else None)
        except BaseException as exc:
            self._everywhere("end_weight_update")  # leave no session open; generation stays paused
            raise SGLangError(f"weight push failed ({exc}); the engines hold partly updated weights and stay "
                              "paused: push again, or restart them from a checkpoint") from exc
        self._everywhere("end_weight_update")
        self._everywhere("continue_generation")
        return len(batches)

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], *, flush_cache: bool,
                     weight_version: str | None) -> None:
        """Announce one bucket to every engine and broadcast its tensors (rank 0), in the announced order."""
        import torch.distributed as dist

        calls = [self._pool.submit(c.update_weights_from_distributed, **bucket_metadata(bucket),
                                   group_name=self.group_name, flush_cache=flush_cache,
                                   weight_version=weight_version) for c in self.clients]
        for _, t in bucket:
            dist.broadcast(wire_view(t), src=0, group=self.group)
        for f in calls:
            f.result()

    def close(self) -> None:
        import torch.distributed as dist

        if self.group is not None:
            self._everywhere("destroy_weights_update_group", self.group_name)
            dist.destroy_process_group(self.group)
            self.group = None
        self._pool.shutdown()

    def _everywhere(self, method: str, *args: Any) -> None:
        for f in [self._pool.submit(getattr(c, method), *args) for c in self.clients]:
            f.result()
