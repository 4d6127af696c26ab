"""SGLang's health probe over the embedded engine: /health and /health_generate generate one token.

As SGLang 0.5.23 (`http_server.py` health_generate): a one-token greedy request is queued, and the server
counts as healthy as soon as the scheduler produces anything (the probe's token or any other request's),
within SGLANG_HEALTH_CHECK_TIMEOUT seconds (default 20). A paused engine, or one inside a weight-update
session, produces nothing, so the probe answers 503 once the timeout passes (SGLang's behaviour), unless
generation resumes in time; an engine whose weights are released (memory.py) refuses the probe: 503 at
once. SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0 turns /health into a liveness check.

    status = await HealthProbe(engine).check()   # 200 or 503
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid

from starlette.concurrency import run_in_threadpool

from engines.rollout.engine import EngineStopped, RequestSpec, RolloutEngine
from engines.rollout.sampling import SamplingParams

HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"
POLL_S = 0.1


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    return default if value is None else value.strip().lower() not in ("0", "false", "no", "off", "")


class HealthProbe:
    """One-token generation probe with SGLang's timeout and environment switches."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine

    @staticmethod
    def generation_on_health() -> bool:
        """Whether /health probes generation too (SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION, default on)."""
        return _env_flag("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", True)

    @staticmethod
    def timeout_s() -> float:
        raw = os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20")
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"SGLANG_HEALTH_CHECK_TIMEOUT={raw!r} is not a number of seconds; unset it or "
                             "set e.g. 20") from None

    async def check(self) -> int:
        """200 when the scheduler produced output within the timeout, else 503 (the probe is then aborted)."""
        if not self.engine.alive:
            return 503
        before = (await run_in_threadpool(self.engine.status))["generated_tokens"]
        spec = RequestSpec(rid=f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}",
                           input_ids=[self.engine.cfg.bos_token_id or 0], seed=0,
                           sampling=SamplingParams(temperature=0.0, max_new_tokens=1))
        try:
            future = self.engine.submit([spec])[0]
        except EngineStopped:
            return 503
        deadline = time.monotonic() + self.timeout_s()
        healthy = False
        try:
            while time.monotonic() < deadline and not healthy:
                await asyncio.sleep(POLL_S)
                if future.done():
                    return 200 if future.exception() is None else 503
                # another request making progress also proves the scheduler alive (SGLang's rule)
                healthy = (await run_in_threadpool(self.engine.status))["generated_tokens"] > before
            await run_in_threadpool(self.engine.abort, spec.rid)  # the probe is not needed any more
        except EngineStopped:
            return 503
        return 200 if healthy else 503
