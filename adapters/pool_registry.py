"""Which pools exist: those a daemon registered, and those a daemon has led.

`borrowd stop|resume|status --pool P` checks P against them, so a mistyped pool name is
refused (naming the pools that do exist) instead of "stopping" a pool nobody reads. A daemon
registers its pools at start in the hash `borrowd:pools` (pool -> who and when, JSON; one
key, so one slot of a Redis Cluster); a pool whose leader election ever ran has its epoch
counter `borrowd:{POOL}:epoch`, found by SCAN (on every node of a cluster).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

import redis
from borrowd.adapters.store import PoolKeys

REGISTRY_KEY = "borrowd:pools"
EPOCH_PATTERN = "borrowd:{*}:epoch"


@dataclass(frozen=True)
class PoolRegistration:
    """One known pool: the daemon that registered it last, and when (Unix s; "" and 0.0 for
    a pool known only from its epoch counter)."""

    pool: str
    holder_id: str
    registered_at_s: float


class PoolRegistry:
    """The pools daemons have registered on one Redis."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def register(self, pools: Iterable[str], holder_id: str, now_s: float) -> None:
        """Record `pools` as controlled by `holder_id` (a daemon calls this at start)."""
        entry = json.dumps({"holder_id": holder_id, "registered_at_s": now_s})
        for pool in pools:
            self.client.hset(REGISTRY_KEY, PoolKeys(pool).pool, entry)

    def known(self) -> dict[str, PoolRegistration]:
        """Every registered or once-led pool by name (an unreadable entry still counts)."""
        out = {}
        for key in self.client.scan_iter(match=EPOCH_PATTERN, count=1000):
            pool = key[len("borrowd:{"):-len("}:epoch")]
            out[pool] = PoolRegistration(pool, "", 0.0)
        for pool, raw in self.client.hgetall(REGISTRY_KEY).items():
            try:
                data = json.loads(raw)
                holder, at_s = str(data["holder_id"]), float(data["registered_at_s"])
            except (ValueError, TypeError, KeyError):
                holder, at_s = "", 0.0
            out[str(pool)] = PoolRegistration(str(pool), holder, at_s)
        return out

    def exists(self, pool: str) -> bool:
        """True when `pool` is registered, a leader was ever elected for it (its epoch
        counter exists), or it holds a budget record."""
        keys = PoolKeys(pool)
        return bool(self.client.hexists(REGISTRY_KEY, pool)
                    or self.client.exists(keys.epoch, keys.budget))


def register_pools(client: redis.Redis, pools: Iterable[str], holder_id: str,
                   now_s: float) -> str | None:
    """`PoolRegistry.register`, returning the Redis error's text instead of raising: a daemon
    starts while Redis is down, and its pools become known anyway once one of them leads."""
    try:
        PoolRegistry(client).register(pools, holder_id, now_s)
    except redis.RedisError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None
