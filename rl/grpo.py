"""GRPO with truncated importance sampling (TIS): the algorithm as pure torch functions.

What it does
    One GRPO step, read top to bottom (the trainer supplies the logprobs):

    1. ``group_advantages(rewards [G, n])``: each sample's reward minus its group's mean,
       divided by the group's standard deviation (+ eps). Every token of a response gets its
       sequence's advantage.
    2. ``tis_weights(train_lp, rollout_lp, mask)``: the rollout engine (FP8) and the trainer
       (BF16) disagree slightly on token probabilities; tokens were *sampled* from the rollout
       engine's distribution, so each token's loss is reweighted by
       ``w = clamp(exp(train_lp - rollout_lp), clip_low, clip_high)`` (detached; Miles
       ``--use-tis --tis-clip 2 --tis-clip-low 0``). The other corrections (IcePop, sequence IS,
       geometric / sequence masking, OPSM) are in :mod:`rl.corrections`, chosen by
       ``GRPOConfig.rollout_correction``.
    3. ``policy_loss(lp, old_lp, adv, mask, tis_weights=w)``: PPO/DAPO clipped surrogate with
       the asymmetric "clip-higher" range ``[1 - 0.2, 1 + 0.28]``, times the TIS weight,
       aggregated as ``GRPOConfig.loss_aggregation`` says (rl/loss_setting.py: each sample's token
       mean averaged over the samples, Miles' default, or the mean over every token of the step,
       DAPO's), plus an optional KL penalty to a reference policy.

    ``GRPOConfig`` holds the loss knobs the trainer reads, with Miles' defaults for DeepSeek-V4 Flash;
    ``grpo_loss`` is steps 2 and 3 on one micro-batch, as the trainer runs them, and ``step_denominator``
    what it divides by so that the micro-batches add up to the step's loss. tests/conformance/
    test_miles_loss_parity.py and tests/test_trl_loss_parity.py check both against Miles' and TRL's own code.

Which logprobs go where (as in Miles / slime)
    ``old_logprobs`` are the trainer's own logprobs of the rollout tokens under the weights
    that generated them (recomputed once before the first minibatch; with one optimizer step
    per rollout they equal ``logprobs.detach()`` and the PPO ratio is exactly 1, so the clip
    is inert). ``rollout_logprobs`` are the rollout engine's logprobs of the same tokens.
    TIS corrects the engine mismatch (``old`` vs ``rollout``); the PPO ratio corrects policy
    staleness across minibatches (``current`` vs ``old``).

What it deliberately leaves out
    Entropy (the trainer computes it from logits), sequence packing, value functions, GSPO,
    Dr.GRPO loss variants. Metric names are Miles' without the ``train/`` prefix.

How to run
    >>> import torch
    >>> from rl.grpo import group_advantages, policy_loss
    >>> adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    >>> adv
    tensor([[ 0.8660, -0.8660, -0.8660,  0.8660]])
    >>> lp = torch.full((4, 3), -1.0, requires_grad=True)
    >>> loss, m = policy_loss(lp, lp.detach(), adv[0], torch.ones(4, 3))
    >>> round(m["pg_loss"], 6), m["pg_clipfrac"]
    (0.0, 0.0)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from rl.correction_setting import RolloutCorrection
from rl.corrections import CorrectionResult, apply_correction, token_truncate
from rl.loss_setting import DEFAULT_LOSS_AGGREGATION, LossAggregation, check_loss_aggregation

__all__ = [
    "KL_TYPES",
    "GRPOConfig",
    "approx_kl",
    "group_advantages",
    "grpo_loss",
    "policy_loss",
    "step_denominator",
    "tis_metrics",
    "tis_weights",
]

KL_TYPES: tuple[str, ...] = ("k1", "k2", "k3", "low_var_kl")
"""KL estimators accepted by :func:`approx_kl` (``k3`` and ``low_var_kl`` are the same estimator;
``low_var_kl`` is additionally clamped to [-10, 10] as verl and Miles do)."""


# --------------------------------------------------------------------------- config


@dataclass(kw_only=True)
class GRPOConfig:
    """The loss knobs of GRPO + TIS the trainer reads in each step. Defaults follow the seed's Miles recipe for
    DeepSeek-V4 Flash (``--eps-clip 0.2 --eps-clip-high 0.28 --use-tis --tis-clip 2 --tis-clip-low 0``).

    Only what :meth:`engines.train.trainer.Trainer.grpo_step` reads lives here; the rest of a run has one home
    each: the group size, dynamic sampling and std normalisation in :class:`rl.loop.LoopConfig`, the learning rate
    in ``TrainerConfig`` (from ``TrainRunConfig.lr``), the run's numbers in the tiny-cpu preset
    (``engines.presets.runs.TINY_RUN``). There is no KL penalty: the trainer keeps no reference model
    (``policy_loss`` takes one for callers that do).

    Invalid values raise ``ValueError`` at construction, naming the field and the fix.

    >>> GRPOConfig().clip_high
    0.28
    """

    clip_low: float = 0.2
    """PPO ratio lower clip: ratios below ``1 - clip_low`` stop pushing down a token with a
    negative advantage. In [0, 1)."""

    clip_high: float = 0.28
    """PPO ratio upper clip (DAPO clip-higher): ratios above ``1 + clip_high`` stop pushing up a
    token with a positive advantage. Larger than ``clip_low`` so rare good tokens can grow (keeps
    entropy from collapsing). >= 0."""

    rollout_correction: RolloutCorrection = field(default_factory=RolloutCorrection)
    """How the loss corrects the train/rollout mismatch (:mod:`rl.corrections`): token TIS with the seed's clamp
    [0, 2] by default; also none, icepop, seq-is, geo-mask, seq-mask, and OPSM on top of any. A mode name or a
    mapping of its fields is accepted too (config.json, Ray actor arguments)."""

    max_grad_norm: float = 1.0
    """Gradient-norm clip (Megatron's ``--clip-grad`` default); 0 disables clipping. >= 0."""

    loss_aggregation: LossAggregation = DEFAULT_LOSS_AGGREGATION
    """sample-mean (each sample's token mean, averaged over the step's samples: Miles' default, what the cluster
    job trains) or token-mean (the mean over all the step's tokens: Miles --calculate-per-token-loss, TRL's dapo);
    rl/loss_setting.py."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(
                f"clip_low={self.clip_low} must lie in [0, 1): the lower ratio bound 1 - clip_low has to stay "
                "positive. Use 0.2 (PPO/DAPO default)."
            )
        if self.clip_high < 0.0:
            raise ValueError(
                f"clip_high={self.clip_high} must be >= 0 (the upper ratio bound is 1 + clip_high). Use 0.28 "
                "(DAPO clip-higher)."
            )
        self.rollout_correction = RolloutCorrection.coerce(self.rollout_correction)
        if self.max_grad_norm < 0.0:
            raise ValueError(f"max_grad_norm={self.max_grad_norm} must be >= 0 (0 disables clipping).")
        self.loss_aggregation = check_loss_aggregation(self.loss_aggregation, "GRPOConfig.loss_aggregation")


# --------------------------------------------------------------------------- advantages


def group_advantages(rewards: Tensor, *, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Group-relative advantages, one per sample: ``A_ij = (r_ij - mean_j r_ij) / (std_j r_ij + eps)``.

    ``rewards`` is ``[G, n]``: G prompts (groups), n samples each. ``std`` is the *unbiased*
    (Bessel, ``n - 1``) standard deviation, as ``torch.std`` computes it in Miles/slime, verl
    and TRL, so the values match theirs. With ``normalize_std=False`` the result is just
    ``r - mean`` (Dr.GRPO). A group whose rewards are all equal gets exactly 0 (no signal),
    whatever its reward value and float rounding. Computed in float64, returned as float32.

    >>> group_advantages(torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 3.0]]))
    tensor([[ 0.0000,  0.0000,  0.0000],
            [-0.5773, -0.5773,  1.1547]])
    >>> group_advantages(torch.tensor([[0.0, 0.0, 3.0]]), normalize_std=False)
    tensor([[-1., -1.,  2.]])
    """
    if rewards.dim() != 2:
        raise ValueError(
            f"rewards must be [num_groups, n_samples_per_prompt], got shape {tuple(rewards.shape)}; "
            "reshape a flat list with rewards.reshape(-1, n_samples_per_prompt) (samples of one prompt adjacent)"
        )
    if rewards.shape[1] < 2:
        raise ValueError(
            f"each group needs at least 2 samples for a baseline, got n={rewards.shape[1]}; "
            "sample n_samples_per_prompt >= 2 responses per prompt"
        )
    r = rewards.detach().to(torch.float64)
    if not torch.isfinite(r).all():
        bad = (~torch.isfinite(r)).any(dim=1).nonzero().flatten().tolist()
        raise ValueError(
            f"non-finite rewards in groups {bad[:10]}: a NaN/inf reward would poison every advantage of its "
            "group; give unscorable samples a finite reward (e.g. 0) or drop their groups before this call"
        )
    centred = r - r.mean(dim=1, keepdim=True)
    constant = (r.amax(dim=1) == r.amin(dim=1)).unsqueeze(1)
    centred = torch.where(constant, torch.zeros_like(centred), centred)
    if normalize_std:
        centred = centred / (r.std(dim=1, keepdim=True) + eps)
    return centred.to(torch.float32)


# --------------------------------------------------------------------------- TIS


def _as_mask(mask: Tensor | None, like: Tensor) -> Tensor:
    """Boolean mask shaped like ``like`` (all True when ``mask`` is None)."""
    if mask is None:
        return torch.ones_like(like, dtype=torch.bool)
    if mask.shape != like.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != logprobs shape {tuple(like.shape)}")
    return mask.to(torch.bool)


def tis_weights(
    train_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor | None = None,
    *,
    clip_high: float = 2.0,
    clip_low: float = 0.0,
) -> tuple[Tensor, float]:
    """Truncated importance-sampling weights ``w = clamp(exp(train_lp - rollout_lp), clip_low, clip_high)``.

    Per token, detached (the weight rescales the gradient, it is not optimised). Returns
    ``(weights, clipfrac)``: ``weights`` in float32, 0 at masked-out positions (padding logprobs
    may be garbage, even inf); ``clipfrac`` is the fraction of unmasked tokens whose raw ratio
    lay outside ``[clip_low, clip_high]`` (Miles ``train/tis_clipfrac``; 0.0 for an empty mask).

    >>> w, frac = tis_weights(torch.tensor([0.0, 1.0, -0.5]), torch.tensor([0.0, 0.0, 0.0]))
    >>> w, round(frac, 4)
    (tensor([1.0000, 2.0000, 0.6065]), 0.3333)
    """
    w, clipped = token_truncate(train_logprobs, rollout_logprobs, mask, clip_low=clip_low, clip_high=clip_high)
    n = int(_as_mask(mask, train_logprobs).sum())
    return w, float(clipped.sum()) / n if n else 0.0


def tis_metrics(
    train_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor | None = None,
    *,
    clip_high: float = 2.0,
    clip_low: float = 0.0,
) -> dict[str, float]:
    """Train-vs-rollout mismatch metrics over unmasked tokens, Miles names without ``train/``:

    ``tis`` (mean raw ratio ``exp(train_lp - rollout_lp)``), ``tis_clipfrac`` (share outside the
    clamp), ``tis_abs`` (mean ``|ratio - 1|``), ``train_rollout_logprob_abs_diff`` (mean
    ``|train_lp - rollout_lp|``). All 0.0 for an empty mask.

    >>> tis_metrics(torch.tensor([0.0, 0.0]), torch.tensor([0.0, 0.0]))
    {'tis': 1.0, 'tis_clipfrac': 0.0, 'tis_abs': 0.0, 'train_rollout_logprob_abs_diff': 0.0}
    """
    _, clipfrac = tis_weights(train_logprobs, rollout_logprobs, mask, clip_high=clip_high, clip_low=clip_low)
    m = _as_mask(mask, train_logprobs)
    with torch.no_grad():
        diff = (train_logprobs.detach().double() - rollout_logprobs.detach().double())[m]
        if diff.numel() == 0:
            return {"tis": 0.0, "tis_clipfrac": 0.0, "tis_abs": 0.0, "train_rollout_logprob_abs_diff": 0.0}
        ratio = diff.exp()
        return {
            "tis": float(ratio.mean()),
            "tis_clipfrac": clipfrac,
            "tis_abs": float((ratio - 1.0).abs().mean()),
            "train_rollout_logprob_abs_diff": float(diff.abs().mean()),
        }


# --------------------------------------------------------------------------- loss


def approx_kl(logprobs: Tensor, ref_logprobs: Tensor, kl_type: str = "low_var_kl") -> Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` from sampled-token logprobs (Schulman's k1/k2/k3).

    With ``d = ref_lp - lp``: ``k1 = -d``, ``k2 = d**2 / 2``, ``k3 = exp(d) - 1 - d`` (non-negative,
    unbiased, low variance). ``low_var_kl`` is k3 with ``d`` clamped to [-20, 20] before ``exp``
    and the result clamped to [-10, 10], as verl's ``low_var_kl`` (Miles clamps the result too).

    >>> approx_kl(torch.tensor([0.0, -1.0]), torch.tensor([0.0, 0.0]))
    tensor([0.0000, 0.7183])
    """
    if kl_type not in KL_TYPES:
        raise ValueError(f"kl_type={kl_type!r} is not one of {KL_TYPES}")
    d = ref_logprobs.float() - logprobs.float()
    if kl_type == "k1":
        return -d
    if kl_type == "k2":
        return 0.5 * d * d
    if kl_type == "low_var_kl":
        d = d.clamp(min=-20.0, max=20.0)
        return (torch.exp(d) - 1.0 - d).clamp(min=-10.0, max=10.0)
    return torch.exp(d) - 1.0 - d


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    tis_weights: Tensor | None = None,
    kl_coef: float = 0.0,
    ref_logprobs: Tensor | None = None,
    kl_type: str = "low_var_kl",
    aggregation: LossAggregation = "token-mean",
    loss_denominator: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped GRPO surrogate (DAPO clip-higher), optionally TIS-weighted, plus KL, aggregated per token or
    per sample.

    Per response token t, with ``ratio = exp(lp - old_lp)`` and advantage ``A``::

        pg_t   = max(-A * ratio, -A * clamp(ratio, 1 - clip_low, 1 + clip_high)) * w_t
        kl_t   = approx_kl(lp, ref_lp, kl_type)                      (only with ref_logprobs)
        loss   = R(pg) + kl_coef * R(kl)

    where ``w_t`` are the TIS weights (1 when None) and the reduction ``R`` is ``aggregation``'s
    (rl/loss_setting.py):

        token-mean    R(x) = sum_t mask_t * x_t / D, D = the number of unmasked tokens of the
                      batch (DAPO: long responses weigh in proportion to their length)
        sample-mean   R(x) = sum_i (sum_t mask_it * x_it / max(1, sum_t mask_it)) / D, D = the
                      number of rows (samples) of the batch (Miles' default ``sum_of_sample_mean``)

    ``loss_denominator`` replaces ``D``: pass the whole step's (``step_denominator``) when
    accumulating gradients over micro-batches, so the summed micro-batch losses (and metrics)
    equal the step's.

    Shapes: ``logprobs``, ``old_logprobs``, ``mask`` (and ``tis_weights``, ``ref_logprobs``) are
    the same shape, e.g. ``[B, T]`` padded or ``[N]`` packed (token-mean only: sample-mean needs
    rows). ``advantages`` is per token (same shape) or per sequence (``[B]`` for ``[B, T]``,
    broadcast along T). Masked-out positions never reach the loss or its gradient, even when
    they hold NaN/inf.

    Returns ``(loss, metrics)``; ``loss`` is a 0-dim float32 tensor with grad; ``metrics`` are
    floats with Miles names without ``train/``: ``loss``, ``pg_loss``, ``pg_clipfrac`` (share of
    tokens where the clipped branch is taken), ``ppo_kl`` (mean ``old_lp - lp``), and ``kl_loss``
    when ``ref_logprobs`` is given.

    >>> lp = torch.zeros(1, 2, requires_grad=True)
    >>> loss, m = policy_loss(lp, torch.zeros(1, 2), torch.tensor([1.0]), torch.tensor([[1, 0]]))
    >>> loss.backward(); lp.grad
    tensor([[-1.,  0.]])
    """
    if old_logprobs.shape != logprobs.shape:
        raise ValueError(f"old_logprobs shape {tuple(old_logprobs.shape)} != logprobs shape {tuple(logprobs.shape)}")
    m = _as_mask(mask, logprobs)
    if advantages.dim() == logprobs.dim() - 1 and advantages.shape == logprobs.shape[:-1]:
        advantages = advantages.unsqueeze(-1)
    elif advantages.shape != logprobs.shape:
        raise ValueError(
            f"advantages shape {tuple(advantages.shape)} fits neither per token {tuple(logprobs.shape)} nor per "
            f"sequence {tuple(logprobs.shape[:-1])}"
        )
    if tis_weights is not None and tis_weights.shape != logprobs.shape:
        raise ValueError(f"tis_weights shape {tuple(tis_weights.shape)} != logprobs shape {tuple(logprobs.shape)}")
    if kl_coef < 0.0:
        raise ValueError(f"kl_coef={kl_coef} must be >= 0")
    if kl_coef > 0.0 and ref_logprobs is None:
        raise ValueError(
            f"kl_coef={kl_coef} > 0 needs ref_logprobs (the reference model's logprobs of the same tokens); "
            "pass them or set kl_coef=0"
        )
    if ref_logprobs is not None and ref_logprobs.shape != logprobs.shape:
        raise ValueError(f"ref_logprobs shape {tuple(ref_logprobs.shape)} != logprobs shape {tuple(logprobs.shape)}")
    if not (0.0 <= clip_low < 1.0 and clip_high >= 0.0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got clip_low={clip_low}, clip_high={clip_high}")
    check_loss_aggregation(aggregation, "aggregation")
    per_sample = aggregation == "sample-mean"
    if per_sample and logprobs.dim() < 2:
        raise ValueError(f"sample-mean needs logprobs as [samples, tokens] (one row per sample), got shape "
                         f"{tuple(logprobs.shape)}; pad the batch into rows or aggregate token-mean")

    lp = logprobs.float()
    adv = advantages.detach().float()
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    if loss_denominator is None:
        denom = torch.tensor(float(m.shape[:-1].numel()), dtype=lp.dtype) if per_sample else m.sum().clamp(min=1)
        denom = denom.to(dtype=lp.dtype, device=lp.device)
    else:
        if not loss_denominator > 0:
            raise ValueError(f"loss_denominator={loss_denominator} must be > 0 (the step's {aggregation} "
                             "denominator: step_denominator)")
        denom = torch.tensor(float(loss_denominator), dtype=lp.dtype, device=lp.device)
    row_tokens = m.sum(dim=-1).clamp(min=1).to(lp.dtype) if per_sample else None

    def masked_sum(x: Tensor) -> Tensor:
        """The aggregation's numerator: the masked sum, of each row's mean for sample-mean."""
        kept = torch.where(m, x, zero)
        return (kept.sum(dim=-1) / row_tokens).sum() if per_sample else kept.sum()

    log_ratio = lp - old_logprobs.detach().float()
    ratio = torch.exp(torch.where(m, log_ratio, zero))
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(pg1, pg2)
    if tis_weights is not None:
        pg = pg * tis_weights.detach().float()
    pg_loss = masked_sum(pg) / denom
    loss = pg_loss
    with torch.no_grad():
        metrics = {
            "pg_loss": float(pg_loss.detach()),
            "pg_clipfrac": float(masked_sum((pg2 > pg1).float()) / denom),
            "ppo_kl": float(masked_sum(-log_ratio) / denom),
        }
    if ref_logprobs is not None:
        # Masked positions go in as 0 - 0 so garbage there cannot turn the gradient into NaN.
        kl = approx_kl(torch.where(m, lp, zero), torch.where(m, ref_logprobs.detach().float(), zero), kl_type)
        kl_loss = masked_sum(kl) / denom
        if kl_coef > 0.0:
            loss = loss + kl_coef * kl_loss
        metrics["kl_loss"] = float(kl_loss.detach())
    metrics["loss"] = float(loss.detach())
    return loss, metrics


# --------------------------------------------------------------------------- one micro-batch of a step


def step_denominator(aggregation: LossAggregation, loss_tokens: list[int]) -> float:
    """What every micro-batch of a step divides its loss by so that they add up to the step's loss, from each
    sample's loss-token count (the trainer's: its response length): the step's loss tokens (token-mean) or its
    samples (sample-mean; all of them, an empty response included, as Miles divides by the step's rollout count).

    >>> step_denominator("token-mean", [3, 5, 0]), step_denominator("sample-mean", [3, 5, 0])
    (8.0, 3.0)
    """
    if check_loss_aggregation(aggregation) == "token-mean":
        return float(sum(loss_tokens))
    return float(len(loss_tokens))


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: GRPOConfig,
    *,
    denominator: float,
) -> tuple[Tensor, dict[str, float], CorrectionResult]:
    """One micro-batch's share of a step's loss, as the trainer computes it: ``config.rollout_correction``'s
    weights from the trainer's (old) and the rollout engine's logprobs (:func:`rl.corrections.apply_correction`),
    then :func:`policy_loss` with the config's clip range and aggregation over ``denominator`` (the step's,
    :func:`step_denominator`). Tensors are ``[B, T]`` (rows = samples, ``mask`` their response tokens),
    ``advantages`` one per sample. Returns ``(loss, policy metrics, correction)``.

    >>> lp = torch.tensor([[-1.0, -2.0], [-1.0, 0.0]], requires_grad=True)
    >>> mask = torch.tensor([[True, True], [True, False]])
    >>> loss, _, _ = grpo_loss(lp, lp.detach(), lp.detach(), torch.tensor([1.0, -1.0]), mask, GRPOConfig(),
    ...                        denominator=2.0)
    >>> loss.backward(); lp.grad
    tensor([[-0.2500, -0.2500],
            [ 0.5000,  0.0000]])
    """
    correction = apply_correction(config.rollout_correction, old_logprobs, rollout_logprobs, mask, advantages)
    loss, metrics = policy_loss(logprobs, old_logprobs, advantages, mask, clip_low=config.clip_low,
                                clip_high=config.clip_high, tis_weights=correction.weights,
                                aggregation=config.loss_aggregation, loss_denominator=denominator)
    return loss, metrics, correction
