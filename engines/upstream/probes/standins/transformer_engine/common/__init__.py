"""transformer_engine.common stand-in: only `recipe` (Megatron reads recipe classes for isinstance checks)."""

from . import recipe  # noqa: F401
