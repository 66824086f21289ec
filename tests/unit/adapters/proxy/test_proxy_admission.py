"""Batch admission modes against a fake gate: reject, queue, queue limits, fail closed."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
import redis
from borrowd.adapters.proxy.admission import BatchAdmitter
from borrowd.adapters.proxy.config import AdmissionConfig, AdmissionMode


@dataclass
class FakeAdmission:
    """A gate decision."""

    admitted: bool
    reason: str
    retry_after_s: float = 0.01
    max_output_tokens: int = 100
    lease_ms: int = 1000


@dataclass
class FakeGate:
    """Denies the first `deny` calls, then admits; or raises / hangs when told to."""

    deny: int = 0
    error: Exception | None = None
    hang: bool = False
    calls: list[str] = field(default_factory=list)

    async def admit(self, request_id, prompt_tokens, max_output_tokens, now_s=None):
        """Fake admission."""
        self.calls.append(request_id)
        if self.hang:
            await asyncio.sleep(10)
        if self.error is not None:
            raise self.error
        if len(self.calls) <= self.deny:
            return FakeAdmission(False, "rate")
        return FakeAdmission(True, "admitted", 0.0, min(max_output_tokens, 100))


def _admitter(gate: FakeGate, **config) -> BatchAdmitter:
    return BatchAdmitter(gate, AdmissionConfig(queue_poll_min_s=0.01, gate_timeout_s=0.05,
                                               **config))


async def test_reject_mode_answers_at_once() -> None:
    """A denial in reject mode is a 429 without retrying."""
    gate = FakeGate(deny=5)
    decision = await _admitter(gate).admit("r1", 10, 50)
    assert (decision.admitted, decision.status, decision.outcome) == (False, 429, "rejected")
    assert gate.calls == ["r1"]


async def test_admitted_request_gets_the_clamped_cap() -> None:
    """An admission carries the gate's clamped max output."""
    decision = await _admitter(FakeGate()).admit("r1", 10, 500)
    assert decision.admitted
    assert decision.max_output_tokens == 100


async def test_queue_mode_retries_until_admitted() -> None:
    """In queue mode a denied request is retried until the gate admits it."""
    gate = FakeGate(deny=3)
    decision = await _admitter(gate, mode=AdmissionMode.QUEUE).admit("r1", 10, 50)
    assert decision.admitted
    assert len(gate.calls) == 4
    assert decision.waited_s > 0


async def test_queue_mode_times_out_at_the_deadline() -> None:
    """A queued request that is never admitted ends with 429 and outcome timeout."""
    admitter = _admitter(FakeGate(deny=10**6), mode=AdmissionMode.QUEUE, queue_max_wait_s=0.1)
    decision = await admitter.admit("r1", 10, 50, max_wait_s=5.0)
    assert (decision.status, decision.outcome) == (429, "timeout")
    assert 0.1 <= decision.waited_s < 0.5
    assert admitter.queued == 0


async def test_queue_depth_is_bounded() -> None:
    """With the queue full a denied request is rejected at once."""
    admitter = _admitter(FakeGate(deny=10**6), mode=AdmissionMode.QUEUE, queue_max_depth=1,
                         queue_max_wait_s=0.3)
    first = asyncio.create_task(admitter.admit("r1", 10, 50))
    await asyncio.sleep(0.02)
    second = await admitter.admit("r2", 10, 50)
    assert (second.status, second.outcome) == (429, "rejected")
    assert "queue full" in second.reason
    assert (await first).outcome == "timeout"


@pytest.mark.parametrize(
    "gate",
    [FakeGate(error=redis.ConnectionError("refused")), FakeGate(error=OSError("down")),
     FakeGate(hang=True)],
    ids=["redis-error", "os-error", "slow-gate"],
)
async def test_gate_failure_fails_closed(gate: FakeGate) -> None:
    """A gate error or a gate slower than gate_timeout_s is a 503 for batch."""
    decision = await _admitter(gate, mode=AdmissionMode.QUEUE).admit("r1", 10, 50)
    assert (decision.admitted, decision.status) == (False, 503)
    assert "fail-closed" in decision.reason
    assert decision.waited_s < 0.5
