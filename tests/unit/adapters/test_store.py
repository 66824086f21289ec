"""The budget store: lease, fencing, sequence, push, stop switch, leader election, watcher."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import structlog
from borrowd.adapters.redis_conn import connect, connect_async
from borrowd.adapters.store import (
    AsyncBudgetWatcher,
    BudgetStore,
    BudgetWatcher,
    FencedError,
    LeaderElection,
    PoolKeys,
    ReadStatus,
    holder_of,
    supersedes,
)
from borrowd.models.budget import Budget, Mode
from borrowd.models.errors import InputError

POOL = "p1"


def _budget(**overrides) -> Budget:
    fields = dict(pool=POOL, mode=Mode.OPEN, reason="law", batch_tokens_per_s=2000.0,
                  batch_burst_tokens=8000, max_batch_seqs=4, max_batch_kv_tokens=20_000,
                  max_batch_output_tokens=512)
    fields.update(overrides)
    return Budget(**fields)


@pytest.fixture
def client(redis_url):
    """A sync client on an empty real redis-server."""
    c = connect(redis_url)
    yield c
    c.close()


def test_publish_fills_envelope_and_read_returns_it(client) -> None:
    """A published record carries epoch, increasing seq, issued_at and ttl, and reads back."""
    store = BudgetStore(client, POOL)
    first = store.publish(_budget(), epoch=1, ttl_ms=3000, now_s=100.0)
    second = store.publish(_budget(reason="next"), epoch=1, ttl_ms=3000, now_s=101.0)
    assert (first.epoch, first.seq, first.issued_at_s, first.ttl_ms) == (1, 1, 100.0, 3000)
    assert second.seq == 2
    assert store.read(101.5) == second
    assert 0 < client.pttl(PoolKeys(POOL).budget) <= 3000


@pytest.mark.parametrize(
    ("now_s", "status"),
    [(102.9, ReadStatus.OK), (103.0, ReadStatus.EXPIRED)],
    ids=["inside-lease", "lease-over"],
)
def test_read_honours_lease(client, now_s, status) -> None:
    """A record is usable until issued_at + ttl, then read reports it expired."""
    store = BudgetStore(client, POOL)
    store.publish(_budget(), epoch=1, ttl_ms=3000, now_s=100.0)
    assert store.read_record(now_s).status is status


def test_older_epoch_is_fenced(client) -> None:
    """A write from an epoch older than the newest is refused by the script itself."""
    store = BudgetStore(client, POOL)
    store.publish(_budget(), epoch=5, ttl_ms=3000, now_s=100.0)
    with pytest.raises(FencedError, match="epoch 4 is older than epoch 5"):
        store.publish(_budget(reason="stale leader"), epoch=4, ttl_ms=3000, now_s=101.0)
    assert store.read(101.0).reason == "law"


def test_record_below_epoch_counter_reads_as_fenced(client) -> None:
    """A record whose epoch is older than the counter (a new leader exists) is not usable."""
    store = BudgetStore(client, POOL)
    store.publish(_budget(), epoch=1, ttl_ms=3000, now_s=100.0)
    client.set(PoolKeys(POOL).epoch, 2)
    assert store.read_record(100.5).status is ReadStatus.FENCED


@pytest.mark.parametrize(
    ("mutation", "status"),
    [
        ({"schema": "2"}, ReadStatus.FOREIGN_SCHEMA),
        ({"batch_tokens_per_s": "lots"}, ReadStatus.MALFORMED),
        ({"mode": "wide-open"}, ReadStatus.MALFORMED),
        ({"pool": "other"}, ReadStatus.MALFORMED),
    ],
    ids=["foreign-schema", "bad-number", "bad-mode", "other-pool"],
)
def test_bad_records_read_as_absent_and_are_reported(client, mutation, status) -> None:
    """A malformed or foreign record is treated as absent, with the reason logged."""
    store = BudgetStore(client, POOL)
    store.publish(_budget(), epoch=1, ttl_ms=3000, now_s=100.0)
    client.hset(PoolKeys(POOL).budget, mapping=mutation)
    with structlog.testing.capture_logs() as logs:
        read = store.read_record(100.5)
    assert read.budget is None
    assert read.status is status
    assert [e["reason"] for e in logs if e["event"] == "budget_record_unusable"] == [status.value]


def test_publish_pushes_record_on_channel(client) -> None:
    """Each publish sends the stored record as JSON on the pool's channel."""
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(PoolKeys(POOL).channel)
    stored = BudgetStore(client, POOL).publish(_budget(), epoch=1, ttl_ms=3000, now_s=100.0)
    message = None
    deadline = time.monotonic() + 2.0
    while message is None and time.monotonic() < deadline:
        message = pubsub.get_message(timeout=0.1)
    pubsub.close()
    assert message is not None
    assert Budget.from_json(message["data"]) == stored
    assert json.loads(message["data"])["seq"] == "1"


def test_stop_switch_outranks_controller_until_resume(client) -> None:
    """While stopped every publish stores a stopped record; resume lets the controller back."""
    store = BudgetStore(client, POOL)
    store.publish(_budget(), epoch=1, ttl_ms=3000, now_s=100.0)
    stopped = store.stop("maintenance", now_s=100.5)
    assert stopped.mode is Mode.STOPPED and stopped.epoch == 1
    assert store.stop_reason() == "maintenance"
    during = store.publish(_budget(), epoch=1, ttl_ms=3000, now_s=101.0)
    assert during.mode is Mode.STOPPED
    assert not during.admits_batch
    assert "maintenance" in during.reason
    assert store.resume() is True
    assert store.stop_reason() is None
    assert store.read(101.0) is None
    assert store.publish(_budget(), epoch=1, ttl_ms=3000, now_s=102.0).mode is Mode.OPEN


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"epoch": 1, "ttl_ms": 0}, "ttl_ms"),
        ({"epoch": -1, "ttl_ms": 100}, "epoch"),
    ],
    ids=["zero-ttl", "negative-epoch"],
)
def test_publish_rejects_bad_envelope(client, kwargs, message) -> None:
    """A zero lease or a negative epoch is an input error naming the field."""
    with pytest.raises(InputError, match=message):
        BudgetStore(client, POOL).publish(_budget(), now_s=1.0, **kwargs)


def test_publish_rejects_other_pools_budget(client) -> None:
    """A budget for another pool cannot be written under this pool's keys."""
    with pytest.raises(InputError, match="pool"):
        BudgetStore(client, POOL).publish(_budget(pool="p2"), epoch=1, ttl_ms=10, now_s=1.0)


def test_leader_election_hands_out_increasing_epochs(client) -> None:
    """Only one holder at a time; a new holder gets a higher epoch and fences the old one."""
    a = LeaderElection(client, POOL, "a", lease_ms=60_000)
    b = LeaderElection(client, POOL, "b", lease_ms=60_000)
    epoch_a = a.try_acquire()
    assert epoch_a == 1
    assert b.try_acquire() is None
    assert a.try_acquire() == epoch_a
    assert a.renew() is True
    store = BudgetStore(client, POOL)
    store.publish(_budget(), epoch=epoch_a, ttl_ms=3000, now_s=1.0)
    client.delete(PoolKeys(POOL).leader)  # a's lease lapses (paused process)
    assert a.renew() is False
    epoch_b = b.try_acquire()
    assert epoch_b == 2
    with pytest.raises(FencedError):
        store.publish(_budget(), epoch=epoch_a, ttl_ms=3000, now_s=2.0)
    a.release()
    assert holder_of(client.get(PoolKeys(POOL).leader)) == "b"
    b.release()
    assert client.get(PoolKeys(POOL).leader) is None


def test_two_processes_with_one_holder_id_never_both_lead(client) -> None:
    """Two daemons configured with the same holder_id: the lease carries a per-process nonce,
    so the second neither acquires nor renews nor releases the first one's lease."""
    first = LeaderElection(client, POOL, "host-a", lease_ms=60_000)
    twin = LeaderElection(client, POOL, "host-a", lease_ms=60_000)
    assert first.try_acquire() == 1
    assert twin.try_acquire() is None
    assert twin.renew() is False
    twin.release()
    assert first.renew() is True
    assert holder_of(client.get(PoolKeys(POOL).leader)) == "host-a"


def test_watcher_gets_push_and_expires_with_lease(client) -> None:
    """The thread watcher sees a publish by push and returns None once the lease is over."""
    store = BudgetStore(client, POOL)
    with BudgetWatcher(client, POOL, poll_s=30.0) as watcher:
        assert watcher.ready.wait(5.0)
        deadline = time.monotonic() + 5.0
        now_s = time.time()
        stored = store.publish(_budget(), epoch=1, ttl_ms=2000, now_s=now_s)
        while watcher.current(now_s) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watcher.current(now_s) == stored
        assert watcher.current(now_s + 2.0) is None


def test_watcher_poll_clears_vanished_record(client) -> None:
    """A poll that finds no usable record drops the watcher's copy (the store is authoritative)."""
    store = BudgetStore(client, POOL)
    watcher = BudgetWatcher(client, POOL, clock=lambda: 100.5)
    store.publish(_budget(), epoch=1, ttl_ms=3000, now_s=100.0)
    watcher.poll_once()
    assert watcher.current(100.5) is not None
    client.delete(PoolKeys(POOL).budget)
    watcher.poll_once()
    assert watcher.current(100.5) is None
    assert watcher.last_status is ReadStatus.ABSENT


async def test_async_watcher_gets_push(redis_url) -> None:
    """The asyncio watcher sees a publish by push well before its poll interval."""
    aclient = connect_async(redis_url)
    sync_client = connect(redis_url)
    try:
        watcher = AsyncBudgetWatcher(aclient, POOL, poll_s=30.0)
        async with watcher:
            await asyncio.wait_for(watcher.ready.wait(), 5.0)
            now_s = time.time()
            stored = BudgetStore(sync_client, POOL).publish(
                _budget(), epoch=1, ttl_ms=5000, now_s=now_s)
            for _ in range(200):
                if watcher.current(now_s) is not None:
                    break
                await asyncio.sleep(0.01)
            assert watcher.current(now_s) == stored
    finally:
        await aclient.aclose()
        sync_client.close()


@pytest.mark.parametrize(
    ("candidate", "current", "now_s", "expected"),
    [
        ((1, 5), None, 100.0, True),
        ((1, 6), (1, 5), 100.0, True),
        ((2, 1), (1, 9), 100.0, True),
        ((1, 4), (1, 5), 100.0, False),
        ((1, 1), (1, 5), 104.0, True),
    ],
    ids=["first", "next-seq", "new-epoch", "older-while-fresh", "older-after-lapse"],
)
def test_watcher_supersede_rule(candidate, current, now_s, expected) -> None:
    """A watcher takes a record newer by (epoch, seq), or any record once its copy lapsed."""

    def record(epoch_seq):
        epoch, seq = epoch_seq
        return _budget().with_envelope(epoch=epoch, seq=seq, issued_at_s=100.0, ttl_ms=3000)

    assert supersedes(record(candidate), current and record(current), now_s) is expected


def test_watcher_reports_a_bad_record_once_per_change(client) -> None:
    """Polling the same malformed record again does not log again; a new problem does."""
    store = BudgetStore(client, POOL)
    store.publish(_budget(), epoch=1, ttl_ms=3000, now_s=100.0)
    client.hset(PoolKeys(POOL).budget, "mode", "wide-open")
    watcher = BudgetWatcher(client, POOL, clock=lambda: 100.5)
    with structlog.testing.capture_logs() as logs:
        watcher.poll_once()
        watcher.poll_once()
        client.hset(PoolKeys(POOL).budget, "schema", "2")
        watcher.poll_once()
    reasons = [e["reason"] for e in logs if e["event"] == "budget_record_unusable"]
    assert reasons == ["malformed", "foreign_schema"]
