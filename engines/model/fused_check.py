"""Whether the fused kernels compute what the torch ops compute, judged once per model config, never on live weights.

For a model config, a synthetic model of that shape (weights drawn from a fixed seed, scaled so activations are of
order one) runs three ways, on a synthetic decode batch that reaches every branch of a decode step (window rings
not yet full and wrapped, windows closing in this step, CSA rows with more entries than index_topk, rows before
their first CSA overlap) and on a prefill of random tokens past every compress rate:

  reference  the torch ops in float64 (`Float64Reference`: every float32 operand, cast and dtype promoted),
  torch      the torch ops in float32 (what the engine runs without the fused kernels),
  fused      the fused kernels (float32, the torch ops' formulas, sums in another order).

For every compared output (decode and prefill log-probabilities, every decode cache field), the fused result's
largest distance from the reference must be at most ERROR_FACTOR times the torch ops' largest distance from it
(that distance taken as at least one float32 ulp of the output's largest entry); integer fields and infinities
must be equal. So the bound is the torch ops' own float32 error on the same numbers, whatever its size (sharp
distributions widen both paths' errors alike), and a kernel bug (a wrong factor, a wrong index, a missed branch)
shows up far outside it. A router or indexer top-k decision within NEAR_TIE of a tie in float64 is a coin toss
for any float32 path, so the rows that hang on it are not compared (the result says how many rows were). The
weights never come from the model being served, so trained weights cannot switch a run to the torch ops; `FusedModel.usable` runs this once per config in a process and
`fused.status()` reports the result (`checked`) and its numbers (`check_details`).

    result = check_config(cfg)   # CheckResult(passed, problem, worst_ratio, worst_output, rows_judged, seconds)
    .venv/bin/python -m pytest tests/test_fused_check.py -q
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from engines.model import fused
from engines.model.config import CSA, SLIDING
from engines.model.decode_batch import CompressorSlots, DecodeBatch, LayerSlots

ERROR_FACTOR = 8.0
"""How much further from float64 the fused result may be than the torch ops' float32 result is (largest distance
over an output). Measured on the tiny-cpu shape and the four of `v4rl bench rollout --config-sweep`, three seeds
each: 1.4 to 2.8 (both are float32 with the same formulas). An error of 1e-5 relative in any one kernel's output
gives 17 or more, 0.1% gives 1e5 and more (tests/test_fused_check.py)."""
FLOAT32_ULP = 2.0 ** -23
"""One float32 ulp relative to 1: the smallest error scale an output is judged on (times its largest entry)."""
NEAR_TIE = 3e-5
"""A top-k decision (the router's, the indexer's) whose float64 gap between the last kept and the first dropped
score is below this is a coin toss for any float32 path (their scores are off by up to ~7e-6 here: errors
accumulate over layers); the rows that hang on it are not compared (decode: that row; prefill: that sequence
from that position on, which attends to it). Scores are of order one on the synthetic weights."""
SEED = 0
"""Seed of the synthetic weights and inputs (one fixed draw per config: the check's verdict is reproducible)."""


@dataclass
class CheckResult:
    """The verdict on one model config."""

    passed: bool
    problem: str | None
    """Why it failed (the output, both distances), or None."""
    worst_ratio: float
    """Largest fused/torch distance ratio over all compared outputs (ERROR_FACTOR is the limit)."""
    worst_output: str
    """The output that ratio was measured on."""
    rows_judged: str
    """Rows compared, of all (rows hanging on a near tie in float64 are not: see NEAR_TIE)."""
    seconds: float
    """Wall time of the check (synthetic model, three runs of each batch)."""

    def details(self) -> dict:
        """For fused.status() (JSON: an infinite ratio, integers or infinities that differ, becomes None)."""
        ratio = round(self.worst_ratio, 3) if math.isfinite(self.worst_ratio) else None
        return {"passed": self.passed, "problem": self.problem, "worst_ratio": ratio, "worst_output": self.worst_output,
                "rows_judged": self.rows_judged, "factor": ERROR_FACTOR, "seconds": round(self.seconds, 3)}


def check_config(cfg, *, seed: int = SEED) -> CheckResult:
    """Judge the fused kernels on a synthetic model of this config (see module docstring)."""
    started = time.perf_counter()
    if fused.library() is None:
        return CheckResult(False, f"the fused library is not available ({fused.status()['error']})", math.inf, "",
                           "", time.perf_counter() - started)
    model = synthetic_model(cfg, seed)
    decode, decode_kept = _decode_outputs(model, seed)
    prefill, prefill_kept = _prefill_outputs(model, seed)
    judged = decode + prefill
    worst = max(judged, key=lambda j: j[1])
    failed = next((j for j in judged if j[1] > ERROR_FACTOR), None)
    return CheckResult(passed=failed is None, problem=None if failed is None else failed[2], worst_ratio=worst[1],
                       worst_output=worst[0], rows_judged=f"decode {decode_kept}, prefill {prefill_kept}",
                       seconds=time.perf_counter() - started)


# ---------------------------------------------------------------------------------------------- the three runs
def _decode_outputs(model, seed: int) -> tuple[list[tuple[str, float, str]], str]:
    from engines.model.fused_model import FusedModel

    g = torch.Generator().manual_seed(seed + 1)
    batch = synthetic_batch(model.cfg, g)
    ids = torch.randint(0, model.cfg.vocab_size, (len(batch),), generator=g)
    streams = model._streams(ids.view(-1, 1))
    torch_batch, fused_batch = batch.clone(), batch.clone()
    with torch.inference_mode():
        with Float64Reference(model.cfg.index_topk) as reference:
            ref_batch = batch.clone()  # float64 copies (the mode promotes every float32 result)
            ref = model.decode_torch(ids, ref_batch, streams)
        want = model.decode_torch(ids, torch_batch, streams)
        got = FusedModel(model).decode(ids, fused_batch, streams)
    keep = torch.ones(len(batch), dtype=torch.bool)
    keep[reference.near_ties] = False  # decode rows are independent: a near tie only moves its own row
    judged = [_judge("decode log-probabilities", _logprobs(ref), _logprobs(want), _logprobs(got), keep)]
    fields = zip(ref_batch.named_tensors(torch_batch), batch.named_tensors(fused_batch))
    judged += [_judge(f"decode cache {name}", r, t, f, keep) for (name, r, t), (_, _, f) in fields]
    return judged, f"{int(keep.sum())} of {len(keep)} rows"


def _prefill_outputs(model, seed: int) -> tuple[list[tuple[str, float, str]], str]:
    from engines.model.fused_model import FusedModel

    g = torch.Generator().manual_seed(seed + 2)
    S = max(check_positions(model.cfg)) + 2
    ids = torch.randint(0, model.cfg.vocab_size, (2, S), generator=g)
    streams = model._streams(ids)
    with torch.inference_mode():
        with Float64Reference(model.cfg.index_topk) as reference:
            ref = model.full_torch(ids, False, streams=streams)[0]
        want = model.full_torch(ids, False, streams=streams)[0]
        got = FusedModel(model).full(ids, False, streams=streams)[0]
    keep = torch.ones(2, S, dtype=torch.bool)
    for row in reference.near_ties:  # a near tie at (b, t) moves row t, and through its K=V every later row of b
        keep[row // S, row % S:] = False
    keep = keep.reshape(-1)
    logprobs = (_logprobs(t.flatten(0, 1)) for t in (ref, want, got))
    return [_judge("prefill log-probabilities", *logprobs, keep)], f"{int(keep.sum())} of {len(keep)} rows"


def _logprobs(logits: torch.Tensor) -> torch.Tensor:
    return logits.double().log_softmax(-1)  # in float64 for all three: the softmax adds no rounding of its own


def _judge(what: str, ref: torch.Tensor, torch_ops: torch.Tensor, fused: torch.Tensor, keep: torch.Tensor
           ) -> tuple[str, float, str]:
    """(what, ratio, problem) over the rows kept: ratio = fused's largest distance from ref over the torch ops'
    (inf where integers, infinities or shapes differ)."""
    if not (ref.shape == torch_ops.shape == fused.shape):
        return what, math.inf, f"{what}: shapes differ (float64 {tuple(ref.shape)}, fused {tuple(fused.shape)})"
    ref, torch_ops, fused = ref[keep], torch_ops[keep], fused[keep]
    if not ref.is_floating_point():
        same = torch.equal(ref, fused)
        return what, 0.0 if same else math.inf, f"{what}: fused integers differ from the torch ops'"
    ref, torch_ops, fused = ref.double(), torch_ops.double(), fused.double()
    finite = torch.isfinite(ref)
    if not torch.equal(finite, torch.isfinite(fused)) or not torch.equal(ref[~finite], fused[~finite]):
        return what, math.inf, f"{what}: fused infinities or NaNs differ from the float64 reference's"
    if not finite.any():
        return what, 0.0, ""
    ref, torch_ops, fused = ref[finite], torch_ops[finite], fused[finite]
    torch_error = (torch_ops - ref).abs().max().item()
    fused_error = (fused - ref).abs().max().item()
    scale = max(torch_error, FLOAT32_ULP * ref.abs().max().item())
    ratio = fused_error / scale if scale > 0 else (0.0 if fused_error == 0 else math.inf)
    return what, ratio, (f"{what}: fused is {fused_error:.3g} from float64, the torch ops {torch_error:.3g} "
                         f"({ratio:.3g}x, at most {ERROR_FACTOR:g}x allowed)")


class Float64Reference(TorchFunctionMode):
    """The torch ops in float64: every float32 tensor an op reads or returns is promoted, `.float()` and float32
    dtype arguments mean float64 (the torch ops compute norms, mHC and softmaxes in float32 on purpose, for bf16
    models; here they must not round). Parameters stay float32 in the model and are promoted where read. Only
    for the check's small inputs: each op pays a Python call and each weight a copy.

    Records the top-k decisions that are near ties (`near_ties`: flat indices over the leading dimensions, i.e.
    rows): the router's `torch.topk` and the indexer's descending sort (of which it keeps the first
    `index_topk`), where the float64 gap between the last kept and the first dropped score is below NEAR_TIE."""

    def __init__(self, index_topk: int = 0) -> None:
        super().__init__()
        self.index_topk = index_topk
        self.near_ties: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "__get__":  # attribute reads (.shape, .dtype): nothing computed
            return func(*args, **kwargs)
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        args, kwargs = _promoted(args), _promoted(kwargs)
        out = _promoted(func(*args, **kwargs))
        if func in (torch.topk, torch.Tensor.topk) and args[0].is_floating_point():
            k = args[1] if len(args) > 1 else kwargs["k"]
            self._record(args[0].sort(dim=-1, descending=True).values, k)
        elif func in (torch.sort, torch.Tensor.sort) and args[0].is_floating_point() and kwargs.get("descending"):
            self._record(out.values, self.index_topk)
        return out

    def _record(self, ordered: torch.Tensor, k: int) -> None:
        if 0 < k < ordered.shape[-1]:
            gap = (ordered[..., k - 1] - ordered[..., k]).reshape(-1)
            self.near_ties += (gap < NEAR_TIE).nonzero()[:, 0].tolist()  # NaN gaps (-inf - -inf) are no decision


def _promoted(x):
    if isinstance(x, torch.Tensor):
        return x.double() if x.dtype == torch.float32 else x
    if x is torch.float32:
        return torch.float64
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # named tuples (torch.return_types) keep their type
        return type(x)(*(_promoted(v) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_promoted(v) for v in x)
    if isinstance(x, dict):
        return {k: _promoted(v) for k, v in x.items()}
    return x


# ---------------------------------------------------------------------------------------------- synthetic inputs
def synthetic_model(cfg, seed: int = SEED):
    """A float32 DeepseekV4 of this config with deterministic weights scaled for order-one activations: matrices
    N(0, 1/fan_in), norms 1 + N(0, 0.1^2), sinks, compressor position biases and mHC biases N(0, 0.5^2), mHC
    scales in [0.5, 1.5], router biases N(0, 0.1^2), a random tid2eid table (k distinct experts per token)."""
    from engines.model.model import DeepseekV4

    g = torch.Generator().manual_seed(seed)
    model = DeepseekV4(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_draw(name, tuple(p.shape), g))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                draws = torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=g)
                b.copy_(draws.argsort(-1)[:, :cfg.num_experts_per_tok])
    return model


def _draw(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    normal = torch.randn(shape, generator=g)
    if "norm" in name:
        return 1 + 0.1 * normal
    if leaf.endswith("_scale"):
        return 0.5 + torch.rand(shape, generator=g)
    if leaf in ("attn_sink", "ape") or leaf.endswith("_base"):
        return 0.5 * normal
    if leaf == "bias":
        return 0.1 * normal
    if name == "embed.weight":
        return normal
    return normal / math.sqrt(shape[-1]) if len(shape) == 2 else normal


def check_positions(cfg) -> list[int]:
    """Positions that reach every branch of a decode step for this config (see module docstring)."""
    W = cfg.sliding_window
    rates = sorted({cfg.compress_rate(i) for i in range(cfg.num_hidden_layers)} - {0})
    positions = {0, 1, W - 2, W - 1, W, 2 * W + 3}
    for r in rates:
        positions |= {r - 2, r - 1, r, 2 * r - 1, 2 * r + 1}
        if CSA in cfg.layer_types and r == cfg.compress_rates[CSA]:
            beyond = (cfg.index_topk + 2) * r
            positions |= {beyond - 1, beyond + r // 2, beyond + 2 * r - 1}
    return sorted(p for p in positions if p >= 0)


def synthetic_batch(cfg, g: torch.Generator) -> DecodeBatch:
    """A DecodeBatch at check_positions with random cache contents (no prefill needed)."""
    positions = torch.tensor(check_positions(cfg), dtype=torch.long)
    B, W, hd = len(positions), cfg.sliding_window, cfg.head_dim
    rates = [cfg.compress_rate(i) for i in range(cfg.num_hidden_layers) if cfg.compress_rate(i)]
    cap = int(positions.max()) // min(rates or [1]) + 2
    layers = []
    for i, kind in enumerate(cfg.layer_types):
        window = torch.randn(B, W, hd, generator=g)
        comp = idx = None
        if kind != SLIDING:
            rate = cfg.compress_rate(i)
            comp = _random_slots(B, rate, hd, kind == CSA, cap, positions, g)
            if kind == CSA:
                idx = _random_slots(B, rate, cfg.index_head_dim, True, cap, positions, g)
        layers.append(LayerSlots(window, comp, idx))
    return DecodeBatch(positions, layers)


def _random_slots(B: int, rate: int, d: int, overlap: bool, cap: int, positions: torch.Tensor,
                  g: torch.Generator) -> CompressorSlots:
    width = 2 * d if overlap else d
    slots = CompressorSlots(torch.randn(B, rate, width, generator=g), torch.randn(B, rate, width, generator=g),
                            torch.randn(B, cap, d, generator=g))
    if overlap:
        slots.overlap_kv = torch.randn(B, rate, d, generator=g)
        slots.overlap_gate = torch.randn(B, rate, d, generator=g)
        slots.overlap_gate[positions < rate] = float("-inf")  # before the first closed window: no prior
    return slots
