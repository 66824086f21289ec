"""The rollout ceiling in real Redis: the daemon's store publishes budgets held under it."""

from __future__ import annotations

import time

import redis
from borrowd.adapters.ceiling import ceiling_key, read_ceiling, write_ceiling
from borrowd.adapters.pool_store import RedisPoolStore
from borrowd.adapters.store import BudgetStore
from borrowd.models.budget import Budget, Mode

OPEN = Budget(pool="chat", mode=Mode.OPEN, reason="quiet", batch_tokens_per_s=8000.0,
              batch_burst_tokens=33792, max_batch_seqs=8, max_batch_kv_tokens=80000,
              max_batch_output_tokens=512)


def test_published_budget_is_held_under_the_ceiling(redis_url: str) -> None:
    """Set, the ceiling clamps each publish; removed, the controller's budget goes through."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    store = RedisPoolStore(BudgetStore(client, "chat"))
    assert read_ceiling(client, "chat") is None
    write_ceiling(client, "chat", 3000.0)
    assert client.get(ceiling_key("chat")) == "3000"
    stored = store.publish(OPEN, epoch=1, ttl_ms=5000, now_s=time.time())
    assert stored.batch_tokens_per_s == 3000.0 and stored.max_batch_seqs == 3
    assert BudgetStore(client, "chat").read(time.time()).batch_tokens_per_s == 3000.0
    write_ceiling(client, "chat", 0.0)
    stored = store.publish(OPEN, epoch=1, ttl_ms=5000, now_s=time.time())
    assert stored.mode is Mode.CLOSED and not stored.admits_batch
    write_ceiling(client, "chat", None)
    stored = store.publish(OPEN, epoch=1, ttl_ms=5000, now_s=time.time())
    assert stored.batch_tokens_per_s == 8000.0
