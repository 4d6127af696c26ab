"""The rollout-correction setting as pure data (no torch): what the command line, the flow's form and the presets
read, so none of them imports torch to show or check it. The functions that apply it are in rl/corrections.py.

    >>> RolloutCorrection(mode="icepop").clip_bounds
    (0.5, 2.0)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = ["MASKING_MODES", "MIS_ALTERNATIVE", "MIS_EXAMPLE", "MODES", "RolloutCorrection"]

Mode = Literal["none", "tis", "icepop", "seq-is", "geo-mask", "seq-mask"]
MODES: tuple[str, ...] = ("none", "tis", "icepop", "seq-is", "geo-mask", "seq-mask")
MASKING_MODES = ("geo-mask", "seq-mask")
MIS_EXAMPLE = "examples/infra_features/train_infer_mismatch_helper"
"""Miles' MIS example, the only Miles code for seq-is / geo-mask / seq-mask; the pinned Miles trees lack it."""
MIS_ALTERNATIVE = {"seq-is": "tis", "geo-mask": "icepop", "seq-mask": "icepop"}
"""What a cluster preset runs instead of a MIS mode: the nearest mode Miles' own code carries."""
_CLIP_DEFAULTS = {"none": (0.0, 2.0), "tis": (0.0, 2.0), "icepop": (0.5, 2.0), "seq-is": (0.0, 2.0),
                  "geo-mask": (0.0, 2.0), "seq-mask": (0.0, 2.0)}
_REJECT_DEFAULTS = {"geo-mask": (0.9999, 1.0001), "seq-mask": (0.5, 2.0)}


@dataclass(frozen=True, kw_only=True)
class RolloutCorrection:
    """How the policy loss corrects the train/rollout probability mismatch (the modes: rl/corrections.py).

    Invalid values raise ``ValueError`` at construction, naming the field and the fix.

    >>> RolloutCorrection(mode="geo-mask").reject_bounds
    (0.9999, 1.0001)
    """

    mode: Mode = "tis"
    """none | tis | icepop | seq-is | geo-mask | seq-mask: tis truncates each token's ratio (the seed's TIS), icepop
    zeroes tokens whose ratio leaves the bounds, seq-is weights whole sequences, geo-mask / seq-mask keep token TIS
    and mask sequences whose geometric-mean / product ratio leaves the rejection bounds."""

    clip_low: float | None = None
    """Lower bound of the importance weight (Miles --tis-clip-low); empty: the mode's (tis, seq-is and the masking
    modes 0, icepop 0.5). Must lie in [0, 1] so a token on which both engines agree keeps weight 1."""

    clip_high: float | None = None
    """Upper bound of the importance weight (Miles --tis-clip); empty: 2. Must be >= 1 for the same reason."""

    reject_low: float | None = None
    """geo-mask / seq-mask only: a sequence whose ratio falls below this is masked; empty: 0.9999 (geo-mask) or
    0.5 (seq-mask). Must lie in (0, 1]."""

    reject_high: float | None = None
    """geo-mask / seq-mask only: a sequence whose ratio rises above this is masked; empty: 1.0001 (geo-mask) or
    2 (seq-mask). Must be >= 1."""

    veto_threshold: float | None = 1e-4
    """geo-mask / seq-mask: a sequence holding one token whose ratio is below this is masked (Miles' MIS
    rs_veto_threshold); empty disables the veto. In (0, 1)."""

    opsm: bool = False
    """Off-policy sequence masking (Miles --use-opsm), on top of any mode: a sequence with a negative advantage
    whose mean rollout-vs-trainer log-ratio exceeds opsm_delta is masked."""

    opsm_delta: float = 1e-4
    """OPSM's threshold on the sequence's mean ``rollout_lp - train_lp`` (Miles --opsm-delta). >= 0."""

    routing_replay: bool = False
    """Rollout routing replay (R3, Miles --use-rollout-routing-replay), on top of any mode: the rollout engine
    returns the experts it routed each token to, and the trainer's forward uses those experts in the learned top-k
    MoE layers, with gate weights recomputed from its own router scores (so the router still learns); hash layers
    route by their fixed token table on both sides and are not replayed. Removes the routing part of the
    train/rollout mismatch (train/router_mismatch_frac, logged either way, is its size without replay)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"rollout correction mode {self.mode!r} is not one of {', '.join(MODES)}; use tis (the "
                             "seed's token TIS) or none")
        low, high = self.clip_bounds
        if not (math.isfinite(low) and math.isfinite(high) and 0.0 <= low <= 1.0 <= high):
            raise ValueError(f"rollout correction clip bounds [clip_low={low}, clip_high={high}] must contain 1 with "
                             "clip_low >= 0 (a token both engines agree on must keep weight 1); leave them empty "
                             f"for {self.mode}'s defaults {_CLIP_DEFAULTS[self.mode]}")
        if self.mode not in MASKING_MODES and (self.reject_low is not None or self.reject_high is not None):
            raise ValueError(f"reject_low / reject_high apply to geo-mask and seq-mask only, not {self.mode}; leave "
                             "them empty or choose one of those modes")
        if self.mode in MASKING_MODES:
            rlow, rhigh = self.reject_bounds
            if not (math.isfinite(rhigh) and 0.0 < rlow <= 1.0 <= rhigh):
                raise ValueError(f"rejection bounds [reject_low={rlow}, reject_high={rhigh}] must satisfy 0 < low <= "
                                 f"1 <= high; leave them empty for {self.mode}'s defaults "
                                 f"{_REJECT_DEFAULTS[self.mode]}")
        if self.veto_threshold is not None and not 0.0 < self.veto_threshold < 1.0:
            raise ValueError(f"veto_threshold={self.veto_threshold} must lie in (0, 1) (Miles' MIS uses 1e-4); leave "
                             "it empty to disable the veto")
        if not (math.isfinite(self.opsm_delta) and self.opsm_delta >= 0.0):
            raise ValueError(f"opsm_delta={self.opsm_delta} must be a finite number >= 0 (DeepSeek-V3.2 and Miles "
                             "use 1e-4)")

    @property
    def clip_bounds(self) -> tuple[float, float]:
        """(clip_low, clip_high) with the mode's defaults filled in."""
        low, high = _CLIP_DEFAULTS.get(self.mode, (0.0, 2.0))
        return (low if self.clip_low is None else float(self.clip_low),
                high if self.clip_high is None else float(self.clip_high))

    @property
    def reject_bounds(self) -> tuple[float, float]:
        """(reject_low, reject_high) of a masking mode, defaults filled in."""
        low, high = _REJECT_DEFAULTS[self.mode]
        return (low if self.reject_low is None else float(self.reject_low),
                high if self.reject_high is None else float(self.reject_high))

    @classmethod
    def coerce(cls, value: "RolloutCorrection | dict[str, Any] | str | None") -> "RolloutCorrection":
        """The setting from itself, its ``asdict`` form (config.json, a Ray actor's arguments), a mode name or None
        (the default)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(mode=value)
        if isinstance(value, dict):
            from rl.known_fields import check_known_fields

            check_known_fields(value, cls.__dataclass_fields__, "rollout_correction")
            return cls(**value)
        raise ValueError(f"rollout_correction must be a mode name or a mapping of {', '.join(cls.__dataclass_fields__)}"
                         f", got {type(value).__name__}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
