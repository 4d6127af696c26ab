"""Per-token logprobs of given sequences under our engine or under transformers' reference, loaded from
the same checkpoint directory. The building block of every alignment check.

Input: a list of `{"prompt_ids": [...], "response_ids": [...]}`; output: `[{"logprobs": [...]}, ...]`
with one logprob per response token (the logprob of response token j given everything before it).

    v4rl score --model ckpt/ --input seqs.json --engine ours --dtype float32 --json out.json
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch

from checkpoints.hf import load_hf_checkpoint
from engines.model import DeepseekV4

Engine = Literal["ours", "reference"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_ours(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> DeepseekV4:
    """Our model with the checkpoint's weights, dequantized, in `dtype` (fp32 where the reference keeps fp32)."""
    cfg, state = load_hf_checkpoint(model_dir, dequantize=True, out_dtype=torch.float32)
    model = DeepseekV4(cfg)
    if dtype != torch.float32:  # set the dtype layout first, so fp32 tensors are never rounded through bf16
        model = model.to(dtype).keep_fp32_where_reference_does()
    model.load_state_dict(state)
    return model.eval()


def load_reference(model_dir: str | Path, dtype: torch.dtype = torch.float32):
    """transformers' DeepseekV4ForCausalLM.from_pretrained, FP8/FP4 weights dequantized (the reference computes in
    `dtype`, never in FP8, also where a GPU could run FP8)."""
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="eager",
                                                  **_dequantizing(model_dir))
    if dtype == torch.float32:
        model = model.float()  # the FP8 dequantizer emits bf16 for a float32 load
    return model.eval()


def _dequantizing(model_dir: str | Path) -> dict:
    """from_pretrained's quantization_config asking for dequantized FP8 weights, for an FP8 checkpoint.

    Without it transformers finds no GPU, warns "Using FP8 quantized models requires a GPU or XPU" and then
    dequantizes anyway: the same weights (checked bit for bit), but a warning a CPU run must not print, since
    dequantizing is what the reference means to do."""
    from transformers import FineGrainedFP8Config

    quant = json.loads((Path(model_dir) / "config.json").read_text()).get("quantization_config") or {}
    if quant.get("quant_method") != "fp8":
        return {}
    block = tuple(quant.get("weight_block_size") or (128, 128))
    return {"quantization_config": FineGrainedFP8Config(dequantize=True, weight_block_size=block)}


def read_sequences(path: str | Path) -> list[dict]:
    path = Path(path)
    try:
        rows = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read sequences from {path}: {exc}") from exc
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a JSON list of {{'prompt_ids': [...], 'response_ids': [...]}}")
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("prompt_ids"), list) \
                or not isinstance(row.get("response_ids"), list):
            raise ValueError(f"{path}: entry {i} needs integer lists 'prompt_ids' and 'response_ids'")
        if not row["prompt_ids"]:
            raise ValueError(f"{path}: entry {i} has an empty prompt_ids; the first token has no logprob, so a "
                             "prompt needs at least one token (e.g. BOS)")
    return rows


@torch.inference_mode()
def token_logprobs(forward, sequences: list[dict], *, vocab_size: int, pad_id: int = 0,
                   batch_size: int = 32) -> list[list[float]]:
    """Logprob of every response token; `forward(ids [B, S]) -> logits [B, S, V]` (right padding is safe)."""
    results: list[list[float]] = []
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start:start + batch_size]
        seqs = [list(r["prompt_ids"]) + list(r["response_ids"]) for r in chunk]
        for i, s in enumerate(seqs):
            bad = [t for t in s if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"sequence {start + i} has token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
        ids = torch.full((len(seqs), max(map(len, seqs))), pad_id, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s)
        logp = torch.log_softmax(forward(ids).float(), dim=-1)
        for i, r in enumerate(chunk):
            p, n = len(r["prompt_ids"]), len(r["response_ids"])
            targets = ids[i, p:p + n]
            results.append(logp[i, p - 1:p - 1 + n].gather(-1, targets[:, None])[:, 0].tolist())
    return results


def score(model_dir: str | Path, sequences: list[dict], *, engine: Engine = "ours",
          dtype: str = "float32") -> list[dict]:
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    if engine == "ours":
        model = load_ours(model_dir, DTYPES[dtype])
        forward, vocab = model, model.cfg.vocab_size
    elif engine == "reference":
        model = load_reference(model_dir, DTYPES[dtype])
        forward, vocab = (lambda ids: model(input_ids=ids).logits), model.config.vocab_size
    else:
        raise ValueError(f"engine {engine!r} is not known; use 'ours' or 'reference'")
    return [{"logprobs": lp} for lp in token_logprobs(forward, sequences, vocab_size=vocab)]
