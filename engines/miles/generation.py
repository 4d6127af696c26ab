"""Which DeepSeek-V4 generation a Miles checkout is, read from its code (never from a version string).

Miles has shipped two DeepSeek-V4 Megatron models, and a torch_dist checkpoint written for one does not load
into the other (reference/conformance.md C1, C5-C7):

  generation 1  Miles main 31f1ca961 + Megatron-LM miles-main 2e64d788b: the plugin's own module names
                (`self_attention.wq_a.weight`, `hc_attn_scale` [3]); no `--dsv4-impl`.
  generation 2  Miles e9e19b223 "DeepSeek-V4 support-v2" (PR #2706, merged 2026-08-31) + Megatron-LM
                dsv4-dual-backend 6184c094a: Megatron's names (`self_attention.linear_q_down_proj.weight`,
                `self_attention_hyper_connection.alpha_pre|alpha_post|alpha_res` [1]), `--dsv4-impl miles|megatron`,
                and a load guard (`assert_checkpoint_is_current`) that refuses plugin-named release checkpoints.

The markers are the code that makes the difference: generation 2's `miles_plugins/models/deepseek_v4/
arguments.py` declares `--dsv4-impl` and defines `assert_checkpoint_is_current`, and its attention module builds
`linear_q_down_proj`; generation 1's builds `wq_a`. Files are read as text, nothing is imported.

    from engines.miles.generation import detect_generation
    detect_generation("/workspace/miles").megatron_names     # 'megatron' for a Miles cloned since September

Tests: `.venv/bin/python -m pytest tests/test_miles_generation.py -q`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from checkpoints.names import MegatronNames

PLUGIN_DIR = Path("miles_plugins/models/deepseek_v4")
"""Where Miles keeps its DeepSeek-V4 Megatron model (both generations)."""


EXPLICIT = "v4rl convert --megatron-names plugin|megatron; v4rl plan --miles-generation 1|2; the flow's miles_generation"
"""How a user names the generation where the checkout cannot tell (in every error of this module)."""


class MilesGenerationError(ValueError):
    """The directory is not a Miles checkout with a DeepSeek-V4 model v4rl knows; the message says what to do."""


@dataclass(frozen=True)
class MilesGeneration:
    """What v4rl must hand one Miles checkout: checkpoint names and the flags its DeepSeek-V4 model takes."""

    generation: int
    """1: Miles' plugin model (31f1ca961 line); 2: Megatron's names and `--dsv4-impl` (e9e19b223 line)."""
    megatron_names: MegatronNames
    """The torch_dist key names this Miles' model asks for (checkpoints/names.py)."""
    dsv4_impls: tuple[str, ...]
    """The `--dsv4-impl` choices its parser declares; () where it has no such flag (generation 1)."""
    evidence: str
    """The file and code that decided it (shown by `v4rl convert --miles-dir` and the preflight)."""

    @property
    def label(self) -> str:
        return f"Miles DeepSeek-V4 generation {self.generation} ({self.megatron_names} names)"


def detect_generation(miles_dir: str | Path) -> MilesGeneration:
    """The generation of the Miles checkout at `miles_dir`, from its DeepSeek-V4 plugin's code."""
    root = Path(miles_dir).expanduser()
    plugin = root / PLUGIN_DIR
    model = plugin / "deepseek_v4.py"
    if not root.is_dir():
        raise MilesGenerationError(f"--miles-dir {root} {'is a file' if root.exists() else 'does not exist'}; point "
                                   "it at your Miles checkout (the directory holding train.py and miles_plugins/)")
    if not model.is_file():
        raise MilesGenerationError(f"{root} has no {PLUGIN_DIR / 'deepseek_v4.py'}: not a Miles checkout with "
                                   "DeepSeek-V4 support; point --miles-dir (or $V4RL_MILES_DIR) at Miles main from "
                                   f"2026-08-21 or later, or choose explicitly ({EXPLICIT})")
    model_code = model.read_text(errors="replace")
    arguments = plugin / "arguments.py"
    args_code = arguments.read_text(errors="replace") if arguments.is_file() else ""
    impls = _declared_choices(args_code, "--dsv4-impl")
    guard = "def assert_checkpoint_is_current" in args_code
    megatron_named = re.search(r"self\.linear_q_down_proj\s*=", model_code) is not None
    plugin_named = re.search(r"self\.wq_a\s*=", model_code) is not None
    if (impls or guard) and megatron_named:
        return MilesGeneration(2, "megatron", impls, f"{arguments}: --dsv4-impl {'|'.join(impls) or '?'}"
                               f"{', assert_checkpoint_is_current' if guard else ''}; {model}: linear_q_down_proj")
    if plugin_named and not (impls or guard or megatron_named):
        return MilesGeneration(1, "plugin", (), f"{model}: the attention builds wq_a (plugin names), no --dsv4-impl")
    raise MilesGenerationError(
        f"{root}: its DeepSeek-V4 model matches neither generation v4rl knows (--dsv4-impl declared: {bool(impls)}, "
        f"checkpoint guard: {guard}, Megatron-named attention: {megatron_named}, plugin-named attention: "
        f"{plugin_named}); choose explicitly ({EXPLICIT})")


def _declared_choices(code: str, flag: str) -> tuple[str, ...]:
    """The `choices=[...]` of `add_argument("<flag>", ...)` in `code` (argparse source), () if not declared."""
    at = code.find(f'"{flag}"')
    if at < 0:
        at = code.find(f"'{flag}'")
    if at < 0:
        return ()
    found = re.search(r"choices\s*=\s*[\[(]([^\])]*)[\])]", code[at:at + 800])
    return tuple(re.findall(r"""["']([^"']+)["']""", found.group(1))) if found else ("?",)


def dsv4_impl_args(gen: MilesGeneration, impl: str | None = None) -> list[str]:
    """The `--dsv4-impl` flags a CPU probe of this checkout's model gets: none for generation 1 (its parser has no
    such flag and exits 2 on one; "miles", the presets' default, is the plugin model generation 1 always runs),
    `--dsv4-impl IMPL` (default: the parser's first choice) for generation 2, with `--dsa-kernel-backend none` for
    "megatron" (its cuDNN kernels do not exist on CPU)."""
    if not gen.dsv4_impls:
        if impl in (None, "miles"):
            return []
        raise MilesGenerationError(f"--dsv4-impl {impl} needs Miles' second DeepSeek-V4 generation (e9e19b223 or "
                                   f"later), but the checkout is {gen.label}, which has only the plugin model; drop "
                                   "--dsv4-impl (dsv4_impl 'miles') or point --miles-dir at a generation-2 Miles")
    impl = impl or gen.dsv4_impls[0]
    if "?" not in gen.dsv4_impls and impl not in gen.dsv4_impls:
        raise MilesGenerationError(f"--dsv4-impl {impl}: this Miles declares {'|'.join(gen.dsv4_impls)} "
                                   f"({gen.evidence}); choose one of those")
    return ["--dsv4-impl", impl] + (["--dsa-kernel-backend", "none"] if impl == "megatron" else [])


def megatron_names_for(miles_dir: str | Path | None, forced: str | None = None) -> tuple[MegatronNames, str]:
    """The torch_dist names to write, and why: `forced` (plugin|megatron) wins, else the generation of the Miles
    at `miles_dir`, else `plugin` (what v4rl wrote before both generations were supported)."""
    if forced:
        if forced not in ("plugin", "megatron"):
            raise MilesGenerationError(f"--megatron-names must be plugin or megatron; got {forced!r}")
        return forced, f"--megatron-names {forced}"  # type: ignore[return-value]
    if miles_dir:
        gen = detect_generation(miles_dir)
        return gen.megatron_names, f"{gen.label}: {gen.evidence}"
    return "plugin", "default (no --miles-dir): Miles' plugin names, DeepSeek-V4 generation 1"
