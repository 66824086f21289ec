"""The daemon's Redis store and election raise the transport-neutral `StoreError`."""

from __future__ import annotations

import pytest
import redis
from borrowd.adapters.pool_store import RedisPoolElection, RedisPoolStore
from borrowd.models.budget import Budget, Mode
from borrowd.models.errors import FencedError, StoreError

OPEN = Budget(pool="chat", mode=Mode.OPEN, reason="quiet", batch_tokens_per_s=5000.0,
              batch_burst_tokens=10000, max_batch_seqs=4, max_batch_kv_tokens=50000,
              max_batch_output_tokens=512)


class Down:
    """A store and election whose every Redis call fails the way redis-py fails."""

    def publish(self, budget: Budget, *, epoch: int, ttl_ms: int, now_s: float) -> Budget:
        raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:1")

    def stop_reason(self) -> str | None:
        raise redis.TimeoutError("Timeout reading from socket")

    def try_acquire(self) -> int | None:
        raise redis.ConnectionError("refused")

    def renew(self) -> bool:
        raise redis.ResponseError("NOSCRIPT")

    def release(self) -> None:
        raise redis.ConnectionError("refused")


class Fenced:
    """A store that refuses the write for an older epoch."""

    def publish(self, budget: Budget, *, epoch: int, ttl_ms: int, now_s: float) -> Budget:
        raise FencedError(budget.pool, epoch, epoch + 1)


@pytest.mark.parametrize(
    "call",
    [
        lambda: RedisPoolStore(Down(), lambda: None).publish(OPEN, epoch=1, ttl_ms=1000, now_s=0.0),
        lambda: RedisPoolStore(Down()).stop_reason(),
        lambda: RedisPoolElection(Down()).try_acquire(),
        lambda: RedisPoolElection(Down()).renew(),
        lambda: RedisPoolElection(Down()).release(),
    ],
    ids=["publish", "stop_reason", "try_acquire", "renew", "release"],
)
def test_redis_errors_become_store_errors(call) -> None:
    """Any redis.RedisError leaves the adapter as StoreError, naming the Redis error."""
    with pytest.raises(StoreError, match="Error"):
        call()


def test_fencing_passes_through() -> None:
    """A fenced write is the store's answer, not a transport failure: FencedError as is."""
    with pytest.raises(FencedError):
        RedisPoolStore(Fenced(), lambda: None).publish(OPEN, epoch=3, ttl_ms=1000, now_s=0.0)
