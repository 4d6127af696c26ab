"""The Miles and Megatron-LM commits v4rl builds the cluster job for: one pin per engine tree of each DeepSeek-V4
generation, with the vendor tarball that holds it and the variable naming a user's own checkout instead.

    from engines.miles.pins import MILES_GENERATIONS
    miles, megatron = MILES_GENERATIONS[2]      # (Miles e9e19b223, Megatron-LM 6184c094a)

engines/upstream/sources.py finds these trees on a CPU machine (a checkout, the vendored tarballs, a cache).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SourcePin:
    """One pinned engine tree: a git commit of a repository, as a vendor tarball with one top directory."""

    name: str
    repo: str
    commit: str
    tarball: str
    """File name in the vendor directory."""
    env: str
    """Variable naming a user's own checkout of this engine instead."""

    @property
    def short(self) -> str:
        return self.commit[:9]


MILES = SourcePin("miles", "github.com/radixark/miles (main)", "31f1ca961a94cb860cec3b2dea34ec332bfa8f76",
                  "miles-31f1ca961.tar.gz", "V4RL_MILES_DIR")
"""Miles main of the first DeepSeek-V4 generation (plugin weight names); MILES_GEN2 is the second."""
MILES_SEED_PR = SourcePin("miles", "github.com/radixark/miles (PR #1300 head, never merged)",
                          "a8684732f37ed5cfc63c312f81b4d187b788df13", "miles-a8684732f.tar.gz", "V4RL_MILES_DIR")
"""The only Miles whose `scripts/amd/run_deepseek_v4.py train` takes the seed's exact command line."""
MEGATRON = SourcePin("megatron-lm", "github.com/radixark/Megatron-LM (miles-main)",
                     "2e64d788b67fe8155774200c87606e1e449c494b", "megatron-lm-2e64d788b.tar.gz", "V4RL_MEGATRON_DIR")
"""The Megatron-LM fork Miles' Dockerfiles clone, at the commit paired with MILES."""
MILES_GEN2 = SourcePin("miles", "github.com/radixark/miles (PR #2706 head, DeepSeek-V4 support-v2, merged 2026-08-31)",
                       "e9e19b22324a5da0d6d41bd0debf8be9f4316f3d", "miles-e9e19b223.tar.gz", "V4RL_MILES_DIR")
"""Miles' second DeepSeek-V4 generation: Megatron's weight names, `--dsv4-impl miles|megatron`
(engines/miles/generation.py); what every Miles cloned since September has."""
MEGATRON_GEN2 = SourcePin("megatron-lm", "github.com/radixark/Megatron-LM (dsv4-dual-backend)",
                          "6184c094a676ff96c2c74ac684ec0e4609f42d46", "megatron-lm-6184c094a.tar.gz",
                          "V4RL_MEGATRON_DIR")
"""The Megatron-LM that fits MILES_GEN2 (DeepSeek-V4 in Megatron itself: hash routing, hyper-connections,
dsv4_hybrid attention); the branch Miles' Dockerfile names (miles-main-20260819) rejects its flags."""
MILES_GENERATIONS: dict[int, tuple[SourcePin, SourcePin]] = {1: (MILES, MEGATRON), 2: (MILES_GEN2, MEGATRON_GEN2)}
"""The pinned (Miles, Megatron-LM) pair of each DeepSeek-V4 generation v4rl supports."""
