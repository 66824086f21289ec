"""The batch store's Lua scripts and stream handling against a real redis-server."""

from __future__ import annotations

import asyncio

import pytest
from borrowd.adapters.batch.state import BatchStore
from borrowd.adapters.redis_conn import connect_async
from borrowd.models.batch.schedule import FairState, charge

pytestmark = pytest.mark.integration


@pytest.fixture
async def store(redis_url: str):
    """A BatchStore on the session's real Redis, emptied first."""
    client = connect_async(redis_url)
    yield BatchStore(client)
    await client.aclose()


async def test_charge_script_matches_the_pure_model(store: BatchStore) -> None:
    """The atomic Lua charge computes what `schedule.charge` computes."""
    state = FairState({})
    for tenant, cost, weight in [("a", 300, 2.0), ("b", 100, 1.0), ("a", 50, 2.0),
                                 ("c", 10, 1.0), ("b", 700, 1.0), ("a", 5, 2.0)]:
        state = charge(state, tenant, cost, weight)
        await store.charge(tenant, cost / weight)
    stored = await store.fair_state()
    assert stored.vtime == pytest.approx(state.vtime)
    assert stored.finish_tags == pytest.approx(dict(state.finish_tags))


async def test_result_is_recorded_once_and_not_after_the_job_ends(store: BatchStore) -> None:
    """First writer wins and acks; a finished job takes no more results."""
    await store.put_job("j1", {"id": "j1", "status": "in_progress", "tenant": "t",
                               "completed": 0, "failed": 0}, 1.0)
    await store.enqueue("j1", [("c1", 1, {"model": "m"}), ("c2", 2, {"model": "m"})])
    entry, custom_id = await store.read_new("j1", "w1")
    assert custom_id == "c1"
    assert await store.complete("j1", "c1", 1, "output", {"n": 1}, entry)
    assert not await store.complete("j1", "c1", 1, "error", {"n": 2}, entry)
    assert await store.pending_count("j1") == 0
    await store.update_job("j1", {"status": "completed"})
    assert not await store.complete("j1", "c2", 2, "output", {"n": 3}, "")
    assert [r["record"] for r in await store.results("j1")] == [{"n": 1}]
    assert (await store.job("j1"))["completed"] == "1"


async def test_silent_items_are_reclaimed_and_heartbeats_keep_them(store: BatchStore) -> None:
    """An entry whose holder stops heartbeating is taken over; a beating one is not, and
    its old holder learns it lost it."""
    await store.put_job("j2", {"id": "j2", "status": "in_progress", "tenant": "t"}, 1.0)
    await store.enqueue("j2", [("a", 1, {}), ("b", 2, {})])
    first, _ = await store.read_new("j2", "dead")
    second, _ = await store.read_new("j2", "alive")
    await asyncio.sleep(0.3)
    assert await store.heartbeat("j2", "alive", [second]) == []
    assert await store.reclaim("j2", "heir", 200) == (first, "a")
    assert await store.reclaim("j2", "heir", 200) is None
    assert await store.heartbeat("j2", "dead", [first]) == [first]


async def test_handed_over_items_are_reclaimable_at_once(store: BatchStore) -> None:
    """A stopping worker's entries look silent for claim_idle at once; others' are kept."""
    await store.put_job("j3", {"id": "j3", "status": "in_progress", "tenant": "t"}, 1.0)
    await store.enqueue("j3", [("a", 1, {}), ("b", 2, {})])
    mine, _ = await store.read_new("j3", "leaving")
    theirs, _ = await store.read_new("j3", "staying")
    assert await store.reclaim("j3", "heir", 30_000) is None
    await store.hand_over("j3", "leaving", [mine, theirs], 30_000)
    assert await store.reclaim("j3", "heir", 30_000) == (mine, "a")
    assert await store.reclaim("j3", "heir", 30_000) is None
