"""The scripts validate what they read, and a record lives by its own lease on Redis's clock.

Against a real redis-server: records, reservations and bucket state written by hand with the
values Lua's `tonumber` would take (nan, inf, 1e300, hex, spaces) are malformed to the gate
and to `borrowd status` alike, and never wedge the scripts that reap; a record's lease is
`issued_at + ttl_ms` checked against Redis TIME, whatever the key's TTL says; an absurd
epoch cannot fence the elected controller out.
"""

from __future__ import annotations

import time
from importlib import resources

import pytest
import redis
from borrowd.adapters.gate import Gate
from borrowd.adapters.redis_conn import connect
from borrowd.adapters.store import BudgetStore, PoolKeys, ReadStatus
from borrowd.models.budget import Budget, Mode
from borrowd.models.errors import BudgetRecordError, InputError
from hypothesis import given, settings
from hypothesis import strategies as st

POOL = "p1"
KEYS = PoolKeys(POOL)


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


def _open(client, ttl_ms: int = 60_000, now_s: float | None = None, epoch: int = 1) -> None:
    BudgetStore(client, POOL).publish(_budget(), epoch=epoch, ttl_ms=ttl_ms,
                                      now_s=time.time() if now_s is None else now_s)


BAD_NUMBERS = ["nan", "inf", "-inf", "1e300", "0x10", " 5", "5 ", "1_000", "-1", "", "5\n"]


@pytest.mark.parametrize("field", ["max_batch_seqs", "max_batch_kv_tokens", "batch_burst_tokens",
                                   "max_batch_output_tokens", "batch_tokens_per_s", "issued_at",
                                   "ttl_ms", "epoch"])
@pytest.mark.parametrize("value", BAD_NUMBERS)
def test_gate_and_status_agree_that_bad_numbers_are_malformed(client, field, value) -> None:
    """A record number Lua's tonumber would take is malformed to the gate (batch denied)
    and to the store's reader (`borrowd status`) alike."""
    _open(client)
    client.hset(KEYS.budget, field, value)
    admission = Gate(client, POOL).admit("r1", 10, 10)
    assert (admission.admitted, admission.reason) == (False, "malformed")
    assert BudgetStore(client, POOL).read_record(time.time(), report=False).status is (
        ReadStatus.MALFORMED)


@pytest.mark.parametrize("entry",
                         ["nan:5", "inf:1", "1e300:1", "0x10:1", "5", ":", "9" * 40 + ":1"])
def test_a_malformed_reservation_never_wedges_the_scripts(client, entry) -> None:
    """A hand-written reservation under a lease that ended is reaped by admit, and release,
    publish, stop and inflight all still answer; the KV sum is recomputed, not poisoned."""
    _open(client)
    gate = Gate(client, POOL, lease_ms=60_000)
    assert gate.admit("good", 100, 100).admitted
    client.hset(KEYS.reqs, "evil", entry)
    client.zadd(KEYS.leases, {"evil": 1})
    client.zadd(KEYS.order, {"evil": 99})
    assert gate.admit("next", 100, 100).admitted
    assert gate.inflight().kv_tokens == 400
    assert gate.release("good", 50) == 50
    _open(client)
    BudgetStore(client, POOL).stop("ops")
    assert gate.inflight().seqs == 0


@pytest.mark.parametrize("entry", ["nan:5", "1e300:1"])
def test_a_live_malformed_reservation_is_revoked_and_released_cleanly(client, entry) -> None:
    """A malformed reservation still in its lease: a cut revokes it, a release frees it."""
    _open(client)
    client.hset(KEYS.reqs, "evil", entry)
    client.zadd(KEYS.leases, {"evil": time.time() * 1000 + 60_000})
    client.zadd(KEYS.order, {"evil": 1})
    gate = Gate(client, POOL)
    assert gate.release("evil", 1) == 0
    client.hset(KEYS.reqs, "evil2", entry)
    client.zadd(KEYS.leases, {"evil2": time.time() * 1000 + 60_000})
    client.zadd(KEYS.order, {"evil2": 2})
    BudgetStore(client, POOL).publish(_budget(max_batch_seqs=0), epoch=1, ttl_ms=60_000,
                                      now_s=time.time())
    assert gate.inflight().seqs == 0


@pytest.mark.parametrize(("field", "value"), [("kv_tokens", "nan"), ("kv_tokens", "-5"),
                                              ("tokens", "nan"), ("tokens", "inf"),
                                              ("ts_ms", "0x10")])
def test_malformed_gate_state_fails_closed_and_heals(client, field, value) -> None:
    """A poisoned bucket is empty (no infinite tokens); a poisoned KV sum is recomputed."""
    _open(client)
    gate = Gate(client, POOL)
    assert gate.admit("a", 100, 100).admitted
    client.hset(KEYS.state, field, value)
    decision = gate.admit("b", 100, 100)
    if field == "kv_tokens":
        assert decision.admitted
        assert gate.inflight().kv_tokens == 400
    else:
        assert (decision.admitted, decision.reason) == (False, "rate")


def test_a_record_without_key_ttl_ends_with_its_own_lease(client) -> None:
    """PERSIST on the record (no key TTL): past issued_at + ttl_ms on Redis's clock the gate
    says stale, and the Python readers say expired."""
    _open(client, ttl_ms=300)
    client.persist(KEYS.budget)
    assert Gate(client, POOL).admit("a", 10, 10).admitted
    time.sleep(0.4)
    assert Gate(client, POOL).admit("b", 10, 10).reason == "stale"
    read = BudgetStore(client, POOL).read_record(time.time(), report=False)
    assert read.status is ReadStatus.EXPIRED


@pytest.mark.parametrize("skew_s", [-120.0, 3600.0], ids=["writer-120s-behind", "writer-1h-ahead"])
def test_a_skewed_writer_records_are_judged_alike_by_gate_and_plugin(client, skew_s) -> None:
    """A daemon 120 s behind or an hour ahead publishes a record that the gate (Redis TIME)
    and the engine plugin's rule (Budget.is_fresh on a correct clock) both refuse."""
    _open(client, ttl_ms=5000, now_s=time.time() + skew_s)
    client.persist(KEYS.budget)
    assert Gate(client, POOL).admit("a", 10, 10).reason == "stale"
    stored = Budget.from_fields(client.hgetall(KEYS.budget))
    assert not stored.is_fresh(time.time())


def test_an_absurd_epoch_never_fences_the_controller_out(client) -> None:
    """A record written with a huge epoch is malformed, not a fence: the elected controller
    keeps publishing; a publish that would jump the epoch counter past any election is
    refused."""
    _open(client, epoch=1)
    client.hset(KEYS.budget, "epoch", str(10**14))
    client.persist(KEYS.budget)
    assert Gate(client, POOL).admit("a", 10, 10).reason == "malformed"
    store = BudgetStore(client, POOL)
    assert store.read_record(time.time(), report=False).status is ReadStatus.MALFORMED
    stored = store.publish(_budget(reason="controller"), epoch=1, ttl_ms=60_000,
                           now_s=time.time())
    assert stored.epoch == 1
    with pytest.raises(InputError, match="past the epoch counter"):
        store.publish(_budget(), epoch=10**12, ttl_ms=60_000, now_s=time.time())
    assert store.publish(_budget(), epoch=1, ttl_ms=60_000, now_s=time.time()).epoch == 1
    assert Gate(client, POOL).admit("b", 10, 10).admitted


def test_retry_with_another_prompt_is_refused(client) -> None:
    """A re-admit of a live id with the same figures is a duplicate; with a larger prompt it
    is refused (it was never charged for the difference)."""
    _open(client)
    gate = Gate(client, POOL)
    assert gate.admit("a", 100, 100).reason == "admitted"
    assert gate.admit("a", 100, 100).reason == "duplicate"
    refused = gate.admit("a", 15_000, 100)
    assert (refused.admitted, refused.reason) == (False, "duplicate_mismatch")
    assert gate.inflight().kv_tokens == 200


@pytest.mark.parametrize("counter", ["nan", "1e300", "x"])
def test_stop_works_with_a_malformed_epoch_counter(client, counter) -> None:
    """A broken epoch counter: the gate denies batch (malformed), the controller's publish is
    refused with a Redis error naming it, and `borrowd stop` still stops the pool."""
    _open(client)
    client.set(KEYS.epoch, counter)
    assert Gate(client, POOL).admit("a", 10, 10).reason == "malformed"
    store = BudgetStore(client, POOL)
    assert store.read_record(time.time(), report=False).status is ReadStatus.MALFORMED
    with pytest.raises(redis.ResponseError, match="epoch counter is malformed"):
        store.publish(_budget(), epoch=1, ttl_ms=60_000, now_s=time.time())
    assert store.stop("ops").mode is Mode.STOPPED
    assert store.stop_reason() == "ops"


def _python_reads(text: str, kind: type) -> bool:
    try:
        Budget.from_fields({**_budget(epoch=1, ttl_ms=5000).to_fields(),
                            ("max_batch_seqs" if kind is int else "batch_tokens_per_s"): text})
    except BudgetRecordError:
        return False
    return True


NUMBERISH = st.one_of(
    st.text(alphabet="0123456789.-+eExXabfinINF _\n\t", max_size=12),
    st.integers(min_value=-10**17, max_value=10**17).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)


COMMON_LUA = resources.files("borrowd.adapters.lua").joinpath("common.lua").read_text()
PARSE_BOTH = COMMON_LUA + """
local i, x = parse_int(ARGV[1]), parse_number(ARGV[1])
return {i ~= nil and i >= 0 and 1 or 0, x ~= nil and x >= 0 and 1 or 0}
"""


@settings(max_examples=400, deadline=None)
@given(text=NUMBERISH)
def test_lua_and_python_read_numbers_alike(shared_redis, text: str) -> None:
    """For any text, the scripts' number parser and the Python record reader agree on
    whether it is a usable integer / number (so the gate and `borrowd status` agree)."""
    client = connect(shared_redis.extra["url"])
    try:
        lua_int, lua_number = client.eval(PARSE_BOTH, 0, text)
    finally:
        client.close()
    assert bool(lua_int) == _python_reads(text, int), text
    assert bool(lua_number) == _python_reads(text, float), text
