"""Budget bus faults against a real redis-server that the test starts, kills and restarts."""

from __future__ import annotations

import time

import pytest
import redis
import structlog
from borrowd.adapters.gate import Gate
from borrowd.adapters.redis_conn import connect
from borrowd.adapters.store import (
    BudgetStore,
    BudgetWatcher,
    FencedError,
    LeaderElection,
    PoolKeys,
    ReadStatus,
)
from borrowd.models.budget import Budget, Mode

from tests.support.servers import start_redis, wait_until

pytestmark = pytest.mark.integration

POOL = "p1"


def _budget(**overrides) -> Budget:
    fields = dict(pool=POOL, mode=Mode.OPEN, reason="law", batch_tokens_per_s=2000.0,
                  batch_burst_tokens=8000, max_batch_seqs=2, max_batch_kv_tokens=20_000,
                  max_batch_output_tokens=512)
    fields.update(overrides)
    return Budget(**fields)


def test_watcher_fails_closed_within_one_lease_and_recovers(redis_proc) -> None:
    """Redis killed: the watcher's record lapses by the end of its lease (no new batch);
    Redis back and a new record published: the watcher reconnects and picks it up."""
    url = redis_proc.extra["url"]
    client = connect(url, connect_timeout_s=0.2, socket_timeout_s=0.5)
    ttl_ms = 800
    with BudgetWatcher(client, POOL, poll_s=0.1) as watcher:
        assert watcher.ready.wait(5)
        issued = time.time()
        BudgetStore(client, POOL).publish(_budget(), epoch=1, ttl_ms=ttl_ms, now_s=issued)
        wait_until(lambda: watcher.current(time.time()) is not None, 2.0, "record pushed")
        port = redis_proc.port
        redis_proc.kill()
        killed = time.time()
        wait_until(lambda: watcher.current(time.time()) is None, 2.0, "record lapsed")
        assert time.time() <= issued + ttl_ms / 1000 + 0.2
        assert time.time() - killed < ttl_ms / 1000 + 0.2
        restarted = start_redis(port=port)
        try:
            BudgetStore(client, POOL).publish(_budget(reason="back"), epoch=1, ttl_ms=5000,
                                              now_s=time.time())
            wait_until(lambda: (b := watcher.current(time.time())) is not None
                       and b.reason == "back", 5.0, "record after restart")
        finally:
            restarted.stop()


def test_gate_raises_on_dead_redis_and_resumes(redis_proc) -> None:
    """The library gate raises a Redis error (callers deny batch) and works once Redis is back."""
    url = redis_proc.extra["url"]
    client = connect(url, connect_timeout_s=0.2, socket_timeout_s=0.5)
    gate = Gate(client, POOL)
    BudgetStore(client, POOL).publish(_budget(), epoch=1, ttl_ms=5000, now_s=time.time())
    assert gate.admit("a", 10, 10).admitted
    port = redis_proc.port
    redis_proc.kill()
    with pytest.raises(redis.ConnectionError):
        gate.admit("b", 10, 10)
    restarted = start_redis(port=port)
    try:
        assert gate.admit("b", 10, 10).reason == "no_budget"
        BudgetStore(client, POOL).publish(_budget(), epoch=1, ttl_ms=5000, now_s=time.time())
        assert gate.admit("b", 10, 10).admitted
    finally:
        restarted.stop()


def test_stale_leader_write_refused_after_lease_lapses(redis_proc) -> None:
    """A leader paused past its lease loses it; its next write is fenced and the gate refuses
    its old record once the new leader's epoch exists."""
    client = connect(redis_proc.extra["url"])
    store = BudgetStore(client, POOL)
    old = LeaderElection(client, POOL, "daemon-a", lease_ms=300)
    new = LeaderElection(client, POOL, "daemon-b", lease_ms=300)
    old_epoch = old.try_acquire()
    store.publish(_budget(), epoch=old_epoch, ttl_ms=10_000, now_s=time.time())
    assert new.try_acquire() is None
    wait_until(lambda: new.try_acquire() is not None, 2.0, "lease lapse and takeover")
    assert new.epoch == old_epoch + 1
    assert Gate(client, POOL).admit("r", 10, 10).reason == "fenced"
    assert store.read_record(time.time()).status is ReadStatus.FENCED
    with pytest.raises(FencedError):
        store.publish(_budget(reason="stale"), epoch=old_epoch, ttl_ms=10_000, now_s=time.time())
    assert old.renew() is False
    store.publish(_budget(reason="new leader"), epoch=new.epoch, ttl_ms=10_000,
                  now_s=time.time())
    assert Gate(client, POOL).admit("r", 10, 10).admitted


def test_expired_admission_lease_returns_capacity_in_real_time(redis_proc) -> None:
    """A router that admits and dies leaks nothing: after the lease the seats come back."""
    client = connect(redis_proc.extra["url"])
    BudgetStore(client, POOL).publish(_budget(), epoch=1, ttl_ms=10_000, now_s=time.time())
    crashed_router = Gate(client, POOL, lease_ms=300)
    assert crashed_router.admit("x1", 10, 10).admitted
    assert crashed_router.admit("x2", 10, 10).admitted
    other = Gate(client, POOL, lease_ms=300)
    assert other.admit("y", 10, 10).reason == "seq_cap"
    wait_until(lambda: other.admit("y", 10, 10).admitted, 2.0, "leases reaped")
    assert other.inflight().seqs == 1


@pytest.mark.parametrize(
    ("field", "value", "status"),
    [("schema", "7", ReadStatus.FOREIGN_SCHEMA), ("max_batch_seqs", "-", ReadStatus.MALFORMED)],
    ids=["foreign-schema", "malformed"],
)
def test_bad_record_is_absent_for_watcher_and_gate(redis_proc, field, value, status) -> None:
    """A record another writer corrupted is treated as absent by the watcher and the gate, and
    the watcher logs why."""
    client = connect(redis_proc.extra["url"])
    BudgetStore(client, POOL).publish(_budget(), epoch=1, ttl_ms=10_000, now_s=time.time())
    client.hset(PoolKeys(POOL).budget, field, value)
    watcher = BudgetWatcher(client, POOL)
    with structlog.testing.capture_logs() as logs:
        watcher.poll_once()
    assert watcher.current(time.time()) is None
    assert watcher.last_status is status
    assert any(e.get("reason") == status.value for e in logs)
    assert not Gate(client, POOL).admit("r", 10, 10).admitted
