"""Admitted batch requests in flight: revocation from the gate's stream, lease renewal.

`BatchRegistry` holds the in-flight batch requests of this proxy. `watch_revocations`
reads the pool's revoke stream and, for each request it names that this proxy serves,
closes the upstream response (vLLM aborts the request and frees its KV on disconnect); the
request's handler then ends the client's stream with a resumable `preempted` chunk.
`renew_leases` keeps the gate's admission leases of long streams alive, and ends (reason
`lease_lost`) a stream whose lease is gone or could not be renewed for longer than the
lease: in-flight batch never outlives its lease, so a Redis that died or came back empty
cannot leave this proxy running batch work the gate no longer counts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from borrowd.adapters.proxy.admission import GATE_ERRORS, GateLike

log = logging.getLogger(__name__)


class BatchStream:
    """One admitted batch request in flight; `revoke()` may come from another task."""

    __slots__ = ("_close_upstream", "renewed_s", "request_id", "revoked", "revoked_reason")

    def __init__(self, request_id: str, renewed_s: float) -> None:
        self.request_id = request_id
        self.renewed_s = renewed_s
        """When its lease was last known good (admission, then each renewal)."""
        self.revoked = False
        self.revoked_reason = ""
        self._close_upstream: Callable[[], None] | None = None

    def attach(self, close_upstream: Callable[[], None]) -> None:
        """Register how to drop the upstream connection; runs at once if already revoked."""
        self._close_upstream = close_upstream
        if self.revoked:
            close_upstream()

    def revoke(self, reason: str) -> None:
        """Mark revoked and drop the upstream connection (idempotent)."""
        if self.revoked:
            return
        self.revoked = True
        self.revoked_reason = reason
        if self._close_upstream is not None:
            self._close_upstream()


class BatchRegistry:
    """In-flight batch requests of this proxy by request id."""

    def __init__(self) -> None:
        self.streams: dict[str, BatchStream] = {}

    def add(self, request_id: str, admitted_s: float) -> BatchStream:
        """Track a newly admitted batch request."""
        stream = BatchStream(request_id, admitted_s)
        self.streams[request_id] = stream
        return stream

    def remove(self, request_id: str) -> None:
        """Forget a finished request."""
        self.streams.pop(request_id, None)

    def revoke(self, request_id: str, reason: str) -> bool:
        """Revoke `request_id` if this proxy serves it; True when it did."""
        stream = self.streams.get(request_id)
        if stream is None:
            return False
        stream.revoke(reason)
        return True

    def revoke_all(self, reason: str) -> int:
        """Revoke every batch request in flight here; how many."""
        streams = list(self.streams.values())
        for stream in streams:
            stream.revoke(reason)
        return len(streams)


async def watch_revocations(gate: GateLike, registry: BatchRegistry,
                            on_revoked: Callable[[str], None], stopped: asyncio.Event, *,
                            block_ms: int = 1000, retry_s: float = 0.5) -> None:
    """Read the revoke stream until `stopped` and revoke the named requests served here."""
    last_id = "$"
    while not stopped.is_set():
        try:
            last_id, entries = await gate.revocations(last_id, block_ms=block_ms)
        except Exception as exc:  # never let the watcher die: revocation must keep working
            log.warning("revoke stream unreadable, retrying in %.1f s: %r", retry_s, exc)
            await asyncio.sleep(retry_s)
            continue
        for entry in entries:
            if registry.revoke(entry.request_id, entry.reason):
                on_revoked(entry.request_id)


LEASE_LOST = "lease_lost"
"""Revocation reason of a stream whose admission lease is gone or could not be renewed."""


async def renew_leases(gate: GateLike, registry: BatchRegistry, interval_s: float,
                       lease_s: float, call_timeout_s: float, stopped: asyncio.Event,
                       clock: Callable[[], float] = time.monotonic) -> None:
    """Renew the admission lease of every in-flight batch request every `interval_s`.

    A renewal the gate refuses (the lease expired, or Redis restarted empty) revokes the
    request at once. While renewals fail (Redis down or frozen), a request is revoked at
    the last tick before its lease would run out (last good renewal + `lease_s`, timed from
    before that call), since the gate counts it gone from then on:
    revoke when now - renewed + interval_s > lease_s.
    """
    while not stopped.is_set():
        await asyncio.sleep(interval_s)
        failing = False
        for request_id, stream in list(registry.streams.items()):
            if stream.revoked:
                continue
            if not failing:
                asked_s = clock()
                try:
                    alive = await asyncio.wait_for(gate.renew(request_id), call_timeout_s)
                except GATE_ERRORS as exc:
                    log.warning("lease renewal failed for %s: %r", request_id, exc)
                    failing = True  # do not wait out the timeout once per stream
                else:
                    if alive:
                        stream.renewed_s = asked_s
                    else:
                        log.warning("lease of %s is gone; ending it", request_id)
                        stream.revoke(LEASE_LOST)
                    continue
            if clock() - stream.renewed_s + interval_s > lease_s:
                log.warning("lease of %s not renewed for %.1f s; ending it before it runs out",
                            request_id, clock() - stream.renewed_s)
                stream.revoke(LEASE_LOST)
