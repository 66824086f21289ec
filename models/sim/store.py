"""The simulator's budget store and leader election: what Redis is to the daemon's loop.

`SimStore.publish` is `models.admission.PoolGate.publish`, the model of the Lua publish script:
a write from an epoch older than the newest is refused (`FencedError`); the record gets its
envelope (epoch, seq, issued_at, ttl_ms); while the operator's stop switch is set the record
written is a `stopped` one whatever the body says; admissions beyond the new caps are revoked,
newest first. Each stored record and its revocations are handed to the simulation, which
enforces them. `SimElection` is one replica that always holds the lease (the simulated pool
has one daemon).
"""

from __future__ import annotations

from collections.abc import Callable

from borrowd.models.admission import PoolGate
from borrowd.models.budget import Budget

# Enforce a stored record from a time on, aborting the revoked admissions (newest first).
Enforce = Callable[[Budget, tuple[str, ...], float], None]


class SimStore:
    """One pool's budget record in the simulation (a `models.protocols.Store`)."""

    def __init__(self, pool: str, enforce: Enforce) -> None:
        self.gate = PoolGate(pool)
        self.enforce = enforce
        self.ceiling: float | None = None  # the rollout ceiling (tokens/s), None: unset

    @property
    def stop(self) -> str | None:
        """The operator's stop switch (its reason), or None."""
        return self.gate.stop_reason

    @stop.setter
    def stop(self, reason: str | None) -> None:
        self.gate.stop_reason = reason

    @property
    def seq(self) -> int:
        """Records written so far."""
        return self.gate.seq

    def publish(self, budget: Budget, *, epoch: int, ttl_ms: int, now_s: float) -> Budget:
        """Store `budget` under `epoch` with a lease of `ttl_ms` and enforce it from `now_s`."""
        published = self.gate.publish(budget, epoch=epoch, ttl_ms=ttl_ms, now_s=now_s)
        self.enforce(published.record, published.revoked, now_s)
        return published.record

    def stop_reason(self) -> str | None:
        """The stop switch's reason, or None."""
        return self.gate.stop_reason

    def ceiling_tokens_per_s(self) -> float | None:
        """The rollout ceiling set on the simulated pool, or None."""
        return self.ceiling

    def next_epoch(self) -> int:
        """A new, higher epoch (the epoch counter a new leader increments)."""
        self.gate.epoch_counter += 1
        return self.gate.epoch_counter


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
