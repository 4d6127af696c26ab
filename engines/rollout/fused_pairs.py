"""Buckets of a distributed weight update that never split one of SGLang's fused pairs.

SGLang 0.5.23's `DeepseekV4ForCausalLM.load_weights` (sglang/srt/models/deepseek_v4.py) builds some parameters
from two checkpoint tensors: it caches the first half it sees and loads the fused parameter when the second
arrives, and at the end of EVERY call it asserts that its caches are empty (`assert len(cache_compressor_weight)
== 0`, `assert len(cache_wqkv_a_weight) == 0`). `/update_weights_from_distributed` runs one `load_weights` call
per bucket, so a bucket holding one half of a pair fails the update (conformance C9). With
SGLANG_OPT_FP8_WO_A_GEMM=0 its wo_a pre-pass pairs `wo_a.weight` with `wo_a.scale` the same way, and a split
there loads the FP8 bytes without their scale, silently. `FUSED_PAIRS` is SGLang's whole list, in the tensor
names `launcher.sglang_named_tensors` sends; `update_buckets` packs tensors by bytes with each pair as one unit,
and refuses a stream that carries one half without the other (SGLang would fail on it after the bytes were sent).

    from engines.rollout.fused_pairs import update_buckets
    for bucket in update_buckets(sglang_named_tensors(encoded), bucket_bytes=1 << 30): ...

`tests/test_rollout_fused_pairs.py` checks the grouping on every tensor of tiny-base with 1-byte buckets and that
the table still names every cache SGLang's `load_weights` asserts on (SGLang source cache, skipped without it).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FusedPair:
    """Two checkpoint tensors SGLang's DeepSeek-V4 loader fuses into one parameter within one load_weights call."""

    halves: tuple[str, str]
    """Name suffixes of the two tensors (SGLang's names), in the order SGLang concatenates them."""
    fused: str
    """Name suffix of SGLang's parameter: a tensor's name with its half's suffix replaced by this."""
    cache: str
    """The dict in SGLang's load_weights that holds the first half until the second arrives (the `cache_*` ones
    are asserted empty at the end of each call)."""
    when: str
    """The SGLang condition under which load_weights fuses this pair."""
    excluding: tuple[str, ...] = ()
    """Name parts that exclude a tensor from this pair (SGLang's own exclusions)."""
    unscaled_alone: bool = False
    """SGLang loads the first half alone when the call carried no second half at all (the wo_a pre-pass emits a
    held `wo_a.weight` as is unless it saw a `wo_a.scale`): allowed here for an unquantized weight only (BF16, as
    Miles sends wo_a), since FP8 bytes without their scale would load unscaled."""

    def fused_name(self, name: str) -> tuple[str, int] | None:
        """(fused parameter name, which half) when `name` is a half of this pair, else None."""
        if any(part in name for part in self.excluding):
            return None
        for which, suffix in enumerate(self.halves):
            if name.endswith(suffix):
                return name[: -len(suffix)] + self.fused, which
        return None


_WQKV_A = "cache_wqkv_a_weight"
_WQKV_A_WHEN = "SGLANG_OPT_FUSE_WQA_WKV (default on)"
_NOT_COMPRESSOR = (".compressor.", ".engram.")

FUSED_PAIRS: tuple[FusedPair, ...] = (
    # every compressor (CSA/HCA layers' and the indexer's) holds one wkv_gate projection in SGLang
    FusedPair((".compressor.wkv.weight", ".compressor.wgate.weight"), ".compressor.wkv_gate.weight",
              "cache_compressor_weight", "always (SGLang's compressor has one wkv_gate projection)"),
    # the attention's query and KV down-projections share one GEMM: weights and their FP8 block scales
    FusedPair((".wq_a.weight", ".wkv.weight"), ".wqkv_a.weight", _WQKV_A, _WQKV_A_WHEN, _NOT_COMPRESSOR),
    FusedPair((".wq_a.weight_scale_inv", ".wkv.weight_scale_inv"), ".wqkv_a.weight_scale_inv", _WQKV_A,
              _WQKV_A_WHEN, _NOT_COMPRESSOR),
    # SGLANG_OPT_FP8_WO_A_GEMM=0 (v4rl's setting): load_weights' pre-pass (_dequant_fp8_wo_a_streaming) holds
    # `wo_a.weight` until `wo_a.scale` arrives and dequantizes wo_a to BF16; nothing asserts, a split pair loads
    # the FP8 bytes unscaled and drops the scale (`...wo_a.weight_scale_inv not found in params_dict`)
    FusedPair((".wo_a.weight", ".wo_a.scale"), ".wo_a.weight", "pending (_dequant_fp8_wo_a_streaming)",
              "SGLANG_OPT_FP8_WO_A_GEMM=0 (v4rl's setting; conformance C9)", unscaled_alone=True),
    # GGUF checkpoints only (v4rl never sends these); listed so the table is SGLang's whole list
    FusedPair((".wq_a.qweight", ".wkv.qweight"), ".wqkv_a.qweight", _WQKV_A, _WQKV_A_WHEN, _NOT_COMPRESSOR),
    FusedPair((".wq_a.qweight_type", ".wkv.qweight_type"), ".wqkv_a.qweight_type", _WQKV_A, _WQKV_A_WHEN,
              _NOT_COMPRESSOR),
)
"""SGLang 0.5.23's fused pairs in DeepseekV4ForCausalLM.load_weights; the first matching row decides."""


def fused_parameter(name: str, pairs: Sequence[FusedPair] = FUSED_PAIRS) -> tuple[str, int] | None:
    """(SGLang's fused parameter, which half) for a tensor that is half of a fused pair, else None."""
    for pair in pairs:
        hit = pair.fused_name(name)
        if hit is not None:
            return hit
    return None


class SplitPairError(ValueError):
    """A weight update carries one half of a fused pair without the other; SGLang's loader would assert."""


def pair_units(named: Iterable[tuple[str, torch.Tensor]], pairs: Sequence[FusedPair] = FUSED_PAIRS
               ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The tensors in order, each pair as one unit (at its second half's place, halves in arrival order).

    Only a half whose partner has not arrived yet is held back, so memory stays one layer's halves at most.
    A missing partner or a half that arrives twice is a `SplitPairError` naming the tensors."""
    waiting: dict[str, tuple[int, tuple[str, torch.Tensor]]] = {}
    seconds_seen: set[FusedPair] = set()
    for name, t in named:
        hit = fused_parameter(name, pairs)
        if hit is not None and hit[1] == 1:
            seconds_seen.add(next(p for p in pairs if p.fused_name(name)))
        if hit is None:
            yield [(name, t)]
            continue
        fused, which = hit
        if fused not in waiting:
            waiting[fused] = (which, (name, t))
            continue
        first_which, first = waiting.pop(fused)
        if first_which == which:
            raise SplitPairError(f"{name} arrives twice before its partner in a weight update; SGLang's loader "
                                 f"fuses it into {fused} and refuses a duplicate half: send each tensor once")
        yield [first, (name, t)]
    for fused, (which, (name, t)) in list(waiting.items()):
        pair = next(p for p in pairs if p.fused_name(name))
        if pair.unscaled_alone and which == 0 and pair not in seconds_seen and t.dtype.is_floating_point \
                and t.element_size() > 1:
            del waiting[fused]
            yield [(name, t)]
    if waiting:
        fused, (which, (name, _)) = next(iter(waiting.items()))
        pair = next(p for p in pairs if p.fused_name(name))
        partner = name[: -len(pair.halves[which])] + pair.halves[1 - which]
        raise SplitPairError(
            f"{name} has no partner {partner} in this weight update ({len(waiting)} fused parameters incomplete); "
            f"SGLang's DeepSeek-V4 loader builds {fused} from both within one load_weights call "
            f"(`{pair.cache}`, {pair.when}): send both halves")


def update_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                   pairs: Sequence[FusedPair] = FUSED_PAIRS) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of at most `bucket_bytes` (a larger unit gets a bucket alone) in which every fused pair of
    `pairs` travels whole: one `/update_weights_from_distributed` call each, as SGLang's loader needs."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1; got {bucket_bytes}")
    current: list[tuple[str, torch.Tensor]] = []
    size = 0
    for unit in pair_units(named, pairs):
        nbytes = sum(t.numel() * t.element_size() for _, t in unit)
        if current and size + nbytes > bucket_bytes:
            yield current
            current, size = [], 0
        current.extend(unit)
        size += nbytes
    if current:
        yield current
