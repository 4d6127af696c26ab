"""transformer_engine.pytorch.module stand-in (TE keeps its modules here; Megatron imports `base` from it)."""

from . import base  # noqa: F401
