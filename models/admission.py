"""One pool's budget record and batch admission as the Lua scripts keep them in Redis, in pure
Python: the model the simulator admits batch by, checked against `adapters/lua/` (publish,
admit, release, renew, inflight) by a differential test on a real redis-server.

State (the Redis keys of the pool): the record and the epoch counter, the stop switch, the
token bucket (level, time), the KV tokens reserved, and per admitted request its reservation
(prompt + clamped max output), clamped output, lease end and admission order.

    admit:   reap expired leases; a live duplicate keeps its reservation (same prompt) and
             extends its lease; else deny unless the record is present, of the newest epoch,
             live (issued_at - ttl <= now < issued_at + ttl), not stopped, open or ramp, with
             rate, sequences and output > 0; out = min(max_output, cap), cost = prompt + out;
             deny `too_large` when cost > burst or > KV cap, `seq_cap` when the leases fill
             the sequence cap, `kv_cap` when reserved + cost > KV cap, `rate` (retry after
             ceil((cost - level) * 1000 / rate) ms) when the refilled bucket holds < cost;
             else take cost from the bucket and reserve it.
    release: free the reservation; refund (out - used) output tokens to the bucket, capped.
    renew:   extend a live lease.
    publish: fence by epoch, write the record (a `stopped` one while the stop switch is set),
             revoke the newest admissions until the caps hold, bring the bucket to now under
             the old record's rate and hold it to the new burst.

Times are integer milliseconds as the scripts take them; the bucket level is stored as Lua's
`tostring` stores it (14 significant digits), so levels agree to the last bit. The model keeps
the last record where Redis would drop the key at its TTL: the gate then says `no_budget`
where the model says `stale`; both deny.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from borrowd.models.budget import Budget, Mode, closed_budget
from borrowd.models.errors import FencedError, InputError

REAP_LIMIT = 256  # expired leases dropped per call (adapters.store.REAP_LIMIT)
MAX_EPOCH_JUMP = 1_000_000  # furthest a publish may move the epoch counter (publish.lua)
ADMITTING_MODES = (Mode.OPEN, Mode.RAMP)


def lua_stored(x: float) -> float:
    """`x` as Lua 5.1's `tostring` writes it into Redis ("%.14g") and reads it back."""
    return float(f"{x:.14g}")


def refill(tokens: float | None, ts_ms: float | None, now_ms: int, rate: float,
           burst: float) -> tuple[float, float]:
    """Bucket level and time at `now_ms`: refilled at `rate` tokens/s up to `burst`; a bucket
    never written starts full (common.lua `refill_from`)."""
    if tokens is None or ts_ms is None:
        tokens, ts_ms = burst, now_ms
    if now_ms > ts_ms:
        tokens = tokens + rate * (now_ms - ts_ms) / 1000.0
        ts_ms = now_ms
    return min(tokens, burst), ts_ms


@dataclass(frozen=True)
class Admission:
    """One admission decision, as admit.lua returns it."""

    admitted: bool
    reason: str
    retry_after_ms: int
    max_output_tokens: int
    lease_ms: int


@dataclass(frozen=True)
class Published:
    """A publication: the record as stored and the admissions it revoked, newest first."""

    record: Budget
    revoked: tuple[str, ...]


@dataclass
class Reservation:
    """One admitted request: its reservation, clamped output, lease end and order."""

    reserved_tokens: int
    max_output_tokens: int
    lease_until_ms: int
    order: int


@dataclass
class PoolGate:
    """One pool's record, stop switch, bucket and admissions (see the module docstring)."""

    pool: str
    reap_limit: int = REAP_LIMIT
    record: Budget | None = None
    epoch_counter: int = 0
    seq: int = 0
    stop_reason: str | None = None
    tokens: float | None = None
    ts_ms: float | None = None
    kv_tokens: int = 0
    counter: int = 0
    requests: dict[str, Reservation] = field(default_factory=dict)

    # -- the record ----------------------------------------------------------------------

    def publish(self, budget: Budget, *, epoch: int, ttl_ms: int, now_s: float) -> Published:
        """Write `budget` under `epoch` at `now_s` (publish.lua); `FencedError` when a newer
        epoch exists."""
        if ttl_ms <= 0:
            raise InputError(f"ttl_ms must be > 0, got {ttl_ms}")
        now_ms = int(now_s * 1000)
        newest = self.epoch_counter
        if (self.record is not None and self._live(self.record, now_ms)
                and newest < self.record.epoch <= self.epoch_counter + MAX_EPOCH_JUMP):
            newest = self.record.epoch
        if epoch < newest:
            raise FencedError(self.pool, epoch, newest)
        if epoch > self.epoch_counter + MAX_EPOCH_JUMP:
            raise InputError(f"epoch {epoch} is more than {MAX_EPOCH_JUMP} past the counter")
        self.epoch_counter = max(self.epoch_counter, epoch)
        if self.stop_reason is not None:
            budget = closed_budget(budget.pool, Mode.STOPPED,
                                   f"stopped by operator: {self.stop_reason}")
        self.seq += 1
        old = self.record
        self.record = budget.with_envelope(epoch=epoch, seq=self.seq, issued_at_s=float(now_s),
                                           ttl_ms=ttl_ms)
        self.reap(now_ms)
        revoked = self._revoke_over_caps(self.record)
        if self.tokens is not None:
            old_rate = old.batch_tokens_per_s if old is not None else 0.0
            old_burst = float(old.batch_burst_tokens) if old is not None else self.tokens
            tokens, self.ts_ms = refill(self.tokens, self.ts_ms, now_ms, old_rate, old_burst)
            self.tokens = lua_stored(min(tokens, float(self.record.batch_burst_tokens)))
        return Published(self.record, revoked)

    def _revoke_over_caps(self, record: Budget) -> tuple[str, ...]:
        revoked = []
        newest_first = sorted(self.requests, key=lambda rid: -self.requests[rid].order)
        for request_id in newest_first:
            if (len(self.requests) <= record.max_batch_seqs
                    and self.kv_tokens <= record.max_batch_kv_tokens):
                break
            self.kv_tokens -= self.requests.pop(request_id).reserved_tokens
            revoked.append(request_id)
        return tuple(revoked)

    @staticmethod
    def _live(record: Budget, now_ms: int) -> bool:
        issued_ms = record.issued_at_s * 1000
        return issued_ms - record.ttl_ms <= now_ms < issued_ms + record.ttl_ms

    # -- the gate ------------------------------------------------------------------------

    def reap(self, now_ms: int) -> tuple[str, ...]:
        """Drop up to `reap_limit` admissions whose lease ended at or before `now_ms`."""
        dead = sorted(
            (r.lease_until_ms, rid) for rid, r in self.requests.items()
            if r.lease_until_ms <= now_ms
        )[: self.reap_limit]
        for _, request_id in dead:
            self.kv_tokens -= self.requests.pop(request_id).reserved_tokens
        return tuple(rid for _, rid in dead)

    def admit(self, request_id: str, prompt_tokens: int, max_output_tokens: int, now_ms: int,
              *, lease_ms: int, retry_ms: float) -> Admission:
        """Admit one batch request at `now_ms` or say why not (admit.lua)."""

        def deny(reason: str, after_ms: float = retry_ms) -> Admission:
            return Admission(False, reason, math.ceil(after_ms), 0, 0)

        self.reap(now_ms)
        existing = self.requests.get(request_id)
        if existing is not None:
            if prompt_tokens != existing.reserved_tokens - existing.max_output_tokens:
                return deny("duplicate_mismatch")
            existing.lease_until_ms = now_ms + lease_ms
            return Admission(True, "duplicate", 0, existing.max_output_tokens, lease_ms)
        rec = self.record
        if rec is None:
            return deny("no_budget")
        if rec.epoch < self.epoch_counter:
            return deny("fenced")
        if not self._live(rec, now_ms):
            return deny("stale")
        if self.stop_reason is not None:
            return deny("stopped")
        if rec.mode not in ADMITTING_MODES:
            return deny(f"mode_{rec.mode.value}")
        if (rec.batch_tokens_per_s <= 0 or rec.max_batch_seqs <= 0
                or rec.max_batch_output_tokens <= 0):
            return deny("closed")
        out = min(max_output_tokens, rec.max_batch_output_tokens)
        cost = prompt_tokens + out
        if cost > rec.batch_burst_tokens or cost > rec.max_batch_kv_tokens:
            return deny("too_large")
        if len(self.requests) >= rec.max_batch_seqs:
            return deny("seq_cap")
        if self.kv_tokens + cost > rec.max_batch_kv_tokens:
            return deny("kv_cap")
        tokens, ts_ms = refill(self.tokens, self.ts_ms, now_ms, rec.batch_tokens_per_s,
                               float(rec.batch_burst_tokens))
        if tokens < cost:
            return deny("rate", (cost - tokens) * 1000.0 / rec.batch_tokens_per_s)
        self.counter += 1
        self.tokens, self.ts_ms = lua_stored(tokens - cost), ts_ms
        self.kv_tokens += cost
        self.requests[request_id] = Reservation(cost, out, now_ms + lease_ms, self.counter)
        return Admission(True, "admitted", 0, out, lease_ms)

    def release(self, request_id: str, output_tokens: int | None, now_ms: int) -> int:
        """Free a finished request; refund its unused output tokens (release.lua). The tokens
        refunded, or -1 when it was not in flight (released, revoked or expired)."""
        self.reap(now_ms)
        entry = self.requests.pop(request_id, None)
        if entry is None:
            return -1
        self.kv_tokens -= entry.reserved_tokens
        refund = 0
        if output_tokens is not None and output_tokens < entry.max_output_tokens:
            refund = entry.max_output_tokens - output_tokens
        rec = self.record
        if refund > 0 and rec is not None:
            burst = float(rec.batch_burst_tokens)
            tokens, self.ts_ms = refill(self.tokens, self.ts_ms, now_ms,
                                        rec.batch_tokens_per_s, burst)
            self.tokens = lua_stored(min(tokens + refund, burst))
        return refund

    def renew(self, request_id: str, now_ms: int, *, lease_ms: int) -> bool:
        """Extend a live admission's lease to `now_ms + lease_ms` (renew.lua)."""
        self.reap(now_ms)
        entry = self.requests.get(request_id)
        if entry is None:
            return False
        entry.lease_until_ms = now_ms + lease_ms
        return True

    def inflight(self, now_ms: int) -> tuple[int, int, float | None]:
        """Sequences and KV tokens in flight and the stored bucket level (inflight.lua)."""
        self.reap(now_ms)
        return len(self.requests), self.kv_tokens, self.tokens
