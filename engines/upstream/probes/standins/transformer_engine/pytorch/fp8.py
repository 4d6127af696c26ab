"""transformer_engine.pytorch.fp8 stand-in: FP8 is never enabled in the CPU model (BF16, as v4rl's actor)."""

import contextlib


class FP8GlobalStateManager:
    @staticmethod
    def is_fp8_enabled() -> bool:
        return False

    @staticmethod
    def get_fp8_recipe():
        return None

    @staticmethod
    def is_first_fp8_module() -> bool:
        return False


@contextlib.contextmanager
def fp8_autocast(*args, **kwargs):
    yield


fp8_model_init = fp8_autocast
autocast = fp8_autocast
