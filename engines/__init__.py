"""engines: the model, the rollout and training engines, and the code that drives the real ones (no Prefect).

`TINY_BASE` is the committed tiny DeepSeek-V4 base checkpoint (native FP8 + FP4 experts, the output of
`v4rl bootstrap --seed 0`), shipped as package data so that a non-editable install has the embedded default's
starting weights too.
"""

from pathlib import Path

TINY_BASE = Path(__file__).resolve().parent / "tiny_base"
