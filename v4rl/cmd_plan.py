"""`v4rl plan`: check a parallel layout before a cluster is spent; show its memory, traffic, launch plan and
the Miles job; with `--miles-dir`, run Miles' own argument parser on that job (CPU, ~40 s).

    v4rl plan --preset dsv4-flash-mi355x                      # the seed's layout: tables, exit 0
    v4rl plan --preset dsv4-flash-mi355x --pp 4 --json        # 43 layers on 4 stages without --pp-last: exit 2
    v4rl plan --preset dsv4-flash-mi355x --rank 5             # the 5 feasible layouts with least communication
    v4rl plan --preset dsv4-flash-mi355x --launch --head-ip 10.0.0.1 --ifname ens50f0 --ib-hca rdma0,rdma1
    v4rl plan --preset dsv4-flash-mi355x --miles-dir ~/miles --megatron-dir ~/Megatron-LM [--json]
                                      # the job for that Miles' DeepSeek-V4 generation (read from its code)
    v4rl plan --preset dsv4-flash-mi355x-1node --compare-launcher [--miles-dir DIR]   # vs Miles' own launcher
    v4rl plan --preset dsv4-flash-mi355x --seed-command       # the seed's launcher command (Miles PR-head only)
    v4rl plan --preset dsv4-flash-mi355x --storage-gb-per-s 2 --no-save-optim   # storage cost of a job start, a save

Exit codes: 0 feasible (and, when asked, Miles accepts the job / the launcher comparison has no DIFF), 2
infeasible or rejected (the flags and values named), 1 bad input. Without `--miles-dir`/`--compare-launcher`
nothing but the planner runs (well under a second). Library: engines.miles.launch, engines.miles.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import typer

from engines.presets.runs import RUN_PRESETS

FEASIBLE, INFEASIBLE, BAD_INPUT = 0, 2, 1


def register(app: typer.Typer) -> None:
    """Add the `plan` command to the v4rl app."""
    app.command(name="plan")(plan)


def plan(
    preset: str = typer.Option("dsv4-flash-mi355x", help="Run preset: " + " | ".join(RUN_PRESETS) + "."),
    profile: Optional[str] = typer.Option(None, help="Hardware profile override: mi355x | h200 | cpu."),
    model_config: Optional[str] = typer.Option(None, help="Plan this HF config.json instead of the preset's model."),
    tp: Optional[int] = typer.Option(None, help="--tensor-model-parallel-size."),
    pp: Optional[int] = typer.Option(None, help="--pipeline-model-parallel-size (clears the preset's stage sizes)."),
    ep: Optional[int] = typer.Option(None, help="--expert-model-parallel-size."),
    etp: Optional[int] = typer.Option(None, help="--expert-tensor-parallel-size."),
    cp: Optional[int] = typer.Option(None, help="--context-parallel-size."),
    pp_first: Optional[int] = typer.Option(None, help="--decoder-first-pipeline-num-layers."),
    pp_last: Optional[int] = typer.Option(None, help="--decoder-last-pipeline-num-layers."),
    nodes: Optional[int] = typer.Option(None, help="Nodes in the cluster (--num-nodes)."),
    rollout_nodes: Optional[int] = typer.Option(None, help="Rollout nodes (0 = colocated); the actor gets the rest."),
    gpus_per_node: Optional[int] = typer.Option(None, help="Accelerators per node."),
    hbm_gb: Optional[float] = typer.Option(None, help="Device memory per accelerator, GB."),
    host_memory_gb: Optional[float] = typer.Option(None, help="Host RAM per node, GB (optimizer offload)."),
    max_tokens_per_gpu: Optional[int] = typer.Option(None, help="--max-tokens-per-gpu."),
    recompute: Optional[str] = typer.Option(None, help="full | selective | none."),
    optimizer_offload: Optional[float] = typer.Option(None, help="Fraction of Adam state in host RAM (0..1)."),
    sglang_tp: Optional[int] = typer.Option(None, help="GPUs (TP) per SGLang engine."),
    sglang_ep: Optional[int] = typer.Option(None, help="SGLang EP."),
    sglang_dp: Optional[int] = typer.Option(None, help="SGLang DP attention."),
    max_running_requests: Optional[int] = typer.Option(None, help="--sglang-max-running-requests."),
    max_total_tokens: Optional[int] = typer.Option(None, help="--sglang-max-total-tokens."),
    context_length: Optional[int] = typer.Option(None, help="--context-length."),
    mem_fraction_static: Optional[float] = typer.Option(None, help="--sglang-mem-fraction-static."),
    json_out: bool = typer.Option(False, "--json", help="Print the plan as one JSON object."),
    launch: bool = typer.Option(False, "--launch", help="Print the launch plan (processes per node) as JSON."),
    rank: int = typer.Option(0, help="Also rank this many feasible alternative layouts by communication."),
    head_ip: Optional[str] = typer.Option(None, help="Launch plan: $HEAD_IP."),
    worker_ip: list[str] = typer.Option([], help="Launch plan: worker IPs in order (repeat)."),
    ifname: Optional[str] = typer.Option(None, help="Launch plan: NCCL/GLOO/TP_SOCKET_IFNAME."),
    ib_hca: Optional[str] = typer.Option(None, help="Launch plan: NCCL_IB_HCA."),
    hf_checkpoint: Optional[str] = typer.Option(None, help="Launch plan: FP8 HF dir (--hf-checkpoint)."),
    ref_load: Optional[str] = typer.Option(None, help="Launch plan: our torch_dist dir (--ref-load)."),
    save_dir: Optional[str] = typer.Option(None, help="Launch plan: Miles --save/--load dir."),
    ray_address: Optional[str] = typer.Option(None, help="RAY_ADDRESS of the existing cluster (default http://HEAD:8265)."),
    master_addr: Optional[str] = typer.Option(None, help="MASTER_ADDR (default: --head-ip)."),
    data_dir: Optional[str] = typer.Option(None, help="Datasets directory on the cluster (checked when given)."),
    train_data: Optional[str] = typer.Option(None, help="--prompt-data file (checked when given)."),
    eval_data: list[str] = typer.Option([], help="NAME=PATH eval dataset for --eval-prompt-data (repeat; checked)."),
    miles_dir: Optional[str] = typer.Option(None, help="Run Miles' own parse_args on the job from this checkout "
                                            "(or $V4RL_MILES_DIR / the pinned tarball with --check-miles)."),
    megatron_dir: Optional[str] = typer.Option(None, help="Megatron-LM checkout for --miles-dir "
                                               "(default $V4RL_MEGATRON_DIR or the pinned tarball)."),
    check_miles: bool = typer.Option(False, "--check-miles", help="Run the Miles check with the default sources."),
    miles_generation: Optional[int] = typer.Option(None, help="Miles' DeepSeek-V4 generation the job is for: 1 "
                                                   "(31f1ca961) | 2 (e9e19b223+). Default: read from --miles-dir's "
                                                   "(else $V4RL_MILES_DIR's) code, else 1."),
    dsv4_impl: Optional[str] = typer.Option(None, help="Generation 2: --dsv4-impl miles | megatron (TP 1)."),
    compare_launcher: bool = typer.Option(False, "--compare-launcher",
                                          help="Compare the job with Miles' own launcher, flag by flag."),
    seed_command: bool = typer.Option(False, "--seed-command",
                                      help="Print the seed's launcher command (parses on Miles PR-head a8684732f)."),
    storage_gb_per_s: float = typer.Option(5.0, "--storage-gb-per-s",
                                           help="Site storage bandwidth for the job start / save cost, GB/s "
                                                "(default 5: a parallel file system for one job)."),
    no_save_optim: bool = typer.Option(False, "--no-save-optim",
                                       help="Cost saves without the optimizer state (Miles' --no-save-optim)."),
    sglang_dir: Optional[str] = typer.Option(None, help="Build this SGLang's DeepSeek-V4 model on CPU (the directory "
                                             "holding `sglang/`): one update of --sglang-update kind must reproduce "
                                             "a fresh load in the job's setting (3-5 min)."),
    sglang_update: str = typer.Option("disk", help="Update kind for --sglang-dir: disk | distributed."),
) -> None:
    """Check a parallel layout (Megatron + SGLang rules, per-GPU memory, traffic); exit 0 feasible, 2 not."""
    from engines.miles.launch import preflight_plan, resolve
    from engines.layout import rank_layouts

    try:
        eval_pairs = _eval_pairs(eval_data)
    except ValueError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=BAD_INPUT)
    overrides = dict(tp=tp, pp=pp, ep=ep, etp=etp, cp=cp, pp_first=pp_first, pp_last=pp_last, nodes=nodes,
                     rollout_nodes=rollout_nodes, gpus_per_node=gpus_per_node, hbm_gb=hbm_gb,
                     host_memory_gb=host_memory_gb, max_tokens_per_gpu=max_tokens_per_gpu, recompute=recompute,
                     optimizer_offload=optimizer_offload, sglang_tp=sglang_tp, sglang_ep=sglang_ep,
                     sglang_dp=sglang_dp, max_running_requests=max_running_requests,
                     max_total_tokens=max_total_tokens, context_length=context_length, profile=profile,
                     model_config=model_config, mem_fraction_static=mem_fraction_static,
                     prompt_data=train_data, eval_datasets=eval_pairs)
    paths = dict(hf_checkpoint=hf_checkpoint, ref_load=ref_load, save_dir=save_dir, data_dir=data_dir)
    site_args = dict(head_ip=head_ip, worker_ip=worker_ip, ifname=ifname, ib_hca=ib_hca, ray_address=ray_address,
                     master_addr=master_addr)
    try:
        from engines.presets.runs import preset_name

        preset = preset_name(preset)  # tiny_cpu and tiny-cpu alike, as everywhere else
        if recompute not in (None, "full", "selective", "none"):
            raise ValueError(f"--recompute must be full, selective or none (got {recompute!r})")
        from v4rl import plan_miles

        overrides.update(plan_miles.generation_overrides(miles_dir, miles_generation, dsv4_impl))
        result = preflight_plan(preset, overrides, raise_on_infeasible=False)
        alternatives = rank_layouts(resolve(preset, overrides)[1], rank) if rank > 0 else []
        from v4rl import plan_miles

        cluster = resolve(preset, overrides)[0].profile != "cpu"
        if launch and not cluster:
            raise ValueError(f"--launch: {preset} runs on this machine, with no launch plan: `v4rl train --preset "
                             f"{preset}` or `v4rl demo`; launch plans are for the cluster presets (e.g. "
                             "--preset dsv4-flash-mi355x)")
        site, job = plan_miles.site_and_job(preset, overrides, paths, **site_args) if cluster else (None, None)
        launch_obj = plan_miles.launch(preset, overrides, site, job) if launch and cluster else None
        miles_obj = plan_miles.job_json(preset, overrides, site, job) if cluster and (json_out or seed_command) \
            else None
        check = plan_miles.check(preset, overrides, site, job, miles_dir=miles_dir, megatron_dir=megatron_dir,
                                 check_data=bool(data_dir or train_data or eval_data)) \
            if cluster and (miles_dir or check_miles) else None
        comparison = plan_miles.compare(preset, overrides, site, miles_dir) if compare_launcher else None
        from v4rl import plan_cost

        costs = plan_cost.cost_json(preset, overrides, storage_gb_per_s=storage_gb_per_s,
                                    save_optim=not no_save_optim) if cluster else None
        sglang_check = _sglang_check(preset, overrides, sglang_dir, sglang_update) if sglang_dir else None
        from v4rl.verify_miles import plan_model_keys  # Miles' model vs the checkpoint (meta device, minutes)

        model_keys = plan_model_keys(preset, overrides, job, miles_dir=miles_dir, megatron_dir=megatron_dir) \
            if cluster and miles_dir else None
    except ValueError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=BAD_INPUT)
    except RuntimeError as exc:  # EngineSourceMissing and a failed engine subprocess: say what to set
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=BAD_INPUT)
    code = FEASIBLE if result.feasible else INFEASIBLE
    if (check is not None and not check.ok) or (comparison is not None and not comparison.ok) or \
            (model_keys is not None and not model_keys.ok):
        code = INFEASIBLE
    if sglang_check is not None and not sglang_check.ok:
        code = INFEASIBLE
    if json_out or launch:
        obj: dict[str, Any] = result.to_json() if json_out else {}
        if alternatives:
            obj["alternatives"] = [_summary(p) for p in alternatives]
        if miles_obj is not None:
            obj["miles"] = miles_obj
        if check is not None:
            obj["miles_check"] = check.to_json()
        if comparison is not None:
            obj["launcher_comparison"] = comparison.to_json()
        if costs is not None and json_out:
            obj["storage_cost"] = costs
        if sglang_check is not None:
            obj["sglang_model_check"] = sglang_check.to_json()
        if model_keys is not None:
            obj["miles_model_keys"] = model_keys.to_json()
        if launch_obj is not None:
            obj = {**obj, "launch": launch_obj} if json_out else launch_obj
        typer.echo(json.dumps(obj, indent=1))
    elif not result.feasible:  # the memory, the job and its costs of a layout that cannot run would only mislead
        _print_infeasible(preset, result, alternatives, rank)
    else:
        _print_tables(preset, result, alternatives)
        if cluster:
            typer.echo(plan_miles.pin_line(resolve(preset, overrides)[0].miles.generation))
        if costs is not None:
            typer.echo("\n".join(plan_cost.cost_lines(costs)))
        if seed_command and miles_obj is not None:
            typer.echo(plan_miles.seed_command_text(miles_obj))
        if check is not None:
            plan_miles.print_check(check)
        if comparison is not None:
            plan_miles.print_comparison(comparison)
        if sglang_check is not None:
            from v4rl import plan_sglang

            plan_sglang.print_check(sglang_check)
        if model_keys is not None:
            typer.echo(model_keys.summary())
    raise typer.Exit(code=code)


def _sglang_check(preset: str, overrides: dict, sglang_dir: str, update: str):
    """The user's SGLang model on a tiny model of the run's format (v4rl/plan_sglang.py)."""
    from v4rl import plan_sglang

    if update not in ("disk", "distributed"):
        raise ValueError(f"--sglang-update must be disk or distributed (got {update!r})")
    return plan_sglang.check(preset, overrides, sglang_dir, update_kind=update)  # type: ignore[arg-type]


def _eval_pairs(items: list[str]) -> list[tuple[str, str]] | None:
    pairs = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--eval-data {item!r}: give NAME=PATH (e.g. aime=/data/aime-2024.jsonl)")
        pairs.append((name, path))
    return pairs or None


def _summary(p) -> dict[str, Any]:
    j = p.to_json()
    return {"layout": j["layout"], "memory_gb_per_gpu": j["memory_gb_per_gpu"],
            "comm_seconds_per_step": j["communication"]["total_seconds"] if j["communication"] else None}


def _print_infeasible(preset: str, p, alternatives: list, rank: int) -> None:
    """Why the layout cannot run and the fix each check names (the feasible alternatives when --rank asked), each
    reason on one unwrapped line so its flags paste as they are."""
    from rich.console import Console
    from rich.markup import escape

    con = Console(width=max(Console().width, 120))
    lay = p.to_json()["layout"]
    con.print(escape(f"{preset}: layout TP{lay['tp']} PP{lay['pp']} EP{lay['ep']} ETP{lay['etp']} CP{lay['cp']} "
                     "cannot run:"), highlight=False)
    for reason in p.reasons:
        con.print(f"[red]rejected[/] {escape(reason)}", highlight=False, soft_wrap=True)
    if alternatives:
        _print_alternatives(con, alternatives)
    elif rank:
        con.print(f"--rank {rank}: found no feasible layout of this cluster; change the cluster as the "
                  "fixes above say", highlight=False, soft_wrap=True)
    else:
        con.print("other layouts of this cluster that are feasible: add --rank 5", highlight=False)
    con.print("[red]infeasible[/]")


def _print_alternatives(con, alternatives: list) -> None:
    from rich.markup import escape
    from rich.table import Table

    t = Table(title="feasible layouts, least communication first")
    for col in ("TP", "PP", "EP", "ETP", "CP", "stages", "actor GB", "rollout GB", "comm s/step"):
        t.add_column(col, justify="right")
    for alt in alternatives:
        s = _summary(alt)
        lo = s["layout"]
        t.add_row(*(str(lo[k]) for k in ("tp", "pp", "ep", "etp", "cp")), escape(str(lo["pipeline_layers"])),
                  f"{s['memory_gb_per_gpu']['actor']:,.0f}", f"{s['memory_gb_per_gpu']['rollout']:,.0f}",
                  f"{s['comm_seconds_per_step']:.2f}")
    con.print(t)


def _print_tables(preset: str, p, alternatives: list) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    con = Console(width=max(Console().width, 120))
    j, c = p.to_json(), p.input.cluster
    lay = j["layout"]
    con.print(f"[bold]{preset}[/]: {c.nodes} nodes x {c.gpus_per_node} ({c.actor_nodes} actor, "
              f"{'colocated' if c.colocated else f'{c.rollout_nodes} rollout'}), {c.hbm_gb:g} GB per GPU")
    con.print(escape(f"layout: TP{lay['tp']} PP{lay['pp']} EP{lay['ep']} ETP{lay['etp']} CP{lay['cp']} -> "
                     f"DP{lay['dp']} EDP{lay['edp']}, stages {lay['pipeline_layers']}"))
    if p.stages:
        t = Table(title="actor memory per GPU (GB, estimates)")
        for col in ("stage", "layers", "params", "grads", "optim", "optim@host", "activ", "logits", "reserve",
                    "total", "capacity"):
            t.add_column(col, justify="right")
        for s in p.stages:
            t.add_row(str(s.stage), str(s.layers), *(f"{v:,.1f}" for v in (
                s.params, s.grads, s.optimizer, s.optimizer_host, s.activations, s.logits, s.reserve, s.total,
                c.hbm_gb)))
        con.print(t)
    if p.rollout:
        r = p.rollout
        con.print(f"rollout per GPU: weights {r.weights:,.1f} + KV {r.kv_cache:,.2f} ({r.kv_bytes_per_token:,.0f} "
                  f"B/token) + request state {r.request_state:,.2f} + reserve {r.reserve:,.1f} = {r.total:,.1f} GB")
    if p.host_gb_per_node:
        con.print(f"host RAM per actor node: {p.host_gb_per_node:,.0f} of {c.host_memory_gb:,.0f} GB")
    if p.comm:
        parts = ", ".join(f"{k} {v:.2f}s" for k, v in p.comm.seconds.items() if v)
        con.print(escape(f"communication per step (est.): {p.comm.total_seconds:.2f}s [{parts or 'none'}]; "
                         f"{p.comm.micro_batches} micro-batches; cross-node: {', '.join(p.comm.cross_node) or 'none'}"))
    for w in p.warnings:
        con.print(f"[yellow]warning[/] {escape(w)}", highlight=False)
    for reason in p.reasons:
        con.print(f"[red]rejected[/] {escape(reason)}", highlight=False)
    if alternatives:
        _print_alternatives(con, alternatives)
    con.print("[green]feasible[/]")
