"""Runs Miles' own `parse_args` on each of several argvs in one process and prints what each resolved, as one
JSON line per argv. Never imported by v4rl.

It is the body of the cluster preflight's subprocess (engines/upstream/miles_preflight.py): that process has
Megatron-LM first on sys.path, then Miles and SGLang 0.5.23's source, the GPU-only modules stubbed where their
import fails, and the jobs' runtime env as its environment (Megatron asserts on CUDA_DEVICE_MAX_CONNECTIONS and
NCCL_ALGO; argvs of one request share one env). The request is a JSON file: {"argvs": [[...], ...], "device":
{"capability": [9, 5], "name": ..., "total_memory": ...}, "build_config": bool}. With build_config the parsed
args then go through Megatron's own `core_transformer_config_from_args` (what Miles' model provider runs first
on every rank: TransformerConfig's checks of the pipeline layout, MLA and the DeepSeek-V4 contract).

Miles and Megatron are imported once (the ~20 s of a parse) and each argv is parsed afresh: a new sys.argv, and
what a parse may change outside its args put back before the next (os.environ, which Megatron's
--deterministic-mode fills, and torch's deterministic-algorithms switch); both build their parsers anew on every
call and Miles' path never sets Megatron's global args. Before argv i the probe writes `ITEM i` to stderr, so
the caller can tell each parse's log lines apart. After each parse, on stdout, the marker line and the answer:
{"index": i, "accepted": bool, "stage": "parse" | "validate" | "config" | "import", "rejected": [flags],
"error": str, "resolved": {...}, "stubbed": [...]}.

    python parse_args_probe.py request.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import traceback

MARKER = "=== v4rl parse_args probe ==="
ITEM = "=== v4rl parse_args probe: argv"
"""Written to stderr, then the argv's index, before each parse."""
RESOLVED = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers", "context_parallel_size", "expert_model_parallel_size",
    "expert_tensor_parallel_size", "sequence_parallel", "actor_num_nodes", "actor_num_gpus_per_node",
    "rollout_num_gpus", "rollout_num_gpus_per_engine", "colocate", "num_rollout", "rollout_batch_size",
    "n_samples_per_prompt", "num_steps_per_rollout", "global_batch_size", "micro_batch_size",
    "use_dynamic_batch_size", "max_tokens_per_gpu", "rollout_max_response_len", "eval_interval", "save",
    "save_interval", "save_retain_interval", "load", "ref_load", "start_rollout_id", "finetune", "use_tis",
    "optimizer_cpu_offload", "optimizer_offload_fraction", "offload_train", "bf16", "fp8", "fp8_recipe",
    "use_rollout_routing_replay", "use_fault_tolerance", "deterministic_mode", "qkv_format", "lr", "eps_clip",
    "eps_clip_high", "prompt_data", "hf_checkpoint", "num_layers", "hidden_size", "num_experts",
    "compress_ratios", "sglang_tp_size", "sglang_dp_size", "sglang_attn_dp_size", "sglang_ep_size",
    "calculate_per_token_loss",  # the loss aggregation (rl/loss_setting.py)
    # the jobs the pipeline derives from the training job (engines/miles/jobs.py)
    "skip_eval_before_train", "log_passrate", "n_samples_per_eval_prompt", "ckpt_step", "no_load_optim",
    "debug_train_only", "debug_disable_optimizer", "load_debug_rollout_data", "save_debug_train_data",
    # Miles' second DeepSeek-V4 generation (e9e19b223): implementation and the pipeline layout string
    "dsv4_impl", "experimental_attention_variant", "dsa_kernel_backend", "pipeline_model_parallel_layout",
    # the rollout correction (engines/miles/train_args.py correction_args)
    "tis_clip", "tis_clip_low", "custom_tis_function_path", "use_opsm", "opsm_delta",
    "pause_generation_mode",  # in_place with routing replay (train_args.R3_PAUSE_MODE, radixark/miles#3277)
)


class _Rejected(Exception):
    """argparse refused the argv (the message names the flags)."""


def _patch_device(device: dict) -> None:
    """Megatron's validate_args asks the accelerator what it is; answer as the target one would."""
    import torch

    props = type("DeviceProperties", (), {"name": device["name"], "total_memory": int(device["total_memory"]),
                                          "major": device["capability"][0], "minor": device["capability"][1],
                                          "multi_processor_count": device.get("multi_processor_count", 0)})
    torch.cuda.get_device_capability = lambda *a, **k: tuple(device["capability"])
    torch.cuda.get_device_properties = lambda *a, **k: props()


def _rejected_flags(message: str) -> list[str]:
    """The flags an argparse error message names ("unrecognized arguments: --a --b", "argument --x: ...")."""
    if "unrecognized arguments:" in message:
        return [t for t in message.split("unrecognized arguments:", 1)[1].split() if t.startswith("-")]
    if message.startswith("argument "):
        return [message[len("argument "):].split(":", 1)[0].split("/")[0].strip()]
    return []


def _jsonable(value):
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "__dataclass_fields__"):
        return {k: _jsonable(getattr(value, k)) for k in value.__dataclass_fields__}
    return str(value)


def probe(request: dict) -> dict:
    def error(self, message):  # argparse would print usage and exit 2; keep the message instead
        raise _Rejected(message)

    argparse.ArgumentParser.error = error
    sys.argv = ["train.py", *request["argv"]]
    log = io.StringIO()
    stage = "import"
    try:
        with contextlib.redirect_stdout(log):
            _patch_device(request["device"])
            from miles.utils.arguments import parse_args

            stage = "parse"
            args = parse_args()
    except _Rejected as exc:
        return {"accepted": False, "stage": "parse", "rejected": _rejected_flags(str(exc)), "error": str(exc)}
    except SystemExit as exc:
        return {"accepted": False, "stage": stage, "rejected": [], "error": f"SystemExit: {exc.code}",
                "log": log.getvalue()[-4000:]}  # what Miles printed before exiting (the caller picks its error lines)
    except Exception as exc:  # Miles/Megatron validation asserts (or an import that is not stubbed)
        stage = "validate" if stage == "parse" else stage
        return {"accepted": False, "stage": stage, "rejected": [], "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()[-4000:]}
    resolved = {key: _jsonable(getattr(args, key, None)) for key in RESOLVED}
    resolved["eval_datasets"] = _jsonable(getattr(args, "eval_datasets", None))
    if getattr(args, "custom_tis_function_path", None):
        try:  # what Miles' loss does with the path (loss_hub: load_function(args.custom_tis_function_path))
            from miles.utils.misc import load_function

            resolved["custom_tis_function"] = getattr(load_function(args.custom_tis_function_path), "__name__", "?")
        except Exception as exc:  # the path names no importable function in this Miles
            return {"accepted": False, "stage": "validate", "rejected": [], "resolved": resolved,
                    "error": f"--custom-tis-function-path {args.custom_tis_function_path}: {type(exc).__name__}: "
                             f"{exc}"}
    if request.get("build_config"):
        try:  # what Miles' model provider does first on every rank: Megatron's TransformerConfig from args
            with contextlib.redirect_stdout(log):
                from megatron.training.arguments import core_transformer_config_from_args

                config = core_transformer_config_from_args(args)
        except Exception as exc:  # TransformerConfig.__post_init__ asserts (pipeline layout, MLA, DSv4 contract)
            return {"accepted": False, "stage": "config", "rejected": [], "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc()[-4000:], "resolved": resolved}
        layout = getattr(config, "pipeline_model_parallel_layout", None)
        resolved["config"] = {"type": type(config).__name__, "num_layers": config.num_layers,
                              "pipeline_model_parallel_layout": None if layout is None else str(layout),
                              "experimental_attention_variant": getattr(config, "experimental_attention_variant", None)}
    return {"accepted": True, "stage": "config" if request.get("build_config") else "validate", "rejected": [],
            "error": "", "resolved": resolved}


def probe_each(request: dict):
    """probe() on each of request["argvs"] in turn, yielding each answer; what a parse leaves outside its args
    (os.environ, torch's deterministic mode) is put back before the next."""
    for i, argv in enumerate(request["argvs"]):
        print(f"{ITEM} {i}", file=sys.stderr, flush=True)
        environ = dict(os.environ)
        torch = sys.modules.get("torch")
        switch = getattr(torch, "use_deterministic_algorithms", None)  # absent while torch is not imported
        deterministic = (torch.are_deterministic_algorithms_enabled(),
                         torch.is_deterministic_algorithms_warn_only_enabled()) if switch else (False, False)
        try:
            answer = probe({**request, "argv": argv})
        except (Exception, SystemExit) as exc:  # one argv's failure must not end the others' parses
            answer = {"accepted": False, "stage": "import", "rejected": [], "error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc()[-4000:]}
        finally:
            os.environ.clear()
            os.environ.update(environ)
            switch = getattr(sys.modules.get("torch"), "use_deterministic_algorithms", None)
            if switch is not None:
                switch(deterministic[0], warn_only=deterministic[1])
        yield {"index": i, **answer}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        request = json.load(f)
    for answer in probe_each(request):
        stubs = sys.modules.get("engine_stubs")  # loaded by engines.upstream.sources.engine_python
        answer["stubbed"] = sorted(set(getattr(stubs, "STUBBED", [])))
        print(MARKER)
        print(json.dumps(answer), flush=True)
