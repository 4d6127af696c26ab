"""Fidelity gate after every weight update: is the live engine computing with exactly the exported weights?

Two checks, both exact (no tolerance):
  1. logprobs of a fixed probe batch (prompt scoring, `max_new_tokens=0`) from the running server equal,
     bit for bit, those of a fresh engine loaded cold from the same directory, same dtype and profile;
  2. the sha256 of every runtime tensor and buffer the server computes with (`/weights_checker`,
     tid2eid and RoPE tables included) equals the fresh engine's, i.e. the export dequantized; a
     trainer-side manifest of the same form can be passed instead (`expected_checksums`).
A failure raises `FidelityError` naming the tensors that differ and where the logprobs diverge. It
catches the known update bugs (tests/test_rollout_updates.py plants each: FP4 bytes decoded as FP8, a
stale runtime copy (post-processing skipped), transposed scales); a changed or zeroed tid2eid never gets that far (the
update is refused).

Call it while nothing else runs on the engine (after /end_weight_update, before rollouts resume):
prompt batches are prefilled together, and different batch companions can move logprobs by ~1e-7.
The checksum half speaks the embedded engine's tensor names; real SGLang names its runtime tensors
its own way, so on clusters use the logprob half or SGLang's own checker.

    report = check_fidelity(SGLangClient(url), "export/step_10")   # raises FidelityError on mismatch
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from checkpoints.hf import read_config
from engines.model import ModelConfig
from engines.rollout.engine import EngineConfig, RequestSpec, RolloutEngine
from engines.rollout.sampling import SamplingParams
from engines.rollout.sglang import SGLangClient

MAX_NAMED = 8
"""Tensor names spelled out in a failure message (the report holds all of them)."""


class FidelityError(RuntimeError):
    """The live engine does not compute with the exported weights; `report` says where."""

    def __init__(self, report: "FidelityReport") -> None:
        self.report = report
        super().__init__(report.summary())


@dataclass
class Fingerprint:
    logprobs: list[list[float | None]]
    """Per probe sequence, the logprob of every token after the first (None: NaN, as JSON carries it)."""
    checksums: dict[str, str]


@dataclass
class FidelityReport:
    differing_tensors: list[str] = field(default_factory=list)
    missing_tensors: list[str] = field(default_factory=list)
    """In the reference but not reported by the engine."""
    unexpected_tensors: list[str] = field(default_factory=list)
    logprob_mismatches: int = 0
    logprob_positions: int = 0
    max_abs_logprob_diff: float = 0.0
    first_mismatch: tuple[int, int] | None = None
    """(probe sequence, token position) of the first differing logprob."""

    @property
    def ok(self) -> bool:
        return not (self.differing_tensors or self.missing_tensors or self.unexpected_tensors
                    or self.logprob_mismatches)

    def summary(self) -> str:
        if self.ok:
            return (f"fidelity ok: {self.logprob_positions} probe logprobs bit-identical to a fresh engine, "
                    "every runtime tensor checksum matches the export")
        parts = []
        for what, names in (("differ from the export", self.differing_tensors),
                            ("are missing on the engine", self.missing_tensors),
                            ("are unknown to the export", self.unexpected_tensors)):
            if names:
                shown = ", ".join(names[:MAX_NAMED]) + (f" (+{len(names) - MAX_NAMED} more)" if len(names) > MAX_NAMED else "")
                parts.append(f"{len(names)} runtime tensors {what}: {shown}")
        if self.logprob_mismatches:
            parts.append(f"probe logprobs differ at {self.logprob_mismatches}/{self.logprob_positions} positions "
                         f"(max |diff| {self.max_abs_logprob_diff:.3g}, first at sequence {self.first_mismatch[0]} "
                         f"token {self.first_mismatch[1]})")
        return "fidelity gate failed: " + "; ".join(parts)


def probe_batch(cfg: ModelConfig, *, n: int = 4, length: int | None = None, seed: int = 0) -> list[list[int]]:
    """n equal-length sequences (BOS + seeded random ids), long enough to fill the sliding window and
    several compressed entries of every compressed layer type."""
    rates = list(cfg.compress_rates.values()) or [1]
    length = length or min(cfg.max_position_embeddings, max(3 * cfg.sliding_window, 3 * max(rates)) + 5)
    g = torch.Generator().manual_seed(seed)
    body = torch.randint(0, cfg.vocab_size, (n, length - 1), generator=g)
    bos = cfg.bos_token_id or 0
    return [[bos] + row for row in body.tolist()]


def engine_fingerprint(engine: RolloutEngine, probe: Sequence[Sequence[int]]) -> Fingerprint:
    specs = [RequestSpec(rid=f"fidelity-probe-{i}", input_ids=list(p), sampling=SamplingParams(max_new_tokens=0),
                         seed=0, return_logprob=True, logprob_start_len=0) for i, p in enumerate(probe)]
    return Fingerprint([o.input_logprobs[1:] for o in engine.generate(specs)], engine.checksums())


def server_fingerprint(client: SGLangClient, probe: Sequence[Sequence[int]]) -> Fingerprint:
    return Fingerprint([lp[1:] for lp in client.score(probe, start=0)], client.weights_checksums())


def reference_fingerprint(model_dir: str | Path, probe: Sequence[Sequence[int]], *, dtype: str = "float32",
                          profile: Mapping[str, Any] | None = None) -> Fingerprint:
    """A fresh engine loaded cold from `model_dir` (the path a restarted server would take)."""
    engine = RolloutEngine(model_dir, EngineConfig(dtype=dtype, profile=dict(profile or {}), prefix_cache_entries=0))
    try:
        return engine_fingerprint(engine, probe)
    finally:
        engine.shutdown()


def compare(expected: Fingerprint, actual: Fingerprint) -> FidelityReport:
    report = FidelityReport()
    report.missing_tensors = sorted(set(expected.checksums) - set(actual.checksums))
    report.unexpected_tensors = sorted(set(actual.checksums) - set(expected.checksums))
    report.differing_tensors = [n for n in expected.checksums
                                if n in actual.checksums and actual.checksums[n] != expected.checksums[n]]
    if len(expected.logprobs) != len(actual.logprobs):
        raise ValueError(f"probe batch sizes differ: {len(expected.logprobs)} vs {len(actual.logprobs)}")
    for i, (want, got) in enumerate(zip(expected.logprobs, actual.logprobs)):
        if len(want) != len(got):
            raise ValueError(f"probe sequence {i}: {len(want)} reference logprobs but {len(got)} from the engine")
        for j, (a, b) in enumerate(zip(want, got)):
            report.logprob_positions += 1
            if a != b:  # None: a NaN the server could not put in JSON
                report.logprob_mismatches += 1
                diff = math.inf if a is None or b is None else abs(a - b)
                report.max_abs_logprob_diff = max(report.max_abs_logprob_diff, diff)
                report.first_mismatch = report.first_mismatch or (i, j + 1)
    return report


def check_fidelity(client: SGLangClient, model_dir: str | Path, *, probe: Sequence[Sequence[int]] | None = None,
                   expected_checksums: Mapping[str, str] | None = None, raise_on_failure: bool = True
                   ) -> FidelityReport:
    """Compare the live server with a fresh engine on `model_dir` (the directory just loaded into it)."""
    info = client.server_info()
    probe = probe or probe_batch(read_config(model_dir)[0])
    own = info.get("v4rl") or {}  # the embedded server's extensions; real SGLang has none
    reference = reference_fingerprint(model_dir, probe, dtype=info.get("dtype", "float32"),
                                      profile={"rocm_fnuz": bool(own.get("rocm_fnuz", False))})
    if expected_checksums is not None:
        reference.checksums = dict(expected_checksums)
    report = compare(reference, server_fingerprint(client, probe))
    if raise_on_failure and not report.ok:
        raise FidelityError(report)
    return report
