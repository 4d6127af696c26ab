"""`v4rl serve-rollout`: the embedded SGLang-compatible rollout server (engines/rollout/server.py).

    v4rl serve-rollout --model runs/demo/base --port 30000             # 127.0.0.1 only
    V4RL_ROLLOUT_API_KEY=secret v4rl serve-rollout --model ckpt --port 0  # port 0: a free port, printed
"""

from __future__ import annotations

import os
from pathlib import Path

import typer

from rl.field_docs import field_default_and_doc

_ORIGINAL_LOGPROB = field_default_and_doc("engines.rollout.api", "EngineConfig", "return_original_logprob")


def register(app: typer.Typer) -> None:
    @app.command("serve-rollout")
    def serve_rollout(
        model: Path = typer.Option(..., help="HF DeepSeek-V4 checkpoint directory (FP8 + FP4 experts, as exported)."),
        port: int = typer.Option(30000, help="TCP port (0: pick a free one and print it)."),
        host: str = typer.Option("127.0.0.1", help="Interface to bind; anything but loopback wants --api-key."),
        api_key: str = typer.Option(None, envvar="V4RL_ROLLOUT_API_KEY",
                                    help="Require `Authorization: Bearer KEY` on every route but /health*, /ready "
                                         "and /metrics."),
        dtype: str = typer.Option("float32", help="Runtime dtype of the dequantized copies: float32 | bfloat16."),
        max_running_requests: int = typer.Option(1024, help="Requests decoded together at most."),
        weight_version: str = typer.Option("default", help="Initial weight_version reported in responses."),
        rocm_fnuz: bool = typer.Option(False, help="ROCm engine profile: FP8 runtime path through e4m3fnuz."),
        enable_memory_saver: bool = typer.Option(
            False, help="SGLang's --enable-memory-saver: /release_memory_occupation frees the runtime weight copies "
                        "(Miles' --offload-rollout expects it on)."),
        enable_return_routed_experts: bool = typer.Option(
            False, help="SGLang's --enable-return-routed-experts: requests with return_routed_experts get "
                        "meta_info.routed_experts (Miles' --use-rollout-routing-replay needs it on)."),
        return_original_logprob: bool = typer.Option(_ORIGINAL_LOGPROB[0], help=_ORIGINAL_LOGPROB[1]),
    ) -> None:
        """Serve SGLang's native HTTP API (/generate, pause/continue, weight updates) on the embedded engine."""
        # Before torch loads: libgomp's default spin-wait slows a loaded CPU box ~10x (engines/rollout/server.py).
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        from v4rl import inputs

        problem = inputs.hf_checkpoint("--model", model)
        if problem:
            typer.secho(f"error: {problem}", fg=typer.colors.RED, err=True)
            raise typer.Exit(code=1)
        from checkpoints.hf import CheckpointError
        from engines.rollout.engine import EngineConfig, RolloutEngine
        from engines.rollout.server import REFUSAL_PREFIX, serve

        try:
            config = EngineConfig(dtype=dtype, max_running_requests=max_running_requests,
                                  weight_version=weight_version, profile={"rocm_fnuz": rocm_fnuz},
                                  enable_return_routed_experts=enable_return_routed_experts,
                                  return_original_logprob=return_original_logprob)
            engine = RolloutEngine(model, config)
        except (CheckpointError, ValueError, OSError) as exc:
            typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
            raise typer.Exit(code=1)
        serve(model, host=host, port=port, api_key=api_key, engine=engine, enable_memory_saver=enable_memory_saver,
              on_ready=lambda url: typer.echo(f"serving {model} on {url} (SGLang native API)"),
              on_refusal=lambda line: typer.echo(f"{REFUSAL_PREFIX}{line}", err=True))
