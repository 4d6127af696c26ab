"""Rollout correction: how the loss accounts for the rollout engine (FP8) and the trainer (BF16) assigning
slightly different probabilities to the same sampled tokens. Pure torch functions and one typed setting.

Modes (``RolloutCorrection.mode``), each the semantics of the anchor named, with ``r_t = exp(train_lp - rollout_lp)``:

    none      weight 1 (the mismatch is only measured)
    tis       token truncate: ``w_t = clamp(r_t, clip_low, clip_high)`` (Miles ``--use-tis``,
              ``vanilla_tis_function``; today's default, 0 / 2)
    icepop    token mask: ``w_t = r_t`` inside ``[clip_low, clip_high]``, else 0 (Miles ``icepop_function``,
              NeMo-RL ``icepop``, verl ``token_k1``; 0.5 / 2)
    seq-is    sequence IS: one weight per sequence, ``clamp(prod_t r_t, clip_low, clip_high)`` (Miles' MIS example
              ``tis_level: sequence, tis_mode: truncate``; 0 / 2)
    geo-mask  token TIS weights, and a sequence whose geometric-mean ratio ``exp(mean_t log r_t)`` leaves
              ``[reject_low, reject_high]`` is masked (MIS ``rs_level: geometric``; 0.9999 / 1.0001)
    seq-mask  the same with the whole sequence's ratio ``prod_t r_t`` (MIS ``rs_level: sequence``; 0.5 / 2)

In both masking modes a sequence holding one token with ``r_t < veto_threshold`` is masked too (MIS
``rs_veto_threshold``, 1e-4). ``opsm`` (DeepSeek-V3.2's off-policy sequence masking, Miles ``--use-opsm
--opsm-delta``) combines with any mode: a sequence with a negative advantage whose mean ``behaviour_lp -
current_lp`` exceeds ``opsm_delta`` is masked. The behaviour policy is the rollout engine, which really sampled
the tokens (Miles with ``--use-rollout-logprobs``; without it Miles compares against the trainer's own old
logprobs, which with one optimizer step per rollout equal the current ones, so its OPSM never masks).

A masked token gets weight 0 but stays in the loss's denominator, as in Miles ("modified masks correct the
numerator only"). Sequence-level log-ratios are clamped to +-20 before ``exp``, as Miles' MIS does.

    >>> import torch
    >>> train, rollout = torch.tensor([[0.0, -0.1]]), torch.tensor([[0.0, 0.0]])
    >>> result = apply_correction(RolloutCorrection(mode="icepop"), train, rollout, torch.ones(1, 2))
    >>> result.weights
    tensor([[1.0000, 0.9048]])
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from rl.correction_setting import MODES, RolloutCorrection

__all__ = ["MODES", "CorrectionResult", "RolloutCorrection", "apply_correction", "opsm_keep",
           "rejection_keep", "sequence_is", "sequence_log_ratio", "token_mask", "token_truncate",
           "train_rollout_kl"]

SAFETY_BOUND = 20.0
"""Sequence-level log-ratios are clamped to this before exp (Miles' MIS value): a long sequence's summed
log-ratio would overflow otherwise."""


# --------------------------------------------------------------------------- token level


def _check(train_lp: Tensor, rollout_lp: Tensor, mask: Tensor | None) -> Tensor:
    if train_lp.shape != rollout_lp.shape:
        raise ValueError(f"train_logprobs shape {tuple(train_lp.shape)} != rollout_logprobs shape "
                         f"{tuple(rollout_lp.shape)}: both must score the same response tokens")
    if mask is None:
        return torch.ones_like(train_lp, dtype=torch.bool)
    if mask.shape != train_lp.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != logprobs shape {tuple(train_lp.shape)}")
    return mask.to(torch.bool)


def _log_ratio(train_lp: Tensor, rollout_lp: Tensor, mask: Tensor) -> Tensor:
    """``train_lp - rollout_lp`` in float32, detached, 0 at masked positions (padding may hold garbage, even inf)."""
    diff = train_lp.detach().float() - rollout_lp.detach().float()
    return torch.where(mask, diff, torch.zeros_like(diff))


def token_truncate(train_lp: Tensor, rollout_lp: Tensor, mask: Tensor | None = None, *, clip_low: float = 0.0,
                   clip_high: float = 2.0) -> tuple[Tensor, Tensor]:
    """(weights, clipped): ``clamp(r_t, clip_low, clip_high)`` per token, 0 at masked positions; ``clipped`` marks
    unmasked tokens whose raw ratio lay outside the bounds (or was NaN).

    >>> w, clipped = token_truncate(torch.tensor([0.0, 1.0]), torch.zeros(2))
    >>> w, clipped
    (tensor([1., 2.]), tensor([False,  True]))
    """
    m = _check(train_lp, rollout_lp, mask)
    if not 0.0 <= clip_low <= clip_high:
        raise ValueError(f"need 0 <= clip_low <= clip_high, got clip_low={clip_low}, clip_high={clip_high}")
    with torch.no_grad():
        raw = torch.exp(train_lp.detach().float() - rollout_lp.detach().float())
        clipped = ((raw < clip_low) | (raw > clip_high) | torch.isnan(raw)) & m
        w = torch.where(m, raw.clamp(min=clip_low, max=clip_high), torch.zeros_like(raw))
    return w, clipped


def token_mask(train_lp: Tensor, rollout_lp: Tensor, mask: Tensor | None = None, *, clip_low: float = 0.5,
               clip_high: float = 2.0) -> tuple[Tensor, Tensor]:
    """(weights, rejected): IcePop. ``r_t`` where ``clip_low <= r_t <= clip_high``, else 0; ``rejected`` marks the
    zeroed unmasked tokens.

    >>> token_mask(torch.tensor([0.0, 1.0, -1.0]), torch.zeros(3))[0]
    tensor([1., 0., 0.])
    """
    m = _check(train_lp, rollout_lp, mask)
    with torch.no_grad():
        raw = torch.exp(_log_ratio(train_lp, rollout_lp, m))
        keep = (raw >= clip_low) & (raw <= clip_high) & m
        w = torch.where(keep, raw, torch.zeros_like(raw))
    return w, m & ~keep


# --------------------------------------------------------------------------- sequence level


def _rows(x: Tensor, name: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be [sequences, tokens] (right-padded, masked) for a sequence-level correction, "
                         f"got shape {tuple(x.shape)}")


def sequence_log_ratio(train_lp: Tensor, rollout_lp: Tensor, mask: Tensor, level: str) -> Tensor:
    """Per sequence (rows of ``[B, T]``), broadcast over its tokens: ``sum_t log r_t`` (``sequence``) or its mean
    over the sequence's unmasked tokens (``geometric``).

    >>> sequence_log_ratio(torch.tensor([[0.2, 0.4]]), torch.zeros(1, 2), torch.tensor([[1, 1]]), "geometric")
    tensor([[0.3000, 0.3000]])
    """
    m = _check(train_lp, rollout_lp, mask)
    _rows(train_lp, "train_logprobs")
    diff = _log_ratio(train_lp, rollout_lp, m)
    total = diff.sum(dim=1, keepdim=True)
    if level == "sequence":
        per_row = total
    elif level == "geometric":
        per_row = total / m.sum(dim=1, keepdim=True).clamp(min=1)
    else:
        raise ValueError(f"level {level!r} is not sequence or geometric")
    return per_row.expand_as(diff)


def sequence_is(train_lp: Tensor, rollout_lp: Tensor, mask: Tensor, *, clip_low: float = 0.0,
                clip_high: float = 2.0) -> tuple[Tensor, Tensor]:
    """(weights, clipped): one weight per sequence, ``clamp(exp(clamp(sum_t log r_t, +-20)), clip_low, clip_high)``
    on its unmasked tokens (0 elsewhere); ``clipped`` marks the unmasked tokens of sequences whose ratio was bounded.

    >>> sequence_is(torch.tensor([[0.5, 0.5], [0.1, -0.1]]), torch.zeros(2, 2), torch.ones(2, 2))[0]
    tensor([[2., 2.],
            [1., 1.]])
    """
    m = _check(train_lp, rollout_lp, mask)
    with torch.no_grad():
        ratio = torch.exp(sequence_log_ratio(train_lp, rollout_lp, m, "sequence").clamp(-SAFETY_BOUND, SAFETY_BOUND))
        clipped = ((ratio < clip_low) | (ratio > clip_high)) & m
        w = torch.where(m, ratio.clamp(min=clip_low, max=clip_high), torch.zeros_like(ratio))
    return w, clipped


def rejection_keep(train_lp: Tensor, rollout_lp: Tensor, mask: Tensor, *, level: str, reject_low: float,
                   reject_high: float, veto_threshold: float | None = 1e-4) -> tuple[Tensor, dict[str, Tensor]]:
    """(keep, why): ``keep`` is False on every token of a sequence whose ``level`` ratio (``sequence``: the
    product, ``geometric``: the geometric mean) leaves ``[reject_low, reject_high]``, or that holds a token with
    ``r_t < veto_threshold``; ``why`` holds the token-shaped reasons ``low``, ``high``, ``catastrophic_token`` and
    ``catastrophic_seq`` (Miles' MIS metrics before reduction).

    >>> keep, _ = rejection_keep(torch.tensor([[0.0, 0.0], [0.0, -10.0]]), torch.zeros(2, 2), torch.ones(2, 2),
    ...                          level="geometric", reject_low=0.5, reject_high=2.0)
    >>> keep
    tensor([[ True,  True],
            [False, False]])
    """
    m = _check(train_lp, rollout_lp, mask)
    with torch.no_grad():
        ratio = torch.exp(sequence_log_ratio(train_lp, rollout_lp, m, level).clamp(-SAFETY_BOUND, SAFETY_BOUND))
        low, high = (ratio < reject_low) & m, (ratio > reject_high) & m
        if veto_threshold is None:
            catastrophic = torch.zeros_like(m)
        else:
            catastrophic = (_log_ratio(train_lp, rollout_lp, m) < math.log(veto_threshold)) & m
        vetoed = catastrophic.any(dim=1, keepdim=True).expand_as(m) & m
        keep = m & ~low & ~high & ~vetoed
    return keep, {"low": low, "high": high, "catastrophic_token": catastrophic, "catastrophic_seq": vetoed}


def opsm_keep(current_lp: Tensor, behaviour_lp: Tensor, advantages: Tensor, mask: Tensor, *,
              delta: float = 1e-4) -> Tensor:
    """OPSM: False on every token of a sequence with ``advantage < 0`` whose mean ``behaviour_lp - current_lp``
    over its unmasked tokens exceeds ``delta``; ``advantages`` is one per sequence (``[B]``).

    >>> opsm_keep(torch.zeros(2, 2), torch.full((2, 2), 0.1), torch.tensor([-1.0, 1.0]), torch.ones(2, 2))
    tensor([[False, False],
            [ True,  True]])
    """
    m = _check(current_lp, behaviour_lp, mask)
    _rows(current_lp, "logprobs")
    if advantages.shape != current_lp.shape[:1]:
        raise ValueError(f"advantages shape {tuple(advantages.shape)} != one per sequence "
                         f"{tuple(current_lp.shape[:1])}")
    with torch.no_grad():
        seq_kl = -sequence_log_ratio(current_lp, behaviour_lp, m, "geometric")[:, 0]
        masked = (advantages.detach().float() < 0) & (seq_kl > delta)
    return m & ~masked[:, None]


def train_rollout_kl(train_lp: Tensor, rollout_lp: Tensor, mask: Tensor | None = None) -> Tensor:
    """Per token ``KL(rollout || train)`` by Schulman's k3 with ``d = train_lp - rollout_lp`` clamped to +-20 and the
    result to [-10, 10] (what Miles reports, averaged, as ``train/train_rollout_kl``); 0 at masked positions."""
    m = _check(train_lp, rollout_lp, mask)
    d = _log_ratio(train_lp, rollout_lp, m).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return torch.where(m, (torch.exp(d) - 1.0 - d).clamp(-10.0, 10.0), torch.zeros_like(d))


# --------------------------------------------------------------------------- one call for the trainer


class CorrectionResult(NamedTuple):
    weights: Tensor | None
    """Per-token weight for the policy loss (0 where masked, by the mode or OPSM); None for mode none without
    OPSM (every weight 1)."""
    token_metrics: dict[str, float]
    """Means over the batch's unmasked tokens (combine micro-batches weighted by their token counts)."""
    sequence_metrics: dict[str, float]
    """Shares of the batch's sequences (combine micro-batches weighted by their sequence counts)."""


def apply_correction(setting: RolloutCorrection, train_lp: Tensor, rollout_lp: Tensor, mask: Tensor,
                     advantages: Tensor | None = None) -> CorrectionResult:
    """The loss weights and metrics of ``setting`` on ``[B, T]`` logprobs (rows = sequences, ``mask`` marks response
    tokens). ``train_lp`` are the trainer's (old) logprobs, ``rollout_lp`` the engine's; ``advantages`` (one per
    sequence) only with OPSM. Metric names are Miles' (without ``train/``) where Miles has one; see
    docs/rollout-correction.md for the list per mode.
    """
    m = _check(train_lp, rollout_lp, mask)
    _rows(train_lp, "train_logprobs")
    mode, (low, high) = setting.mode, setting.clip_bounds
    n_tok = int(m.sum())
    rows = m.any(dim=1)
    n_seq = int(rows.sum())

    def token_share(x: Tensor) -> float:
        return float((x & m).sum()) / n_tok if n_tok else 0.0

    def seq_share(x: Tensor) -> float:
        return float((x.any(dim=1) & rows).sum()) / n_seq if n_seq else 0.0

    with torch.no_grad():
        diff = _log_ratio(train_lp, rollout_lp, m)
        raw = torch.exp(diff)
        tokens: dict[str, float] = {
            "tis": float(raw[m].mean()) if n_tok else 0.0,
            "tis_abs": float((raw - 1.0)[m].abs().mean()) if n_tok else 0.0,
            "train_rollout_logprob_abs_diff": float(diff[m].abs().mean()) if n_tok else 0.0,
            "train_rollout_kl": float(train_rollout_kl(train_lp, rollout_lp, m).sum()) / n_tok if n_tok else 0.0,
        }
        sequences: dict[str, float] = {}
        weights: Tensor | None
        if mode == "none":
            weights = m.float() if setting.opsm else None
        elif mode == "tis":
            weights, clipped = token_truncate(train_lp, rollout_lp, m, clip_low=low, clip_high=high)
            tokens["tis_clipfrac"] = token_share(clipped)
        elif mode == "icepop":
            weights, rejected = token_mask(train_lp, rollout_lp, m, clip_low=low, clip_high=high)
            tokens["tis_clipfrac"] = token_share(rejected)
        elif mode == "seq-is":
            weights, clipped = sequence_is(train_lp, rollout_lp, m, clip_low=low, clip_high=high)
            tokens["mis_tis_truncate_fraction"] = token_share(clipped)
        else:
            weights, clipped = token_truncate(train_lp, rollout_lp, m, clip_low=low, clip_high=high)
            rlow, rhigh = setting.reject_bounds
            keep, why = rejection_keep(train_lp, rollout_lp, m, level="geometric" if mode == "geo-mask" else "sequence",
                                       reject_low=rlow, reject_high=rhigh, veto_threshold=setting.veto_threshold)
            weights = torch.where(keep, weights, torch.zeros_like(weights))
            tokens.update({"mis_tis_truncate_fraction": token_share(clipped),
                           "mis_rs_mask_fraction_low": token_share(why["low"]),
                           "mis_rs_mask_fraction_high": token_share(why["high"]),
                           "mis_rs_catastrophic_token_fraction": token_share(why["catastrophic_token"])})
            sequences["mis_rs_catastrophic_seq_fraction"] = seq_share(why["catastrophic_seq"])
        if setting.opsm:
            if advantages is None:
                raise ValueError("OPSM needs the advantages (one per sequence); pass advantages= or turn opsm off")
            keep = opsm_keep(train_lp, rollout_lp, advantages, m, delta=setting.opsm_delta)
            sequences["opsm_clipfrac"] = seq_share(m & ~keep)
            weights = torch.where(keep, weights, torch.zeros_like(weights))
        if weights is not None:
            dropped = m & (weights == 0)
            tokens["correction_masked_token_frac"] = token_share(dropped)
            tokens["correction_weight_mean"] = float(weights[m].mean()) if n_tok else 0.0
            sequences["correction_masked_seq_frac"] = (float(((dropped | ~m).all(dim=1) & rows).sum()) / n_seq
                                                       if n_seq else 0.0)
    return CorrectionResult(weights, tokens, sequences)
