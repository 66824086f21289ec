"""The simulator's admission model against the Lua gate on a real redis-server.

Thousands of seeded random sequences of publish / admit (new, retried, changed) / release /
renew / expiry (time jumps past leases and records) / new elections / stop switch go to
`models.admission.PoolGate` and to the Lua scripts through `adapters.gate.Gate` and
`adapters.store.BudgetStore`, with the same caller time (virtual milliseconds, passed to the
scripts as `now_ms`, far behind Redis's own clock so publish reaps on the caller's time).
Every decision, refund, renewal, revocation, record envelope and, after every step, the
in-flight sequences, reserved KV tokens and the stored bucket level must be identical.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis
from borrowd.adapters.gate import Gate
from borrowd.adapters.redis_conn import connect
from borrowd.adapters.store import BudgetStore, PoolKeys
from borrowd.models.admission import PoolGate
from borrowd.models.budget import Budget, Mode
from borrowd.models.errors import FencedError

pytestmark = pytest.mark.integration

POOL = "diff"
LEASE_MS = 20_000
RETRY_MS = 1_000
SEQUENCES = int(os.environ.get("BORROWD_DIFF_SEQUENCES", "2000"))
STEPS = 30
T0_MS = 1_000_000_000  # 1970-01-12: far behind Redis's clock, as the scripts require here
MODES = (Mode.OPEN,) * 6 + (Mode.RAMP, Mode.RAMP, Mode.CLOSED, Mode.FAILSAFE)


@dataclass
class Pair:
    """The model and the Lua gate for one pool, side by side, at one virtual time."""

    model: PoolGate
    gate: Gate
    store: BudgetStore
    client: redis.Redis
    now_ms: int = T0_MS
    epoch: int = 1
    last_revoke_id: str = "0-0"

    @property
    def now_s(self) -> float:
        """The caller's time in seconds (int(now_s * 1000) == now_ms for these values)."""
        return self.now_ms / 1000


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    """A client on the session's (emptied) redis-server."""
    c = connect(redis_url)
    yield c
    c.close()


def sometimes_zero(rng: random.Random, value: float) -> float:
    """`value`, or 0 one time in twenty (a closed cap)."""
    return 0 if rng.random() < 0.05 else value


def random_budget(rng: random.Random) -> Budget:
    """A budget with random caps: mostly open, some tight, some closed, some larger than any
    request."""
    rate = rng.choice([50.0, 500.0, 1234.5, 5000.0, 25_000.0, rng.uniform(1, 10_000)])
    burst = rng.choice([900, 2048, 5000, 40_000, rng.randint(1, 50_000)])
    return Budget(
        pool=POOL, mode=rng.choice(MODES), reason="diff",
        batch_tokens_per_s=sometimes_zero(rng, rate),
        batch_burst_tokens=int(sometimes_zero(rng, burst)),
        max_batch_seqs=int(sometimes_zero(rng, rng.choice([1, 2, 3, 5, 8, 64]))),
        max_batch_kv_tokens=int(sometimes_zero(rng, rng.choice([3000, 10_000, 100_000]))),
        max_batch_output_tokens=int(sometimes_zero(rng, rng.choice([16, 256, 1024]))),
    )


def check_state(pair: Pair) -> None:
    """In-flight sequences, reserved KV and stored bucket level agree after reaping."""
    lua = pair.gate.inflight(pair.now_s)
    assert (lua.seqs, lua.kv_tokens, lua.bucket_tokens) == pair.model.inflight(pair.now_ms)


def step_publish(pair: Pair, rng: random.Random) -> None:
    """A publication, sometimes from a deposed (older) epoch; both fence or both write."""
    epoch = pair.epoch - 1 if pair.epoch > 1 and rng.random() < 0.15 else pair.epoch
    budget = random_budget(rng)
    ttl_ms = rng.choice([60_000, 3_600_000])
    try:
        lua = pair.store.publish(budget, epoch=epoch, ttl_ms=ttl_ms, now_s=pair.now_s)
    except FencedError as lua_fence:
        with pytest.raises(FencedError) as model_fence:
            pair.model.publish(budget, epoch=epoch, ttl_ms=ttl_ms, now_s=pair.now_s)
        assert model_fence.value.newest_epoch == lua_fence.newest_epoch
        return
    model = pair.model.publish(budget, epoch=epoch, ttl_ms=ttl_ms, now_s=pair.now_s)
    assert lua == model.record
    pair.last_revoke_id, revoked = pair.gate.revocations(pair.last_revoke_id)
    assert tuple(r.request_id for r in revoked) == model.revoked


def step_admit(pair: Pair, rng: random.Random, ids: list[str]) -> None:
    """An admission: a new id, or a retry of a known one (same or another prompt)."""
    if ids and rng.random() < 0.2:
        request_id = rng.choice(ids)
    else:
        request_id = f"r{len(ids)}"
        ids.append(request_id)
    prompt = rng.choice([0, 10, 100, 700, 2000, rng.randint(0, 6000)])
    out = rng.choice([1, 16, 200, 1000, rng.randint(1, 2000)])
    lua = pair.gate.admit(request_id, prompt, out, pair.now_s)
    model = pair.model.admit(request_id, prompt, out, pair.now_ms, lease_ms=LEASE_MS,
                             retry_ms=RETRY_MS)
    assert (lua.admitted, lua.reason, round(lua.retry_after_s * 1000), lua.max_output_tokens,
            lua.lease_ms) == (model.admitted, model.reason, model.retry_after_ms,
                              model.max_output_tokens, model.lease_ms)


def pick_id(pair: Pair, rng: random.Random, ids: list[str]) -> str:
    """Mostly an admission in flight, else any id seen, else one never admitted."""
    live = sorted(pair.model.requests)
    roll = rng.random()
    if live and roll < 0.75:
        return rng.choice(live)
    if ids and roll < 0.95:
        return rng.choice(ids)
    return "never-admitted"


def step_release(pair: Pair, rng: random.Random, ids: list[str]) -> None:
    """A release of a known or unknown id, with the output used (or unknown)."""
    request_id = pick_id(pair, rng, ids)
    used = None if rng.random() < 0.2 else rng.randint(0, 1200)
    lua = pair.gate.release(request_id, used, pair.now_s)
    assert lua == pair.model.release(request_id, used, pair.now_ms)


def step_renew(pair: Pair, rng: random.Random, ids: list[str]) -> None:
    """A lease renewal of a known or unknown id."""
    request_id = pick_id(pair, rng, ids)
    lua = pair.gate.renew(request_id, pair.now_s)
    assert lua == pair.model.renew(request_id, pair.now_ms, lease_ms=LEASE_MS)


def step_time(pair: Pair, rng: random.Random) -> None:
    """Time passes: mostly a little, sometimes past every lease or a short record lease."""
    pair.now_ms += rng.choice([0, 1, 7, 250, 999, 1500, 4000, rng.randint(0, 25_000), 61_000])


def step_elect(pair: Pair) -> None:
    """A new leader takes the epoch counter (INCR) before it publishes: the record is fenced."""
    pair.epoch = int(pair.client.incr(PoolKeys(POOL).epoch))
    pair.model.epoch_counter += 1
    assert pair.epoch == pair.model.epoch_counter


def step_stop_switch(pair: Pair, rng: random.Random) -> None:
    """The operator's stop switch set or cleared (read by admit and applied by publish)."""
    key = PoolKeys(POOL).stop
    if rng.random() < 0.5:
        pair.client.set(key, "drill")
        pair.model.stop_reason = "drill"
    else:
        pair.client.delete(key)
        pair.model.stop_reason = None


def run_sequence(client: redis.Redis, seed: int) -> None:
    """One seeded random sequence, checked step by step."""
    client.flushall()
    rng = random.Random(seed)
    pair = Pair(PoolGate(POOL), Gate(client, POOL, lease_ms=LEASE_MS, retry_ms=RETRY_MS),
                BudgetStore(client, POOL), client)
    ids: list[str] = []
    step_elect(pair)
    if rng.random() < 0.9:
        step_publish(pair, rng)
    for _ in range(STEPS):
        roll = rng.random()
        if roll < 0.12:
            step_publish(pair, rng)
        elif roll < 0.55:
            step_admit(pair, rng, ids)
        elif roll < 0.72:
            step_release(pair, rng, ids)
        elif roll < 0.80:
            step_renew(pair, rng, ids)
        elif roll < 0.97:
            step_time(pair, rng)
        elif roll < 0.985:
            step_elect(pair)
        else:
            step_stop_switch(pair, rng)
        check_state(pair)


def test_model_and_lua_gate_agree_on_random_sequences(client: redis.Redis) -> None:
    """Thousands of seeded sequences: identical decisions, refunds, revocations, records,
    in-flight counts and bucket levels (set BORROWD_DIFF_SEQUENCES for more or fewer)."""
    for seed in range(SEQUENCES):
        try:
            run_sequence(client, seed)
        except AssertionError as exc:
            raise AssertionError(f"sequence {seed} diverged: {exc}") from exc


def test_a_request_larger_than_the_bucket_is_refused_by_both(client: redis.Redis) -> None:
    """A request costing more than the bucket's depth is `too_large` in the model as in Lua
    (the simulator used to admit it and let the bucket go negative)."""
    pair = Pair(PoolGate(POOL), Gate(client, POOL, lease_ms=LEASE_MS), BudgetStore(client, POOL),
                client)
    step_elect(pair)
    budget = Budget(pool=POOL, mode=Mode.OPEN, reason="small bucket",
                    batch_tokens_per_s=1000.0, batch_burst_tokens=1000, max_batch_seqs=4,
                    max_batch_kv_tokens=100_000, max_batch_output_tokens=1024)
    pair.store.publish(budget, epoch=pair.epoch, ttl_ms=60_000, now_s=pair.now_s)
    pair.model.publish(budget, epoch=pair.epoch, ttl_ms=60_000, now_s=pair.now_s)
    lua = pair.gate.admit("big", 900, 200, pair.now_s)
    model = pair.model.admit("big", 900, 200, pair.now_ms, lease_ms=LEASE_MS,
                             retry_ms=RETRY_MS)
    assert (lua.admitted, lua.reason) == (model.admitted, model.reason) == (False, "too_large")


def test_release_refunds_the_unused_reservation_in_both(client: redis.Redis) -> None:
    """Releasing after 10 of 500 reserved output tokens refunds 490 to the bucket in both."""
    pair = Pair(PoolGate(POOL), Gate(client, POOL, lease_ms=LEASE_MS), BudgetStore(client, POOL),
                client)
    step_elect(pair)
    budget = Budget(pool=POOL, mode=Mode.OPEN, reason="refund", batch_tokens_per_s=10.0,
                    batch_burst_tokens=5000, max_batch_seqs=4, max_batch_kv_tokens=100_000,
                    max_batch_output_tokens=1024)
    pair.store.publish(budget, epoch=pair.epoch, ttl_ms=60_000, now_s=pair.now_s)
    pair.model.publish(budget, epoch=pair.epoch, ttl_ms=60_000, now_s=pair.now_s)
    assert pair.gate.admit("a", 1000, 500, pair.now_s).admitted
    assert pair.model.admit("a", 1000, 500, pair.now_ms, lease_ms=LEASE_MS,
                            retry_ms=RETRY_MS).admitted
    assert pair.gate.release("a", 10, pair.now_s) == 490
    assert pair.model.release("a", 10, pair.now_ms) == 490
    check_state(pair)
    assert pair.model.tokens == 5000 - 1500 + 490
