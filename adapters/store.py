"""The budget store: a pool's budget record in Redis, with lease, fencing, push and stop switch.

The controller publishes through `BudgetStore.publish` (one Lua script: fenced by epoch, TTL
lease, sequence number, pub/sub push, revocation of in-flight work above the new caps);
adapters read with `BudgetStore.read` or keep a pushed-and-polled copy in a `BudgetWatcher`.
`LeaderElection` elects one writer among daemon replicas and hands it its epoch.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import cast

import redis
import redis.asyncio
import structlog
from borrowd.adapters.lua import script_text
from borrowd.models.budget import MAX_RECORD_NUMBER, SCHEMA_VERSION, Budget, Mode, closed_budget
from borrowd.models.errors import BudgetRecordError, FencedError, InputError

log = structlog.get_logger(__name__)

# Ids of in-flight requests expired per script call; more wait for the next call (they still
# count against the caps until then, so the limit errs on the closed side).
REAP_LIMIT = 256
# Revocation stream length kept (approximate trim).
REVOKE_STREAM_MAXLEN = 10_000
# Between the holder id and the per-process nonce in the leader lease value.
LEASE_NONCE_SEP = "#"
# Furthest a publish may move the epoch counter forward (as MAX_EPOCH_JUMP in common.lua).
MAX_EPOCH_JUMP = 1_000_000
# Lease of the record the stop switch writes when no controller is publishing.
STOP_RECORD_TTL_MS = 3_600_000


@dataclass(frozen=True)
class PoolKeys:
    """Redis keys of one pool; all share the hash tag `{pool}` so scripts work on a cluster."""

    pool: str

    def __post_init__(self) -> None:
        if not self.pool or any(c in self.pool for c in "{}\r\n"):
            raise InputError(f"pool name {self.pool!r} must be non-empty and free of braces")

    def _key(self, suffix: str) -> str:
        return f"borrowd:{{{self.pool}}}:{suffix}"

    @property
    def budget(self) -> str:
        """Hash holding the budget record (PEXPIRE = its lease)."""
        return self._key("budget")

    @property
    def epoch(self) -> str:
        """Epoch counter (fencing token source)."""
        return self._key("epoch")

    @property
    def leader(self) -> str:
        """Leader lease key (value = holder id)."""
        return self._key("leader")

    @property
    def stop(self) -> str:
        """Stop switch (value = the operator's reason)."""
        return self._key("stop")

    @property
    def seq(self) -> str:
        """Record sequence counter."""
        return self._key("seq")

    @property
    def channel(self) -> str:
        """Pub/sub channel carrying each new record as JSON."""
        return self._key("budget:events")

    @property
    def revoke(self) -> str:
        """Stream of request ids to revoke, newest first within one cut."""
        return self._key("revoke")

    @property
    def leases(self) -> str:
        """Gate: ZSET request id -> admission lease expiry (ms)."""
        return self._key("gate:leases")

    @property
    def order(self) -> str:
        """Gate: ZSET request id -> admission counter."""
        return self._key("gate:order")

    @property
    def reqs(self) -> str:
        """Gate: HASH request id -> "reserved_tokens:clamped_max_output_tokens"."""
        return self._key("gate:reqs")

    @property
    def state(self) -> str:
        """Gate: HASH with the token bucket, reserved KV tokens and the admission counter."""
        return self._key("gate:state")

    def publish_keys(self) -> list[str]:
        """KEYS of publish.lua, in order."""
        return [self.budget, self.epoch, self.stop, self.seq, self.leases, self.order,
                self.reqs, self.state, self.revoke]


class ReadStatus(StrEnum):
    """Why a read found a usable record or not."""

    OK = "ok"
    ABSENT = "absent"
    EXPIRED = "expired"
    MALFORMED = "malformed"
    FOREIGN_SCHEMA = "foreign_schema"
    FENCED = "fenced"


@dataclass(frozen=True)
class RecordRead:
    """Outcome of one read: the usable record (or None) and why."""

    budget: Budget | None
    status: ReadStatus
    detail: str = ""


def parse_counter(text: str | None) -> int | None:
    """The stored epoch counter (0 when absent), or None when it is not a plain integer
    (the scripts then treat every record as malformed, as this does)."""
    if text is None:
        return 0
    if not re.fullmatch(r"[0-9]+", text) or int(text) > MAX_RECORD_NUMBER:
        return None
    return int(text)


def parse_record(pool: str, fields: dict[str, str], newest_epoch: int | None,
                 now_s: float) -> RecordRead:
    """Judge stored fields against the epoch counter (`newest_epoch`, None = malformed):
    usable, or absent/expired/malformed/foreign-schema/fenced, and why. The gate's admit
    script judges by the same rules."""
    if not fields:
        return RecordRead(None, ReadStatus.ABSENT)
    schema = fields.get("schema")
    if schema != str(SCHEMA_VERSION):
        return RecordRead(
            None, ReadStatus.FOREIGN_SCHEMA,
            f"record schema {schema!r}, this borrowd reads {SCHEMA_VERSION}",
        )
    try:
        budget = Budget.from_fields(fields)
    except BudgetRecordError as exc:
        return RecordRead(None, ReadStatus.MALFORMED, str(exc))
    if budget.pool != pool:
        return RecordRead(None, ReadStatus.MALFORMED, f"record names pool {budget.pool!r}")
    if newest_epoch is None:
        return RecordRead(None, ReadStatus.MALFORMED, "the epoch counter is not an integer")
    if budget.epoch > newest_epoch + MAX_EPOCH_JUMP:
        return RecordRead(
            None, ReadStatus.MALFORMED,
            f"record epoch {budget.epoch} is past the epoch counter {newest_epoch} by more "
            f"than {MAX_EPOCH_JUMP}",
        )
    if budget.epoch < newest_epoch:
        return RecordRead(
            None, ReadStatus.FENCED, f"record epoch {budget.epoch} < newest epoch {newest_epoch}"
        )
    if not budget.is_fresh(now_s):
        return RecordRead(
            None, ReadStatus.EXPIRED,
            f"lease issued at {budget.issued_at_s:.3f} s for {budget.ttl_ms} ms does not hold "
            f"at {now_s:.3f} s",
        )
    return RecordRead(budget, ReadStatus.OK)


_REPORTED = (ReadStatus.MALFORMED, ReadStatus.FOREIGN_SCHEMA, ReadStatus.FENCED)


def _report(pool: str, read: RecordRead, report: bool) -> RecordRead:
    if report and read.status in _REPORTED:
        log.warning("budget_record_unusable", pool=pool, reason=read.status.value,
                    detail=read.detail)
    return read


def _publish_args(
    keys: PoolKeys, action: str, budget: Budget, *, epoch: int, ttl_ms: int, now_s: float,
    stop_reason: str = "",
) -> list[str]:
    body = {k: v for k, v in budget.to_fields().items()
            if k not in ("schema", "epoch", "seq", "issued_at", "ttl_ms")}
    args = [action, keys.channel, str(SCHEMA_VERSION), str(epoch), str(ttl_ms),
            repr(float(now_s)), str(int(now_s * 1000)), stop_reason, str(REAP_LIMIT),
            str(REVOKE_STREAM_MAXLEN)]
    for name, value in body.items():
        args += [name, value]
    return args


def _check_publish(pool: str, budget: Budget, epoch: int, ttl_ms: int) -> None:
    if budget.pool != pool:
        raise InputError(f"budget for pool {budget.pool!r} published to pool {pool!r}")
    if ttl_ms <= 0:
        raise InputError(f"ttl_ms must be > 0, got {ttl_ms}")
    if epoch < 0:
        raise InputError(f"epoch must be >= 0, got {epoch}")


def _published(pool: str, epoch: int, reply: list) -> Budget:
    if int(reply[0]) == 0 and reply[1] == "epoch_jump":
        raise InputError(
            f"budget write to pool {pool!r} refused: epoch {epoch} is more than "
            f"{MAX_EPOCH_JUMP} past the epoch counter {int(reply[2])} (epochs come from the "
            "leader election)"
        )
    if int(reply[0]) == 0:
        raise FencedError(pool, epoch, int(reply[2]))
    budget = Budget.from_json(reply[1])
    if int(reply[2]):
        log.info("batch_revoked", pool=pool, count=int(reply[2]), epoch=budget.epoch,
                 seq=budget.seq, mode=budget.mode.value)
    return budget


class BudgetStore:
    """One pool's budget record in Redis (sync client); see the module docstring."""

    def __init__(self, client: redis.Redis, pool: str) -> None:
        self.client = client
        self.pool = pool
        self.keys = PoolKeys(pool)
        self._publish = client.register_script(script_text("publish"))
        self._resume = client.register_script(script_text("resume"))

    def publish(self, budget: Budget, *, epoch: int, ttl_ms: int, now_s: float) -> Budget:
        """Write `budget` under `epoch` with a `ttl_ms` lease; return the record as stored.

        Raises `FencedError` when a newer epoch exists. While the stop switch is set, the
        stored (and returned) record is a `stopped` one.
        """
        _check_publish(self.pool, budget, epoch, ttl_ms)
        args = _publish_args(self.keys, "publish", budget, epoch=epoch, ttl_ms=ttl_ms, now_s=now_s)
        return _published(self.pool, epoch, self._publish(keys=self.keys.publish_keys(), args=args))

    def read_record(self, now_s: float, *, report: bool = True) -> RecordRead:
        """The record and why it is (un)usable; with `report`, a malformed, foreign or fenced
        record is logged as a warning."""
        with self.client.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.keys.budget)
            pipe.get(self.keys.epoch)
            fields, epoch = pipe.execute()
        return _report(self.pool, parse_record(self.pool, fields, parse_counter(epoch), now_s),
                       report)

    def read(self, now_s: float) -> Budget | None:
        """The usable record at `now_s`, or None (absent, expired, malformed, foreign, fenced)."""
        return self.read_record(now_s).budget

    def stop(self, reason: str, *, now_s: float | None = None) -> Budget:
        """Set the stop switch and write a `stopped` record at once (revoking in-flight work)."""
        if not reason.strip():
            raise InputError("a stop needs a reason (--reason TEXT)")
        now_s = time.time() if now_s is None else now_s
        record = closed_budget(self.pool, Mode.STOPPED, reason)
        args = _publish_args(self.keys, "stop", record, epoch=0, ttl_ms=STOP_RECORD_TTL_MS,
                             now_s=now_s, stop_reason=reason)
        return _published(self.pool, 0, self._publish(keys=self.keys.publish_keys(), args=args))

    def resume(self) -> bool:
        """Clear the stop switch; True when it was set."""
        return bool(self._resume(keys=[self.keys.budget, self.keys.stop]))

    def stop_reason(self) -> str | None:
        """The operator's reason while the stop switch is set, else None."""
        return cast(str | None, self.client.get(self.keys.stop))


class AsyncBudgetStore:
    """`BudgetStore` on an asyncio client."""

    def __init__(self, client: redis.asyncio.Redis, pool: str) -> None:
        self.client = client
        self.pool = pool
        self.keys = PoolKeys(pool)
        self._publish = client.register_script(script_text("publish"))

    async def publish(self, budget: Budget, *, epoch: int, ttl_ms: int, now_s: float) -> Budget:
        """See `BudgetStore.publish`."""
        _check_publish(self.pool, budget, epoch, ttl_ms)
        args = _publish_args(self.keys, "publish", budget, epoch=epoch, ttl_ms=ttl_ms, now_s=now_s)
        reply = await self._publish(keys=self.keys.publish_keys(), args=args)
        return _published(self.pool, epoch, reply)

    async def read_record(self, now_s: float, *, report: bool = True) -> RecordRead:
        """See `BudgetStore.read_record`."""
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.keys.budget)
            pipe.get(self.keys.epoch)
            fields, epoch = await pipe.execute()
        return _report(self.pool, parse_record(self.pool, fields, parse_counter(epoch), now_s),
                       report)

    async def read(self, now_s: float) -> Budget | None:
        """See `BudgetStore.read`."""
        return (await self.read_record(now_s)).budget


def holder_of(lease_value: str) -> str:
    """The holder id in a leader lease value (`holder_id#nonce`)."""
    return lease_value.rpartition(LEASE_NONCE_SEP)[0] or lease_value


class LeaderElection:
    """Leader lease among daemon replicas: `SET NX PX` on the lease key, epoch via INCR.

    The lease value is `holder_id#nonce` with a nonce drawn once per election object, so two
    processes configured with the same `holder_id` are still two holders and only one leads.
    The holder publishes with the epoch `try_acquire` returned; once another replica takes
    over (after this lease lapsed) the publish script refuses the old epoch.
    """

    def __init__(self, client: redis.Redis, pool: str, holder_id: str, lease_ms: int) -> None:
        if lease_ms <= 0:
            raise InputError(f"leader lease_ms must be > 0, got {lease_ms}")
        self.keys = PoolKeys(pool)
        self.holder_id = holder_id
        self.lease_value = f"{holder_id}{LEASE_NONCE_SEP}{secrets.token_hex(8)}"
        self.lease_ms = lease_ms
        self.epoch: int | None = None
        self._acquire = client.register_script(script_text("leader_acquire"))
        self._renew = client.register_script(script_text("leader_renew"))
        self._release = client.register_script(script_text("leader_release"))

    def try_acquire(self) -> int | None:
        """Take (or keep) the lease; the epoch to publish with, or None when another holds it."""
        epoch = int(self._acquire(keys=[self.keys.leader, self.keys.epoch],
                                  args=[self.lease_value, self.lease_ms]))
        self.epoch = epoch or None
        return self.epoch

    def renew(self) -> bool:
        """Extend the lease if still the holder; False means leadership is lost."""
        held = bool(self._renew(keys=[self.keys.leader], args=[self.lease_value, self.lease_ms]))
        if not held:
            self.epoch = None
        return held

    def release(self) -> None:
        """Give the lease up (on shutdown) if still the holder."""
        self._release(keys=[self.keys.leader], args=[self.lease_value])
        self.epoch = None


def supersedes(candidate: Budget, current: Budget | None, now_s: float) -> bool:
    """True when `candidate` should replace `current`: it is newer by (epoch, seq), or the
    current one has lapsed (a restarted Redis starts its seq counter again)."""
    return (
        current is None
        or (candidate.epoch, candidate.seq) > (current.epoch, current.seq)
        or not current.is_fresh(now_s)
    )


class _WatchedRecord:
    """The newest record seen by push or poll; shared by the sync and asyncio watchers."""

    def __init__(self, pool: str) -> None:
        self.pool = pool
        self._lock = threading.Lock()
        self._budget: Budget | None = None
        self.last_status = ReadStatus.ABSENT

    def on_push(self, payload: str, now_s: float) -> None:
        """Take a record pushed on the pool's channel if it supersedes the one held."""
        try:
            budget = Budget.from_json(payload)
        except BudgetRecordError as exc:
            log.warning("budget_push_unusable", pool=self.pool, reason="malformed", detail=str(exc))
            return
        with self._lock:
            if budget.pool == self.pool and supersedes(budget, self._budget, now_s):
                self._budget = budget
                self.last_status = ReadStatus.OK

    def on_poll(self, read: RecordRead, now_s: float) -> None:
        """Take the result of a poll of the store; the store is authoritative."""
        with self._lock:
            if read.status is not self.last_status:
                # Once per change, not once per poll.
                _report(self.pool, read, report=True)
            self.last_status = read.status
            if read.budget is None:
                # The store is authoritative: no usable record there means none here.
                self._budget = None
            elif supersedes(read.budget, self._budget, now_s):
                self._budget = read.budget

    def current(self, now_s: float) -> Budget | None:
        """The record held, or None when there is none or its lease has expired."""
        with self._lock:
            budget = self._budget
        if budget is None or not budget.is_fresh(now_s):
            return None
        return budget


class BudgetWatcher:
    """Keeps a pool's newest record in a thread: pub/sub push plus a poll every `poll_s`.

    `current(now_s)` is the record, or None once its lease expired (or there is none): the
    caller then admits no batch work. A lost message only delays until the next poll.
    """

    def __init__(self, client: redis.Redis, pool: str, *, poll_s: float = 1.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = BudgetStore(client, pool)
        self.client = client
        self.poll_s = poll_s
        self.clock = clock
        self._record = _WatchedRecord(pool)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Set once subscribed and polled: from then on no record can be missed.
        self.ready = threading.Event()

    def current(self, now_s: float) -> Budget | None:
        """The newest fresh record at `now_s`, else None."""
        return self._record.current(now_s)

    @property
    def last_status(self) -> ReadStatus:
        """Status of the last poll (or OK after a push)."""
        return self._record.last_status

    def poll_once(self) -> None:
        """Read the store now (also called by the thread every `poll_s`)."""
        now_s = self.clock()
        self._record.on_poll(self.store.read_record(now_s, report=False), now_s)

    def start(self) -> BudgetWatcher:
        """Start the watching thread; returns self."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"budget-watch-{self.store.pool}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and wait for it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll_s + 5.0)
            self._thread = None

    def __enter__(self) -> BudgetWatcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        backoff_s = 0.05
        while not self._stop.is_set():
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self.store.keys.channel)
                self.poll_once()
                self.ready.set()
                next_poll = time.monotonic() + self.poll_s
                backoff_s = 0.05
                while not self._stop.is_set():
                    wait_s = max(0.0, min(0.2, next_poll - time.monotonic()))
                    message = pubsub.get_message(timeout=wait_s)
                    if message and message.get("type") == "message":
                        self._record.on_push(message["data"], self.clock())
                    if time.monotonic() >= next_poll:
                        self.poll_once()
                        next_poll = time.monotonic() + self.poll_s
            except (redis.RedisError, OSError) as exc:
                log.warning("budget_watch_redis_error", pool=self.store.pool, error=str(exc))
                self._stop.wait(backoff_s)
                backoff_s = min(backoff_s * 2, self.poll_s)
            finally:
                with contextlib.suppress(redis.RedisError, OSError):
                    pubsub.close()


class AsyncBudgetWatcher:
    """`BudgetWatcher` as an asyncio task."""

    def __init__(self, client: redis.asyncio.Redis, pool: str, *, poll_s: float = 1.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = AsyncBudgetStore(client, pool)
        self.client = client
        self.poll_s = poll_s
        self.clock = clock
        self._record = _WatchedRecord(pool)
        self._task: asyncio.Task | None = None
        # Set once subscribed and polled: from then on no record can be missed.
        self.ready = asyncio.Event()

    def current(self, now_s: float) -> Budget | None:
        """The newest fresh record at `now_s`, else None."""
        return self._record.current(now_s)

    @property
    def last_status(self) -> ReadStatus:
        """Status of the last poll (or OK after a push)."""
        return self._record.last_status

    async def poll_once(self) -> None:
        """Read the store now (also done by the task every `poll_s`)."""
        now_s = self.clock()
        self._record.on_poll(await self.store.read_record(now_s, report=False), now_s)

    async def start(self) -> AsyncBudgetWatcher:
        """Start the watching task; returns self."""
        self._task = asyncio.create_task(self._run(), name=f"budget-watch-{self.store.pool}")
        return self

    async def stop(self) -> None:
        """Cancel the task and wait for it."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def __aenter__(self) -> AsyncBudgetWatcher:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _run(self) -> None:
        backoff_s = 0.05
        while True:
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.store.keys.channel)
                await self.poll_once()
                self.ready.set()
                loop = asyncio.get_running_loop()
                next_poll = loop.time() + self.poll_s
                backoff_s = 0.05
                while True:
                    wait_s = max(0.0, min(0.2, next_poll - loop.time()))
                    message = await pubsub.get_message(timeout=wait_s)
                    if message and message.get("type") == "message":
                        self._record.on_push(message["data"], self.clock())
                    if loop.time() >= next_poll:
                        await self.poll_once()
                        next_poll = loop.time() + self.poll_s
            except (redis.RedisError, OSError) as exc:
                log.warning("budget_watch_redis_error", pool=self.store.pool, error=str(exc))
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, self.poll_s)
            finally:
                with contextlib.suppress(redis.RedisError, OSError):
                    await pubsub.aclose()
