"""The daemon loop's view of Redis: one pool's budget store and leader election behind the
transport-neutral protocols of `models.protocols`, every `redis.RedisError` raised as
`models.errors.StoreError` (`FencedError` passes through: it is the store's answer)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import redis
from borrowd.adapters.ceiling import read_ceiling
from borrowd.adapters.store import BudgetStore, LeaderElection
from borrowd.models.budget import Budget
from borrowd.models.errors import StoreError
from borrowd.models.rollout import apply_ceiling

T = TypeVar("T")


def _neutral(call: Callable[[], T]) -> T:
    try:
        return call()
    except redis.RedisError as exc:
        raise StoreError(f"{type(exc).__name__}: {exc}") from exc


class RedisPoolStore:
    """`models.protocols.Store` over `adapters.store.BudgetStore`."""

    def __init__(self, store: BudgetStore,
                 ceiling: Callable[[], float | None] | None = None) -> None:
        self.store = store
        # The rollout ceiling (`borrowd rollout`), read at each publish: tokens/s or None.
        self.ceiling = ceiling or (lambda: read_ceiling(store.client, store.pool))

    def publish(self, budget: Budget, *, epoch: int, ttl_ms: int, now_s: float) -> Budget:
        """Write `budget`, held under the pool's rollout ceiling, fenced by `epoch`;
        `FencedError` if deposed, `StoreError` if Redis fails."""
        budget = apply_ceiling(budget, _neutral(self.ceiling))
        return _neutral(lambda: self.store.publish(budget, epoch=epoch, ttl_ms=ttl_ms,
                                                   now_s=now_s))

    def stop_reason(self) -> str | None:
        """The operator's reason while the stop switch is set; `StoreError` if Redis fails."""
        return _neutral(self.store.stop_reason)

    def ceiling_tokens_per_s(self) -> float | None:
        """The pool's rollout ceiling (tokens/s) or None; `StoreError` if Redis fails."""
        return _neutral(self.ceiling)


class RedisPoolElection:
    """`models.protocols.Election` over `adapters.store.LeaderElection`."""

    def __init__(self, election: LeaderElection) -> None:
        self.election = election

    def try_acquire(self) -> int | None:
        """Take or keep the lease: the epoch, or None when another replica holds it."""
        return _neutral(self.election.try_acquire)

    def renew(self) -> bool:
        """Extend the lease; False when it is lost."""
        return _neutral(self.election.renew)

    def release(self) -> None:
        """Give the lease up."""
        _neutral(self.election.release)
