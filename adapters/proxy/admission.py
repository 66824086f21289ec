"""Batch admission through the gate: reject or queue, fail closed on any gate failure.

Only batch requests come here; interactive ones never touch the gate or Redis. A denied
request is answered at once (mode `reject`: 429 with Retry-After) or retried after the
gate's retry hint until its deadline (mode `queue`, bounded depth). A Redis error or a gate
call slower than `gate_timeout_s` denies the request with 503 (fail closed for batch).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import redis
from borrowd.adapters.proxy.config import AdmissionConfig, AdmissionMode

log = logging.getLogger(__name__)


class AdmissionLike(Protocol):
    """What the proxy reads from a gate decision (`adapters.gate.Admission`, frozen)."""

    @property
    def admitted(self) -> bool: ...
    @property
    def reason(self) -> str: ...
    @property
    def retry_after_s(self) -> float: ...
    @property
    def max_output_tokens(self) -> int: ...
    @property
    def lease_ms(self) -> int: ...


class RevocationLike(Protocol):
    """One entry of the revoke stream (`adapters.gate.Revocation`)."""

    @property
    def stream_id(self) -> str: ...
    @property
    def request_id(self) -> str: ...
    @property
    def reason(self) -> str: ...


class GateLike(Protocol):
    """The part of `adapters.gate.AsyncGate` the proxy uses."""

    async def admit(self, request_id: str, prompt_tokens: int, max_output_tokens: int,
                    now_s: float | None = None) -> AdmissionLike:
        """Admit one batch request or say why not."""
        ...

    async def release(self, request_id: str, output_tokens: int | None,
                      now_s: float | None = None) -> int:
        """Return a finished request's reservation."""
        ...

    async def renew(self, request_id: str, now_s: float | None = None) -> bool:
        """Extend an admitted request's lease."""
        ...

    async def revocations(self, last_id: str = "$", block_ms: int | None = None
                          ) -> tuple[str, Sequence[RevocationLike]]:
        """Revocations after `last_id`, waiting up to `block_ms`."""
        ...


GATE_ERRORS = (redis.RedisError, OSError, asyncio.TimeoutError)


@dataclass(frozen=True)
class Decision:
    """The proxy's answer for one batch request.

    `status` is 0 when admitted, else the HTTP status to answer (429 denied or timed out in
    the queue, 503 gate unreachable); `outcome` is the metrics outcome of a denial.
    """

    admitted: bool
    status: int
    reason: str
    retry_after_s: float
    max_output_tokens: int
    lease_ms: int
    waited_s: float
    outcome: str


class BatchAdmitter:
    """Admits batch requests through a gate under the configured mode."""

    def __init__(self, gate: GateLike, config: AdmissionConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.gate = gate
        self.config = config
        self.clock = clock
        self.queued = 0

    async def _ask(self, request_id: str, prompt_tokens: int, max_output_tokens: int
                   ) -> AdmissionLike | str:
        try:
            return await asyncio.wait_for(
                self.gate.admit(request_id, prompt_tokens, max_output_tokens),
                self.config.gate_timeout_s,
            )
        except GATE_ERRORS as exc:
            log.warning("gate unreachable, denying batch request %s: %r", request_id, exc)
            return f"budget store unreachable ({type(exc).__name__}); batch is fail-closed"

    async def admit(self, request_id: str, prompt_tokens: int, max_output_tokens: int,
                    max_wait_s: float | None = None) -> Decision:
        """Decide one batch request; in queue mode wait up to `max_wait_s` (capped by config)."""
        cfg = self.config
        started_s = self.clock()
        answer = await self._ask(request_id, prompt_tokens, max_output_tokens)
        if isinstance(answer, str):
            return self._unavailable(answer, started_s)
        if answer.admitted or cfg.mode is AdmissionMode.REJECT:
            return self._decision(answer, started_s, "rejected")
        if self.queued >= cfg.queue_max_depth:
            return self._decision(answer, started_s, "rejected",
                                  note=f"admission queue full ({cfg.queue_max_depth})")
        wait_s = cfg.queue_max_wait_s if max_wait_s is None else min(max_wait_s,
                                                                     cfg.queue_max_wait_s)
        deadline_s = started_s + wait_s
        self.queued += 1
        try:
            while True:
                now_s = self.clock()
                pause_s = min(max(answer.retry_after_s, cfg.queue_poll_min_s), deadline_s - now_s)
                if pause_s <= 0:
                    return self._decision(answer, started_s, "timeout",
                                          note=f"not admitted within {wait_s:g} s")
                await asyncio.sleep(pause_s)
                answer = await self._ask(request_id, prompt_tokens, max_output_tokens)
                if isinstance(answer, str):
                    return self._unavailable(answer, started_s)
                if answer.admitted:
                    return self._decision(answer, started_s, "rejected")
        finally:
            self.queued -= 1

    def _decision(self, answer: AdmissionLike, started_s: float, outcome: str,
                  note: str = "") -> Decision:
        reason = answer.reason if not note else f"{answer.reason}; {note}"
        return Decision(
            admitted=answer.admitted,
            status=0 if answer.admitted else 429,
            reason=reason,
            retry_after_s=max(answer.retry_after_s, self.config.queue_poll_min_s),
            max_output_tokens=answer.max_output_tokens,
            lease_ms=answer.lease_ms,
            waited_s=self.clock() - started_s,
            outcome=outcome,
        )

    def _unavailable(self, message: str, started_s: float) -> Decision:
        return Decision(
            admitted=False,
            status=503,
            reason=message,
            retry_after_s=self.config.unavailable_retry_after_s,
            max_output_tokens=0,
            lease_ms=0,
            waited_s=self.clock() - started_s,
            outcome="rejected",
        )
