"""FP8 recipe classes Megatron names (isinstance checks, config types); BF16 runs never instantiate them."""


class Recipe:
    """Base of TE's recipes."""


class DelayedScaling(Recipe):
    pass


class Float8CurrentScaling(Recipe):
    pass


class Float8BlockScaling(Recipe):
    pass


class MXFP8BlockScaling(Recipe):
    pass


class NVFP4BlockScaling(Recipe):
    pass


class Format:
    E4M3 = "E4M3"
    HYBRID = "HYBRID"
