"""Fleet admission of batch work in the simulator: the pool's `models.admission.PoolGate` (the
model of the Lua gate) on simulated seconds.

A batch request is admitted or denied exactly as `adapters/lua/admit.lua` would decide it at
that millisecond; a denial for the token bucket comes with the time until it holds the
request, any other denial waits for a completion or a new budget. Admissions hold a lease as
long as the run (the simulated router never crashes, so nothing needs renewing).
"""

from __future__ import annotations

import math

from borrowd.models.admission import PoolGate
from borrowd.models.budget import Budget

RETRY_MS = 1000  # retry hint of the gate (adapters.gate.DEFAULT_RETRY_MS)


def now_ms(now_s: float) -> int:
    """Simulated seconds as the gate's integer milliseconds (as `adapters.gate` passes them)."""
    return int(now_s * 1000)


class BatchGate:
    """Admission and release of the fleet's batch requests against the pool's `PoolGate`."""

    def __init__(self, pool: PoolGate, lease_ms: int) -> None:
        self.pool = pool
        self.lease_ms = lease_ms

    @property
    def budget(self) -> Budget | None:
        """The record in force (None before the first publication)."""
        return self.pool.record

    @property
    def inflight_seqs(self) -> int:
        """Batch requests holding a reservation."""
        return len(self.pool.requests)

    @property
    def inflight_kv_tokens(self) -> int:
        """KV tokens reserved by them (prompt + clamped max output each)."""
        return self.pool.kv_tokens

    def try_admit(self, admission_id: str, prompt_tokens: int, max_output_tokens: int,
                  now_s: float) -> tuple[float, int]:
        """(0.0, clamped max output) when admitted; else (seconds to wait, 0): the bucket's
        retry time for a `rate` denial, `inf` when only a completion or a new budget helps."""
        decision = self.pool.admit(admission_id, prompt_tokens, max_output_tokens,
                                   now_ms(now_s), lease_ms=self.lease_ms, retry_ms=RETRY_MS)
        if decision.admitted:
            return 0.0, decision.max_output_tokens
        if decision.reason == "rate":
            return decision.retry_after_ms / 1000.0, 0
        return math.inf, 0

    def release(self, admission_id: str, output_tokens: int | None, now_s: float) -> int:
        """A batch request left the fleet after generating `output_tokens`: free its
        reservation and refund the unused output (-1 when the gate had revoked it)."""
        return self.pool.release(admission_id, output_tokens, now_ms(now_s))
