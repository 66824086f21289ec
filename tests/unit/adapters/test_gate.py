"""The admission gate's Lua decisions: record checks, bucket, caps, leases, release, revocation."""

from __future__ import annotations

import time

import pytest
from borrowd.adapters.gate import Admission, AsyncGate, Gate
from borrowd.adapters.redis_conn import connect, connect_async
from borrowd.adapters.store import BudgetStore, PoolKeys
from borrowd.models.budget import Budget, Mode
from borrowd.models.errors import InputError

POOL = "p1"
T0 = 1_000.0


def _budget(**overrides) -> Budget:
    fields = dict(pool=POOL, mode=Mode.OPEN, reason="law", batch_tokens_per_s=1000.0,
                  batch_burst_tokens=4000, max_batch_seqs=3, max_batch_kv_tokens=3000,
                  max_batch_output_tokens=500)
    fields.update(overrides)
    return Budget(**fields)


@pytest.fixture
def client(redis_url):
    """A sync client on an empty real redis-server."""
    c = connect(redis_url)
    yield c
    c.close()


def _open(client, **overrides) -> BudgetStore:
    store = BudgetStore(client, POOL)
    store.publish(_budget(**overrides), epoch=1, ttl_ms=60_000, now_s=T0)
    return store


def test_admit_clamps_output_and_injects_priority(client) -> None:
    """An admission clamps max output to the cap and carries the batch priority and lease."""
    _open(client)
    gate = Gate(client, POOL, lease_ms=5000, batch_priority=7)
    admission = gate.admit("r1", 100, 2000, now_s=T0)
    assert admission == Admission(True, "admitted", 0.0, 500, 5000, 7)
    assert gate.inflight(now_s=T0).kv_tokens == 600


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        (lambda c: None, "no_budget"),
        (lambda c: c.hset(PoolKeys(POOL).budget, "schema", "9"), "foreign_schema"),
        (lambda c: c.hset(PoolKeys(POOL).budget, "max_batch_seqs", "x"), "malformed"),
        (lambda c: c.set(PoolKeys(POOL).epoch, 2), "fenced"),
        (lambda c: BudgetStore(c, POOL).stop("ops", now_s=T0), "stopped"),
        (lambda c: c.hset(PoolKeys(POOL).budget, "mode", "closed"), "mode_closed"),
        (lambda c: c.hset(PoolKeys(POOL).budget, "max_batch_output_tokens", "0"), "closed"),
    ],
    ids=["no-record", "foreign-schema", "malformed", "older-epoch", "stop-switch",
         "closed-mode", "zero-output-cap"],
)
def test_unusable_record_denies(client, setup, reason) -> None:
    """No usable record (absent, foreign, malformed, fenced, stopped, closed) denies batch."""
    if reason != "no_budget":
        _open(client)
    setup(client)
    admission = Gate(client, POOL).admit("r1", 10, 10, now_s=T0 + 1)
    assert (admission.admitted, admission.reason) == (False, reason)
    assert admission.retry_after_s > 0


def test_stale_record_denied_on_callers_clock(client) -> None:
    """With the caller's clock, a record past issued_at + ttl denies even if the key lingers."""
    BudgetStore(client, POOL).publish(_budget(), epoch=1, ttl_ms=60_000, now_s=T0)
    assert Gate(client, POOL).admit("r1", 10, 10, now_s=T0 + 60.0).reason == "stale"


@pytest.mark.parametrize(
    ("requests", "reasons"),
    [
        ([(100, 100)] * 4, ["admitted"] * 3 + ["seq_cap"]),
        ([(1000, 500), (1000, 500), (100, 10)], ["admitted", "admitted", "kv_cap"]),
        ([(3000, 500)], ["too_large"]),
    ],
    ids=["sequence-cap", "kv-cap", "larger-than-kv-cap"],
)
def test_caps(client, requests, reasons) -> None:
    """The sequence cap and the KV-token cap each stop admissions at their limit."""
    _open(client)
    gate = Gate(client, POOL)
    got = [gate.admit(f"r{i}", p, o, now_s=T0).reason for i, (p, o) in enumerate(requests)]
    assert got == reasons


def test_token_bucket_refills_at_rate(client) -> None:
    """Cost = prompt + clamped output comes out of the bucket, which refills at the rate."""
    _open(client, max_batch_seqs=100, max_batch_kv_tokens=100_000, batch_burst_tokens=2000)
    gate = Gate(client, POOL)
    assert gate.admit("a", 1500, 500, now_s=T0).admitted
    denied = gate.admit("b", 500, 500, now_s=T0)
    assert denied.reason == "rate"
    assert denied.retry_after_s == pytest.approx(1.0)
    assert not gate.admit("b", 500, 500, now_s=T0 + 0.9).admitted
    assert gate.admit("b", 500, 500, now_s=T0 + 1.0).admitted


def test_release_frees_capacity_and_refunds_unused(client) -> None:
    """Release frees the seat and KV, and returns unused output tokens to the bucket."""
    _open(client, max_batch_seqs=1)
    gate = Gate(client, POOL)
    assert gate.admit("a", 100, 400, now_s=T0).admitted
    assert gate.admit("b", 100, 400, now_s=T0).reason == "seq_cap"
    assert gate.release("a", 150, now_s=T0) == 250
    assert gate.inflight(now_s=T0).bucket_tokens == pytest.approx(4000 - 500 + 250)
    assert gate.release("a", 150, now_s=T0) == -1
    assert gate.admit("b", 100, 400, now_s=T0).admitted


def test_release_with_unknown_output_refunds_nothing(client) -> None:
    """Releasing without an output count frees the seat but keeps the tokens spent."""
    _open(client)
    gate = Gate(client, POOL)
    gate.admit("a", 100, 400, now_s=T0)
    assert gate.release("a", None, now_s=T0) == 0
    assert gate.inflight(now_s=T0).seqs == 0


def test_expired_lease_returns_capacity_and_renew_keeps_it(client) -> None:
    """A request whose lease lapsed is reaped by the next script; a renewed one survives."""
    _open(client, max_batch_seqs=2)
    gate = Gate(client, POOL, lease_ms=1000)
    gate.admit("crashed", 100, 100, now_s=T0)
    gate.admit("alive", 100, 100, now_s=T0)
    assert gate.renew("alive", now_s=T0 + 0.9)
    assert gate.admit("new", 100, 100, now_s=T0 + 0.99).reason == "seq_cap"
    assert gate.admit("new", 100, 100, now_s=T0 + 1.0).admitted
    assert gate.inflight(now_s=T0 + 1.0).seqs == 2
    assert not gate.renew("crashed", now_s=T0 + 1.0)
    assert gate.release("crashed", 0, now_s=T0 + 1.0) == -1


def test_duplicate_admit_keeps_one_reservation(client) -> None:
    """Retrying the same request id renews it instead of reserving twice."""
    _open(client)
    gate = Gate(client, POOL)
    gate.admit("a", 100, 100, now_s=T0)
    assert gate.admit("a", 100, 100, now_s=T0).reason == "duplicate"
    assert gate.inflight(now_s=T0).seqs == 1


def test_cut_revokes_newest_first(client) -> None:
    """A budget below what is in flight names the newest requests on the revoke stream."""
    store = _open(client, max_batch_seqs=5, max_batch_kv_tokens=10_000)
    gate = Gate(client, POOL)
    for name in ("old", "mid", "new1", "new2"):
        assert gate.admit(name, 100, 100, now_s=T0).admitted
    last_id, before = gate.revocations("0")
    assert before == []
    store.publish(_budget(max_batch_seqs=2, max_batch_kv_tokens=10_000), epoch=1,
                  ttl_ms=60_000, now_s=T0 + 1)
    last_id, revoked = gate.revocations(last_id)
    assert [r.request_id for r in revoked] == ["new2", "new1"]
    assert {r.reason for r in revoked} == {"seq_cap"}
    assert gate.inflight(now_s=T0 + 1).seqs == 2
    assert gate.release("new2", 10, now_s=T0 + 1) == -1
    assert gate.revocations(last_id)[1] == []


def test_kv_cut_and_stop_revoke(client) -> None:
    """A KV cut revokes until the reservations fit; the stop switch revokes everything."""
    store = _open(client, max_batch_seqs=5, max_batch_kv_tokens=10_000)
    gate = Gate(client, POOL)
    for name in ("a", "b", "c"):
        gate.admit(name, 400, 100, now_s=T0)
    store.publish(_budget(max_batch_seqs=5, max_batch_kv_tokens=1200), epoch=1, ttl_ms=60_000,
                  now_s=T0)
    last_id, revoked = gate.revocations("0")
    assert [(r.request_id, r.reason) for r in revoked] == [("c", "kv_cap")]
    store.stop("incident", now_s=T0)
    _, revoked = gate.revocations(last_id)
    assert [(r.request_id, r.reason) for r in revoked] == [("b", "stopped"), ("a", "stopped")]
    assert gate.inflight(now_s=T0).seqs == 0


def test_revocations_from_now_sees_only_new_entries(client) -> None:
    """Reading from "$" skips old revocations and still sees the next cut."""
    store = _open(client, max_batch_seqs=5)
    gate = Gate(client, POOL)
    gate.admit("old", 10, 10, now_s=T0)
    store.stop("first", now_s=T0)
    last_id, entries = gate.revocations("$")
    assert entries == []
    store.resume()
    _open(client, max_batch_seqs=5)
    # The stop emptied the bucket (burst 0); it refills at the rate from there.
    assert gate.admit("later", 10, 10, now_s=T0 + 1).admitted
    store.stop("second", now_s=T0 + 1)
    _, entries = gate.revocations(last_id, block_ms=100)
    assert [e.request_id for e in entries] == ["later"]


@pytest.mark.parametrize(
    ("args", "message"),
    [(("", 1, 1), "request_id"), (("a", -1, 1), "prompt_tokens"),
     (("a", 1, 0), "max_output_tokens")],
    ids=["empty-id", "negative-prompt", "zero-output"],
)
def test_bad_request_is_named(client, args, message) -> None:
    """Malformed admission input raises InputError naming the argument."""
    with pytest.raises(InputError, match=message):
        Gate(client, POOL).admit(*args)


def test_server_clock_admission(client) -> None:
    """Without now_s the scripts use the Redis server's clock (a real-time record admits)."""
    BudgetStore(client, POOL).publish(_budget(), epoch=1, ttl_ms=5000, now_s=time.time())
    gate = Gate(client, POOL)
    assert gate.admit("a", 10, 10).admitted
    assert gate.renew("a")
    assert gate.release("a", 5) == 5


async def test_async_gate_matches_sync(redis_url) -> None:
    """AsyncGate makes the same decisions as Gate."""
    sync_client = connect(redis_url)
    aclient = connect_async(redis_url)
    try:
        _open(sync_client, max_batch_seqs=1)
        gate = AsyncGate(aclient, POOL)
        assert (await gate.admit("a", 10, 10, now_s=T0)).admitted
        assert (await gate.admit("b", 10, 10, now_s=T0)).reason == "seq_cap"
        assert await gate.renew("a", now_s=T0)
        assert (await gate.inflight(now_s=T0)).seqs == 1
        assert await gate.release("a", 4, now_s=T0) == 6
    finally:
        await aclient.aclose()
        sync_client.close()


async def test_async_pipelined_decisions_match_one_by_one(redis_url) -> None:
    """admit_many/release_many decide in order, exactly as the same calls one by one."""
    sync_client = connect(redis_url)
    aclient = connect_async(redis_url)
    try:
        _open(sync_client, max_batch_seqs=2)
        gate = AsyncGate(aclient, POOL)
        admissions = await gate.admit_many([("a", 10, 10), ("b", 10, 10), ("c", 10, 10)],
                                           now_s=T0)
        assert [a.reason for a in admissions] == ["admitted", "admitted", "seq_cap"]
        assert await gate.release_many([("a", 4), ("zz", 1)], now_s=T0) == [6, -1]
    finally:
        await aclient.aclose()
        sync_client.close()


@pytest.mark.parametrize(
    ("block_ms", "message"),
    [(0, "block_ms must be > 0"), (5000, "socket timeout")],
    ids=["zero-blocks-forever", "longer-than-socket-timeout"],
)
def test_revocations_refuse_unsafe_block(client, block_ms, message) -> None:
    """A block of 0 (forever) or past the socket timeout is refused up front."""
    with pytest.raises(InputError, match=message):
        Gate(client, POOL).revocations("0", block_ms=block_ms)


def test_stop_empties_bucket_from_the_stop_on(client) -> None:
    """After a stop the bucket restarts empty at the stop time, not full from long before."""
    store = _open(client)
    gate = Gate(client, POOL)
    assert gate.admit("a", 10, 10, now_s=T0).admitted
    store.stop("ops", now_s=T0 + 10)
    store.resume()
    store.publish(_budget(), epoch=1, ttl_ms=60_000, now_s=T0 + 10)
    assert gate.admit("b", 500, 500, now_s=T0 + 10.5).reason == "rate"
    assert gate.admit("b", 500, 500, now_s=T0 + 11).admitted


def test_writer_clock_ahead_does_not_reap_live_leases(client) -> None:
    """A publisher whose clock runs an hour ahead never expires leases live on Redis's clock."""
    store = BudgetStore(client, POOL)
    store.publish(_budget(), epoch=1, ttl_ms=60_000, now_s=time.time())
    gate = Gate(client, POOL, lease_ms=30_000)
    assert gate.admit("live", 10, 10).admitted
    store.publish(_budget(), epoch=1, ttl_ms=60_000, now_s=time.time() + 3600)
    assert gate.inflight().seqs == 1
