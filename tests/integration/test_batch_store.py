"""The batch store's Lua scripts and stream handling against a real redis-server."""

from __future__ import annotations

import asyncio

import pytest
from borrowd.adapters.batch.state import BatchStore
from borrowd.adapters.redis_conn import connect_async
from borrowd.models.batch.schedule import FairState, dispatch, settle, settlement

pytestmark = pytest.mark.integration


@pytest.fixture
async def store(redis_url: str):
    """A BatchStore on the session's real Redis, emptied first."""
    client = connect_async(redis_url)
    yield BatchStore(client)
    await client.aclose()


async def test_dispatch_and_settle_scripts_match_the_pure_model(store: BatchStore) -> None:
    """Dispatches and settlements through the Lua scripts pick the tenants and leave the
    tags, virtual time and expected costs that `schedule.dispatch` and `schedule.settle`
    give."""
    state = FairState({})
    steps = [({"a": 2.0, "b": 1.0}, 300, True), ({"a": 2.0, "b": 1.0}, 120, True),
             ({"a": 2.0}, 90, False), ({"a": 2.0, "b": 1.0, "c": 0.5}, 700, True),
             ({"b": 1.0, "c": 0.5}, 10, True), ({"a": 2.0, "c": 0.5}, 2000, True)]
    for weights, actual, finished in steps:
        picked = dispatch(state, weights)
        stored_pick = await store.dispatch(weights)
        assert picked is not None and stored_pick is not None
        assert stored_pick[0] == picked.tenant
        assert stored_pick[1] == pytest.approx(picked.charged_tokens)
        settled = settlement(picked.charged_tokens, actual, weights[picked.tenant], finished)
        state = settle(picked.state, picked.tenant, settled)
        await store.settle(picked.tenant, settled)
    stored = await store.fair_state()
    assert stored.vtime == pytest.approx(state.vtime)
    assert stored.finish_tags == pytest.approx(dict(state.finish_tags))
    assert stored.expected_costs == pytest.approx(dict(state.expected_costs))
    assert await store.dispatch({}) is None


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
