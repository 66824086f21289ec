"""Admission gate: atomic admission of batch requests against a pool's budget record.

One Lua script per decision (EVALSHA) checks, atomically: the record is present, fresh, of
this schema and not from an older epoch; the stop switch is clear; the token bucket
(`batch_tokens_per_s` refill, `batch_burst_tokens` depth; cost = prompt + clamped max
output); the active sequence cap; the KV-token cap (sum of prompt + clamped max output of
in-flight batch requests); the output cap. Admitted requests hold leases, reaped by the
scripts themselves, so a crashed router cannot leak capacity. Interactive requests never
reach this module: they are always admitted by the caller without a Redis call.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import cast

import redis
import redis.asyncio
from borrowd.adapters.lua import script_text
from borrowd.adapters.store import REAP_LIMIT, PoolKeys
from borrowd.models.budget import SCHEMA_VERSION
from borrowd.models.errors import InputError
from borrowd.models.priority import BATCH_PRIORITY, INTERACTIVE_PRIORITY

DEFAULT_LEASE_MS = 30_000
# Retry hint when a denial has no better one (no record, caps full).
DEFAULT_RETRY_MS = 1_000


class AdmitReason(StrEnum):
    """Why a request was admitted or denied."""

    ADMITTED = "admitted"
    DUPLICATE = "duplicate"
    INTERACTIVE = "interactive"
    NO_BUDGET = "no_budget"
    MALFORMED = "malformed"
    FOREIGN_SCHEMA = "foreign_schema"
    FENCED = "fenced"
    STALE = "stale"
    STOPPED = "stopped"
    CLOSED = "closed"
    TOO_LARGE = "too_large"
    SEQ_CAP = "seq_cap"
    KV_CAP = "kv_cap"
    RATE = "rate"
    REDIS_UNAVAILABLE = "redis_unavailable"


@dataclass(frozen=True)
class Admission:
    """One admission decision.

    `max_output_tokens` is the request's max output clamped to the budget's output cap (the
    caller must enforce it); `priority` is the vLLM priority to inject; `lease_ms` is how long
    the admission lives unless renewed or released; `reason` is an `AdmitReason` value, or
    `mode_<mode>` when the record's mode admits no batch work.
    """

    admitted: bool
    reason: str
    retry_after_s: float
    max_output_tokens: int
    lease_ms: int
    priority: int

    @classmethod
    def interactive(cls, max_output_tokens: int) -> Admission:
        """Interactive work: always admitted, at interactive priority, without Redis."""
        return cls(True, AdmitReason.INTERACTIVE.value, 0.0, max_output_tokens, 0,
                   INTERACTIVE_PRIORITY)

    @classmethod
    def unavailable(cls, retry_after_s: float = DEFAULT_RETRY_MS / 1000) -> Admission:
        """Batch denied because Redis could not be reached (fail closed)."""
        return cls(False, AdmitReason.REDIS_UNAVAILABLE.value, retry_after_s, 0, 0,
                   BATCH_PRIORITY)


@dataclass(frozen=True)
class InFlight:
    """Batch work in flight in one pool (after reaping expired leases).

    `bucket_tokens` is the token bucket as last written (before refill to now); None before
    the first admission.
    """

    seqs: int
    kv_tokens: int
    bucket_tokens: float | None


@dataclass(frozen=True)
class Revocation:
    """One request the enforcing adapters must abort, from the pool's revoke stream."""

    stream_id: str
    request_id: str
    reason: str
    epoch: int
    seq: int


def _now_arg(now_s: float | None) -> str:
    return "" if now_s is None else str(int(now_s * 1000))


def _check_request(request_id: str, prompt_tokens: int, max_output_tokens: int) -> None:
    if not request_id:
        raise InputError("request_id must be non-empty")
    if prompt_tokens < 0:
        raise InputError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
    if max_output_tokens < 1:
        raise InputError(f"max_output_tokens must be >= 1, got {max_output_tokens}")


def _check_block(client: redis.Redis | redis.asyncio.Redis, block_ms: int | None) -> None:
    if block_ms is None:
        return
    if block_ms <= 0:
        raise InputError(f"block_ms must be > 0 or None (no wait), got {block_ms}")
    timeout_s = client.connection_pool.connection_kwargs.get("socket_timeout")
    if timeout_s is not None and block_ms / 1000 >= timeout_s:
        raise InputError(
            f"block_ms {block_ms} must be below the client's socket timeout of {timeout_s} s"
        )


def _admission(reply: list, priority: int) -> Admission:
    admitted, reason, retry_ms, out, lease_ms = reply
    return Admission(bool(int(admitted)), str(reason), int(retry_ms) / 1000.0, int(out),
                     int(lease_ms), priority)


def _inflight(reply: list) -> InFlight:
    seqs, kv_tokens, tokens = reply
    return InFlight(int(seqs), int(kv_tokens), float(tokens) if tokens != "" else None)


def _revocations(reply: list | None, last_id: str) -> tuple[str, list[Revocation]]:
    found: list[Revocation] = []
    for _stream, entries in reply or []:
        for stream_id, fields in entries:
            found.append(Revocation(stream_id, fields["request_id"], fields.get("reason", ""),
                                    int(fields.get("epoch", 0)), int(fields.get("seq", 0))))
            last_id = stream_id
    return last_id, found


class _GateBase:
    def __init__(self, pool: str, *, lease_ms: int, batch_priority: int,
                 retry_ms: int) -> None:
        if lease_ms <= 0:
            raise InputError(f"admission lease_ms must be > 0, got {lease_ms}")
        self.pool = pool
        self.keys = PoolKeys(pool)
        self.lease_ms = lease_ms
        self.batch_priority = batch_priority
        self.retry_ms = retry_ms
        k = self.keys
        self._admit_keys = [k.budget, k.epoch, k.stop, k.leases, k.order, k.reqs, k.state]
        self._release_keys = [k.budget, k.leases, k.order, k.reqs, k.state]
        self._gate_keys = [k.leases, k.order, k.reqs, k.state]

    def _admit_args(self, request_id: str, prompt_tokens: int, max_output_tokens: int,
                    now_s: float | None) -> list[str | int]:
        _check_request(request_id, prompt_tokens, max_output_tokens)
        return [request_id, int(prompt_tokens), int(max_output_tokens), _now_arg(now_s),
                self.lease_ms, SCHEMA_VERSION, self.retry_ms, REAP_LIMIT]

    def _release_args(self, request_id: str, output_tokens: int | None,
                      now_s: float | None) -> list[str | int]:
        if output_tokens is not None and output_tokens < 0:
            raise InputError(f"output_tokens must be >= 0, got {output_tokens}")
        used: str | int = "" if output_tokens is None else int(output_tokens)
        return [request_id, used, _now_arg(now_s), REAP_LIMIT]

    def _renew_args(self, request_id: str, now_s: float | None) -> list[str | int]:
        return [request_id, self.lease_ms, _now_arg(now_s), REAP_LIMIT]


class Gate(_GateBase):
    """Batch admission for one pool on a sync Redis client."""

    def __init__(self, client: redis.Redis, pool: str, *, lease_ms: int = DEFAULT_LEASE_MS,
                 batch_priority: int = BATCH_PRIORITY, retry_ms: int = DEFAULT_RETRY_MS) -> None:
        super().__init__(pool, lease_ms=lease_ms, batch_priority=batch_priority,
                         retry_ms=retry_ms)
        self.client = client
        self._admit = client.register_script(script_text("admit"))
        self._release = client.register_script(script_text("release"))
        self._renew = client.register_script(script_text("renew"))
        self._inflight = client.register_script(script_text("inflight"))

    def admit(self, request_id: str, prompt_tokens: int, max_output_tokens: int,
              now_s: float | None = None) -> Admission:
        """Admit one batch request or say why not; `now_s` None = the Redis server's clock.

        Redis errors propagate (`redis.RedisError`); callers deny batch work on them.
        """
        args = self._admit_args(request_id, prompt_tokens, max_output_tokens, now_s)
        return _admission(self._admit(keys=self._admit_keys, args=args), self.batch_priority)

    def release(self, request_id: str, output_tokens: int | None,
                now_s: float | None = None) -> int:
        """Free a finished request's seat and KV; refund unused output tokens to the bucket.

        `output_tokens` None = unknown (refund nothing). Returns the tokens refunded, or -1
        when the request was not in flight (already released, revoked or expired).
        """
        args = self._release_args(request_id, output_tokens, now_s)
        released, refunded = self._release(keys=self._release_keys, args=args)
        return int(refunded) if int(released) else -1

    def renew(self, request_id: str, now_s: float | None = None) -> bool:
        """Extend an admitted request's lease by `lease_ms`; False when it is not in flight."""
        return bool(self._renew(keys=self._gate_keys, args=self._renew_args(request_id, now_s)))

    def inflight(self, now_s: float | None = None) -> InFlight:
        """Batch sequences and KV tokens in flight, and the bucket level."""
        return _inflight(self._inflight(keys=self._gate_keys, args=[_now_arg(now_s), REAP_LIMIT]))

    def revocations(self, last_id: str = "$", block_ms: int | None = None
                    ) -> tuple[str, list[Revocation]]:
        """Revocations after `last_id` ("0" = all kept, "$" = only ones added from now on),
        waiting up to `block_ms` > 0 (None = do not wait). Returns the id to pass next time
        and the entries, oldest first."""
        _check_block(self.client, block_ms)
        if last_id == "$":
            newest = cast(list, self.client.xrevrange(self.keys.revoke, count=1))
            last_id = newest[0][0] if newest else "0-0"
        reply = cast(list | None, self.client.xread({self.keys.revoke: last_id}, block=block_ms))
        return _revocations(reply, last_id)


class AsyncGate(_GateBase):
    """Batch admission for one pool on an asyncio Redis client; see `Gate`."""

    def __init__(self, client: redis.asyncio.Redis, pool: str, *,
                 lease_ms: int = DEFAULT_LEASE_MS, batch_priority: int = BATCH_PRIORITY,
                 retry_ms: int = DEFAULT_RETRY_MS) -> None:
        super().__init__(pool, lease_ms=lease_ms, batch_priority=batch_priority,
                         retry_ms=retry_ms)
        self.client = client
        self._admit = client.register_script(script_text("admit"))
        self._release = client.register_script(script_text("release"))
        self._renew = client.register_script(script_text("renew"))
        self._inflight = client.register_script(script_text("inflight"))

    async def admit(self, request_id: str, prompt_tokens: int, max_output_tokens: int,
                    now_s: float | None = None) -> Admission:
        """See `Gate.admit`."""
        args = self._admit_args(request_id, prompt_tokens, max_output_tokens, now_s)
        reply = await self._admit(keys=self._admit_keys, args=args)
        return _admission(reply, self.batch_priority)

    async def admit_many(self, requests: Sequence[tuple[str, int, int]],
                         now_s: float | None = None) -> list[Admission]:
        """Admit several requests in one round trip (a pipeline of independent atomic
        scripts, in order); `requests` holds (request_id, prompt_tokens, max_output_tokens)."""
        async with self.client.pipeline(transaction=False) as pipe:
            for request_id, prompt_tokens, max_output_tokens in requests:
                args = self._admit_args(request_id, prompt_tokens, max_output_tokens, now_s)
                await self._admit(keys=self._admit_keys, args=args, client=pipe)
            replies = await pipe.execute()
        return [_admission(reply, self.batch_priority) for reply in replies]

    async def release_many(self, releases: Sequence[tuple[str, int | None]],
                           now_s: float | None = None) -> list[int]:
        """`release` for several (request_id, output_tokens) in one round trip."""
        async with self.client.pipeline(transaction=False) as pipe:
            for request_id, output_tokens in releases:
                args = self._release_args(request_id, output_tokens, now_s)
                await self._release(keys=self._release_keys, args=args, client=pipe)
            replies = await pipe.execute()
        return [int(refunded) if int(released) else -1 for released, refunded in replies]

    async def release(self, request_id: str, output_tokens: int | None,
                      now_s: float | None = None) -> int:
        """See `Gate.release`."""
        args = self._release_args(request_id, output_tokens, now_s)
        released, refunded = await self._release(keys=self._release_keys, args=args)
        return int(refunded) if int(released) else -1

    async def renew(self, request_id: str, now_s: float | None = None) -> bool:
        """See `Gate.renew`."""
        args = self._renew_args(request_id, now_s)
        return bool(await self._renew(keys=self._gate_keys, args=args))

    async def inflight(self, now_s: float | None = None) -> InFlight:
        """See `Gate.inflight`."""
        reply = await self._inflight(keys=self._gate_keys, args=[_now_arg(now_s), REAP_LIMIT])
        return _inflight(reply)

    async def revocations(self, last_id: str = "$", block_ms: int | None = None
                          ) -> tuple[str, list[Revocation]]:
        """See `Gate.revocations`."""
        _check_block(self.client, block_ms)
        if last_id == "$":
            newest = await cast(Awaitable[list], self.client.xrevrange(self.keys.revoke, count=1))
            last_id = newest[0][0] if newest else "0-0"
        reply = await cast(Awaitable[list | None],
                           self.client.xread({self.keys.revoke: last_id}, block=block_ms))
        return _revocations(reply, last_id)
