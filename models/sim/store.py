"""The simulator's budget store and leader election: what Redis is to the daemon's loop.

`SimStore.publish` behaves as the Lua publish script does: a write from an epoch older than
the newest is refused (`FencedError`); the record gets the envelope (epoch, seq, issued_at,
ttl_ms); while the operator's stop switch is set the record written is a `stopped` one
whatever the body says. Each stored record is handed to the simulation, which enforces it.
`SimElection` is one replica that always holds the lease (the simulated pool has one daemon).
"""

from __future__ import annotations

from collections.abc import Callable

from models.budget import Budget, Mode, closed_budget
from models.errors import FencedError


class SimStore:
    """One pool's budget record in the simulation (a `models.protocols.Store`)."""

    def __init__(self, pool: str, enforce: Callable[[Budget, float], None]) -> None:
        self.pool = pool
        self.enforce = enforce
        self.epoch_counter = 0
        self.epoch = 0
        self.seq = 0
        self.stop: str | None = None
        self.record: Budget | None = None

    def publish(self, budget: Budget, *, epoch: int, ttl_ms: int, now_s: float) -> Budget:
        """Store `budget` under `epoch` with a lease of `ttl_ms` and enforce it from `now_s`."""
        newest = max(self.epoch_counter, self.epoch)
        if epoch < newest:
            raise FencedError(self.pool, epoch, newest)
        self.epoch = epoch
        if self.stop is not None:
            budget = closed_budget(budget.pool, Mode.STOPPED,
                                   f"stopped by operator: {self.stop}")
        self.seq += 1
        self.record = budget.with_envelope(epoch=epoch, seq=self.seq, issued_at_s=now_s,
                                           ttl_ms=ttl_ms)
        self.enforce(self.record, now_s)
        return self.record

    def stop_reason(self) -> str | None:
        """The stop switch's reason, or None."""
        return self.stop

    def next_epoch(self) -> int:
        """A new, higher epoch (the epoch counter a new leader increments)."""
        self.epoch_counter += 1
        return self.epoch_counter


class SimElection:
    """The only daemon replica of the simulated pool: it takes the lease and keeps it."""

    def __init__(self, store: SimStore) -> None:
        self.store = store
        self.epoch: int | None = None

    def try_acquire(self) -> int | None:
        """The held epoch, or a new one on the first call."""
        if self.epoch is None:
            self.epoch = self.store.next_epoch()
        return self.epoch

    def renew(self) -> bool:
        """True while held."""
        return self.epoch is not None

    def release(self) -> None:
        """Give the lease up; the next acquisition gets a newer epoch."""
        self.epoch = None
