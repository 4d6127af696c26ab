"""The Miles-legal tiny DeepSeek-V4 a rehearsal runs: Flash's per-head shapes, everything else shrunk.

Miles' attention asserts Flash's per-head dimensions (head_dim 512, rope 64, o_lora_rank 1024, window 128, YaRN
factor 16 over 65536, compressor head dims 128/512), so those stay; hidden 128, 2 heads in 2 output groups,
4 layers (sliding + hash MoE, CSA, HCA, CSA), 4 routed experts top-2, vocab 500 shrink (engines/presets/models.py
`tiny_miles_config`, also the cluster-rehearsal preset's model). The same shape the model
conformance tests build (tests/conformance/miles_model_harness.py), so what Miles' model loads there is what
v4rl's engine serves here. Weights: v4rl's own random init (the transformers reference init `v4rl bootstrap`
starts from), exported as the FP8/FP4 HF checkpoint a cluster's SGLang would serve.

    hf_dir = make_tiny_checkpoint(Path("/tmp/rehearsal/hf"))
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from engines.presets.models import tiny_miles_config


def make_tiny_checkpoint(out: Path, *, seed: int = 0, weight_format: str = "fp8", expert_dtype: str = "fp4") -> Path:
    """v4rl's random tiny model saved as an HF checkpoint (`weight_format`, `expert_dtype` as checkpoints.hf writes
    them; the release's experts are FP4)."""
    from checkpoints.hf import save_hf_checkpoint
    from engines.model.tokenizer import build_tokenizer
    from engines.train.hf_model import build_reference_model, native_from_reference

    cfg = tiny_miles_config()
    native = native_from_reference(build_reference_model(cfg, seed=seed))
    with tempfile.TemporaryDirectory() as tok:
        build_tokenizer().save_pretrained(tok)
        return save_hf_checkpoint(out, cfg, native, weight_format=weight_format, tokenizer_dir=tok,
                                  expert_dtype=expert_dtype)
