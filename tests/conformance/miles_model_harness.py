"""Fixtures' workhorse for tests/conformance/test_miles_model*.py: a Miles-legal tiny DeepSeek-V4 checkpoint made
by v4rl, converted by v4rl, and one probe run of Miles' OWN model on it (engines/upstream/miles_model_check.py).

Miles' attention asserts Flash's per-head shapes (head_dim 512, rope 64, o_lora_rank 1024, window 128, YaRN
factor 4 or 16 over 65536, compressor head dims 128/512, compress RoPE base 160000), so the tiny model keeps them
and shrinks everything else: hidden 128, 2 heads in 2 output groups, 4 layers (sliding + hash MoE, CSA, HCA,
CSA), 4 routed experts top-2, vocab 500 (Megatron pads it to 512: the pad rows are part of what is checked).
Its weights come from v4rl's own model code (the transformers reference init, as `v4rl bootstrap` starts), with
every norm weight and mHC scale made NOT constant (a constant scale would hide a wrong alpha order).

    run = probe_generation(tmp, generation=1)       # one subprocess: keys, two loads, clean + faulty forwards
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engines.model.config import ModelConfig
from engines.presets.models import tiny_miles_config  # noqa: F401 - the one Miles-legal tiny shape (tests import it from here)
from engines.upstream.miles_model_check import NUMERIC_STANDINS, tile_kernels_mhc_reference

SEQ = 256
"""Tokens of the forward: a multiple of 128 (Miles' compressor), two HCA entries, 64 CSA entries."""


def make_hf_checkpoint(out: Path, cfg: ModelConfig, *, seed: int = 0) -> Path:
    """v4rl's own random model (transformers reference init), norms and mHC scales varied, saved BF16."""
    from checkpoints.hf import save_hf_checkpoint
    from engines.model.tokenizer import build_tokenizer
    from engines.train.hf_model import build_reference_model, native_from_reference

    native = native_from_reference(build_reference_model(cfg, seed=seed))
    g = torch.Generator().manual_seed(seed + 1)
    for name, t in native.items():
        if name.endswith("norm.weight"):  # every RMSNorm weight, compressor norms included
            native[name] = (1 + 0.3 * torch.randn(t.shape, generator=g)).to(t.dtype)
        elif name.endswith("_scale") and t.numel() == 3:  # mHC alphas (pre, post, res): distinct, none constant
            low = torch.tensor([0.5, 0.1, 1.2])
            native[name] = (low + 0.4 * torch.rand(3, generator=g)).to(t.dtype)
        elif name.endswith("_scale"):  # the head's alpha [1]
            native[name] = (0.5 + torch.rand(t.shape, generator=g)).to(t.dtype)
        elif name.endswith(("attn_sink", ".ape")):  # trained sinks and compressor position biases are O(1)
            native[name] = (1.5 * torch.randn(t.shape, generator=g)).to(t.dtype)
    with tempfile.TemporaryDirectory() as tok:
        build_tokenizer().save_pretrained(tok)
        return save_hf_checkpoint(out, cfg, native, weight_format="bf16", tokenizer_dir=tok)


def numbered_copy(release_root: Path, out: Path, iteration: int = 20) -> Path:
    """The same checkpoint in Megatron's numbered layout (`iter_0000020/` + tracker): what a Miles save looks like."""
    (out / f"iter_{iteration:07d}").parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(release_root / "release", out / f"iter_{iteration:07d}")
    (out / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return out


FAULTS_GEN1 = [
    # name, parameter suffix (Miles' module names), op, expected (layer, block) in the align report
    ({"name": "hash_table_shifted", "param": "decoder.layers.0.mlp.router.tid2eid", "op": "roll"}, (0, "router")),
    ({"name": "mhc_alpha_order", "param": "decoder.layers.2.hc_attn_scale", "op": "swap", "index": [1, 2]},
     (2, "mhc")),
    ({"name": "compressor_ape", "param": "decoder.layers.1.self_attention.compressor.ape", "op": "zero"},
     (1, "attention")),
    ({"name": "indexer_weights", "param": "decoder.layers.1.self_attention.indexer.linear_weights_proj.weight",
      "op": "negate"}, (1, "attention")),
    ({"name": "attention_sink", "param": "decoder.layers.3.self_attention.attn_sink", "op": "zero"},
     (3, "attention")),
]


_CORE = "self_attention.core_attention."
FAULTS_GEN2 = [  # the same faults under Megatron's names (second generation; alphas are separate [1] parameters)
    ({"name": "hash_table_shifted", "param": "decoder.layers.0.mlp.router.tid2eid", "op": "roll"}, (0, "router")),
    ({"name": "mhc_alpha_order", "param": "decoder.layers.2.self_attention_hyper_connection.alpha_post",
      "op": "swap_with", "other": "decoder.layers.2.self_attention_hyper_connection.alpha_res"}, (2, "mhc")),
    ({"name": "compressor_ape", "param": f"decoder.layers.1.{_CORE}compressor.ape", "op": "zero"},
     (1, "attention")),
    ({"name": "indexer_weights", "param": f"decoder.layers.1.{_CORE}indexer.linear_weights_proj.weight",
      "op": "negate"}, (1, "attention")),
    ({"name": "attention_sink", "param": f"decoder.layers.3.{_CORE}attn_sink", "op": "zero"}, (3, "attention")),
]


@dataclass
class GenerationRun:
    """One generation's probe run on the tiny checkpoint, and what v4rl made."""

    cfg: ModelConfig
    hf_dir: Path
    release_root: Path
    numbered_root: Path
    tokens: torch.Tensor
    result: object
    """engines.upstream.miles_model_check.ProbeResult"""
    expected_keys: dict
    faults: list = field(default_factory=list)
    seconds: float = 0.0


def probe_generation(work: Path, *, generation: int = 1, impl: str | None = None, miles_dir=None,
                     megatron_dir=None, faults=None, timeout: float = 1800.0) -> GenerationRun:
    import time

    from checkpoints.convert import convert_hf_to_torch_dist
    from engines.upstream.miles_model_check import expected_checkpoint_keys, probe_argv, run_probe

    cfg = tiny_miles_config()
    names = "plugin" if generation == 1 else "megatron"
    hf_dir = work / "hf"
    if not hf_dir.is_dir():
        make_hf_checkpoint(hf_dir, cfg)
    release = work / f"torch_dist-{names}"
    if not release.is_dir():
        convert_hf_to_torch_dist(hf_dir, release, workers=1, megatron_names=names)
    numbered = work / f"torch_dist-{names}-iter"
    if not numbered.is_dir():
        numbered_copy(release, numbered)
    tokens = torch.randint(0, cfg.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(7))
    extra = ["--dsv4-impl", impl] + (["--dsa-kernel-backend", "none"] if impl == "megatron" else []) if impl else []
    argv = probe_argv(json.loads((hf_dir / "config.json").read_text()), hf_dir=hf_dir, load_dir=release,
                      generation=generation, extra=extra)
    out = work / f"forward-{generation}-{impl or 'default'}"
    out.mkdir(exist_ok=True)
    if faults is None:
        faults = FAULTS_GEN1 if generation == 1 else FAULTS_GEN2
    request = {"argv": argv, "do": ["keys", "forward"], "load_dirs": [str(release), str(numbered)],
               "tokens": tokens.tolist(), "out_dir": str(out), "kernels": str(NUMERIC_STANDINS),
               "faults": [f for f, _ in faults]}
    t0 = time.time()
    result = run_probe(request, miles_dir=miles_dir, megatron_dir=megatron_dir, timeout=timeout,
                       env={"V4RL_TILE_KERNELS_MHC": str(tile_kernels_mhc_reference())})
    return GenerationRun(cfg, hf_dir, release, numbered, tokens, result, expected_checkpoint_keys(cfg, names),
                         faults, time.time() - t0)
