"""`v4rl convert | export | verify-ckpt`: checkpoint formats, thin wrappers over checkpoints/convert.py.

    v4rl convert ckpt/hf-fp8 ckpt/torch_dist --workers 8          # HF FP8/FP4 -> Megatron torch_dist BF16
    v4rl convert ckpt/hf-fp8 ckpt/torch_dist --miles-dir ~/miles   # ... under the names that Miles' model asks for
    v4rl export ckpt/torch_dist ckpt/hf-bf16 --format hf-bf16      # torch_dist (either Miles' names) -> HF BF16
    v4rl export ckpt/torch_dist ckpt/hf-fp8 --format hf-fp8 --like ckpt/hf-fp8-original
    v4rl verify-ckpt ckpt/torch_dist --against ckpt/hf-fp8         # megatron-core load + value check

Every command exits 1 with a message naming the file and tensor when the input is bad or a write fails;
nothing that looks complete is left behind.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from v4rl import inputs
from v4rl.errors import one_line_error


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=1)


def _check(*problems: str | None) -> None:
    """Fail with the first path problem (v4rl/inputs.py), before any checkpoint is read or anything written."""
    problem = inputs.first_problem(*problems)
    if problem:
        _fail(problem)


def _errors() -> tuple[type[BaseException], ...]:
    from checkpoints.convert import ConversionError
    from checkpoints.hf import CheckpointError
    from checkpoints.manifest import OutputError
    from checkpoints.torch_dist import TorchDistError

    return ConversionError, CheckpointError, OutputError, TorchDistError, OSError, ValueError


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def register(app: typer.Typer) -> None:
    @app.command()
    def convert(src: Path = typer.Argument(..., help="HF DeepSeek-V4 checkpoint directory (FP8/FP4 or BF16)."),
                dst: Path = typer.Argument(..., help="Megatron torch_dist directory to create."),
                workers: int = typer.Option(0, help="Worker processes (0: one per CPU core)."),
                force: bool = typer.Option(False, help="Replace dst if it holds something else."),
                verify: str = typer.Option("structure", help="structure | full (values vs source) | none."),
                progress: bool = typer.Option(True, help="Show a progress bar with bytes/s."),
                miles_dir: Path = typer.Option(None, envvar="V4RL_MILES_DIR",
                                               help="The Miles checkout that will load it: write the Megatron names "
                                                    "its DeepSeek-V4 model asks for (read from its code)."),
                megatron_names: str = typer.Option(None, help="Force the key names: plugin (Miles' first DeepSeek-V4 "
                                                              "generation) | megatron (Megatron's names, Miles "
                                                              "e9e19b223 and later). Default: from --miles-dir, "
                                                              "else plugin.")) -> None:
        """Convert HF FP8/FP4 -> Megatron torch_dist BF16: streamed, parallel, atomic; a no-op when up to date."""
        if verify not in ("structure", "full", "none"):
            _fail(f"--verify must be structure, full or none; got {verify!r}")
        _check(inputs.hf_checkpoint("SRC", src), inputs.output_dir("DST", dst))
        from checkpoints.convert import convert_hf_to_torch_dist
        from engines.miles.generation import megatron_names_for

        try:
            names, why = megatron_names_for(miles_dir, megatron_names)
            r = convert_hf_to_torch_dist(src, dst, workers=workers or None, force=force, verify=verify,  # type: ignore[arg-type]
                                         progress=progress, megatron_names=names)
        except _errors() as exc:
            _fail(one_line_error(exc))
        if r.skipped:
            typer.echo(f"{dst} is already a complete conversion of {src} ({names} names); nothing to do")
            return
        typer.echo(f"wrote {dst}: {r.tensors} tensors, {_gib(r.bytes_out)} in {r.seconds:.1f} s "
                   f"({r.bytes_per_second / 2**20:.0f} MiB/s, {r.workers} workers, {r.files} chunk files)")
        typer.echo(f"Megatron names: {names} ({why})")

    @app.command()
    def export(src: Path = typer.Argument(..., help="Megatron torch_dist checkpoint (root or iteration dir)."),
               dst: Path = typer.Argument(..., help="HF directory to create."),
               format: str = typer.Option(..., "--format", help="hf-bf16 | hf-fp8 (the rollout engine's format)."),
               like: Path = typer.Option(None, help="Original HF checkpoint: reuse its scales where exact, copy its "
                                                    "tokenizer; needed when common.pt lacks the model config."),
               expert_dtype: str = typer.Option(None, help="hf-fp8 routed experts: fp4 | fp8 (default: as source)."),
               scale_fmt: str = typer.Option(None, help="hf-fp8 scales: ue8m0 | fp32 (default: as source)."),
               workers: int = typer.Option(0, help="Worker processes (0: one per CPU core)."),
               force: bool = typer.Option(False, help="Replace dst if it holds something else."),
               progress: bool = typer.Option(True, help="Show a progress bar with bytes/s.")) -> None:
        """Export torch_dist -> HF native layout, BF16 or re-quantized FP8/FP4 (the weight-update format)."""
        if format not in ("hf-bf16", "hf-fp8"):
            _fail(f"--format must be hf-bf16 or hf-fp8; got {format!r}")
        _check(inputs.torch_dist_checkpoint("SRC", src), inputs.output_dir("DST", dst),
               inputs.hf_checkpoint("--like", like))
        from checkpoints.convert import export_torch_dist_to_hf

        try:
            r = export_torch_dist_to_hf(src, dst, fmt=format, like=like, expert_dtype=expert_dtype,  # type: ignore[arg-type]
                                        scale_fmt=scale_fmt, workers=workers or None, force=force, progress=progress)
        except _errors() as exc:
            _fail(one_line_error(exc))
        if r.skipped:
            typer.echo(f"{dst} is already a complete {format} export of {src}; nothing to do")
            return
        typer.echo(f"wrote {dst}: {r.tensors} tensors, {_gib(r.bytes_out)} in {r.seconds:.1f} s ({r.files} shards)")
        if r.tokenizer is not None:
            typer.echo(f"tokenizer: from {r.tokenizer}")
        else:  # the weights serve token ids; text prompts and stop strings need the tokenizer
            typer.secho(f"warning: no tokenizer found beside {src}, in the checkpoint it was converted from or in "
                        f"its run's base; {dst} serves token ids only: add the original HF checkpoint's as --like",
                        fg=typer.colors.YELLOW, err=True)

    @app.command("verify-ckpt")
    def verify_ckpt(ckpt: Path = typer.Argument(..., help="Megatron torch_dist checkpoint (root or iteration dir)."),
                    against: Path = typer.Option(None, help="HF checkpoint it was converted from: compare values."),
                    json_out: Path = typer.Option(None, "--json", help="Also write the report as JSON."),
                    progress: bool = typer.Option(True, help="Show a progress bar."),
                    miles_dir: Path = typer.Option(None, help="Also run Miles' OWN model from this checkout on it: "
                                                   "keys, load, and (with --against) a forward vs v4rl's model "
                                                   "(v4rl/verify_miles.py; CPU, minutes)."),
                    megatron_dir: Path = typer.Option(None, help="Megatron-LM checkout for --miles-dir "
                                                      "(default $V4RL_MEGATRON_DIR or the pinned tarball)."),
                    dsv4_impl: str = typer.Option(None, help="--dsv4-impl for a generation-2 Miles (miles|megatron).")
                    ) -> None:
        """Load with megatron-core (load_tensors_metadata + load) and check names, shapes, dtypes, finiteness, values."""
        _check(inputs.torch_dist_checkpoint("CKPT", ckpt), inputs.hf_checkpoint("--against", against),
               inputs.output_file("--json", json_out))
        from checkpoints.convert import verify_torch_dist

        try:
            r = verify_torch_dist(ckpt, against=against, progress=progress)
        except _errors() as exc:
            _fail(one_line_error(exc))
        report = {"ckpt": str(r.ckpt), "ok": True, "tensors": r.tensors, "bytes": r.bytes,
                  "compared_with_source": r.compared, "seconds": round(r.seconds, 3)}
        if json_out is not None:
            json_out.write_text(json.dumps(report, indent=1) + "\n")
        what = f", {r.compared} source tensors equal" if against is not None else ""
        typer.echo(f"ok: megatron-core loads {r.tensors} tensors ({_gib(r.bytes)}), all finite{what} "
                   f"[{r.seconds:.1f} s]")
        if miles_dir is not None:
            from v4rl import verify_miles

            try:
                miles = verify_miles.verify_with_miles(ckpt, miles_dir=miles_dir, megatron_dir=megatron_dir,
                                                       against=against, impl=dsv4_impl)
            except (*_errors(), RuntimeError) as exc:
                _fail(one_line_error(exc))
            if json_out is not None:
                json_out.write_text(json.dumps({**report, "miles": miles}, indent=1, default=str) + "\n")
            typer.echo(verify_miles.summary(miles))
            if not miles["ok"]:
                raise typer.Exit(code=2)
