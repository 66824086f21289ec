"""The seams of borrowd as small protocols.

The daemon's per-pool loop (`controller.loop.PoolLoop`) reads a `MetricsSource`, asks its
controller, and publishes through a `Store` while its `Election` says it leads. In
production these are Prometheus and Redis (`controller.prom_source`, `adapters.pool_store`);
in the simulator they are the simulation itself (`models.sim.simulation.Simulation` and its
`models.sim.store.SimStore`), which ticks the same loop on virtual time (`TickLoop`). A
`Clock` gives the time the daemon's scheduler ticks at. Store and election failures are
`models.errors.StoreError`, whatever the transport.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from borrowd.models.budget import Budget
from borrowd.models.signals import Observation


class Clock(Protocol):
    """Source of the current time in seconds (wall or virtual)."""

    def now_s(self) -> float:
        """Current time in seconds."""
        ...


class MetricsSource(Protocol):
    """Reads one pool's signals over the controller window ending now."""

    def observe(self, pool: str, now_s: float) -> Observation:
        """Signals of `pool` at `now_s`; NaN fields where a signal is missing."""
        ...


class Store(Protocol):
    """One pool's budget store: fenced publication and the operator's stop switch."""

    def publish(self, budget: Budget, *, epoch: int, ttl_ms: int, now_s: float) -> Budget:
        """Write `budget` fenced by `epoch` with a lease of `ttl_ms`; the record as stored.

        `FencedError` when a newer epoch wrote; `StoreError` when the store fails.
        """
        ...

    def stop_reason(self) -> str | None:
        """The operator's reason while the stop switch is set, else None."""
        ...

    def ceiling_tokens_per_s(self) -> float | None:
        """The operator's rollout ceiling on the batch rate (tokens/s), None when unset."""
        ...


class Election(Protocol):
    """Leader election of one pool among daemon replicas."""

    def try_acquire(self) -> int | None:
        """Take or keep the lease; the epoch, or None when another replica holds it."""
        ...

    def renew(self) -> bool:
        """Extend the lease; False when it is lost."""
        ...

    def release(self) -> None:
        """Give the lease up."""
        ...


class TickLoop(Protocol):
    """A pool's control loop, ticked every `tick_s` by its host (scheduler or simulator)."""

    @property
    def tick_s(self) -> float:
        """Seconds between ticks."""
        ...

    def tick(self, now_s: float) -> object:
        """Observe, decide and publish once at `now_s`."""
        ...


# Builds a pool's loop over a metrics source, a store and an election (the simulator passes
# itself; the CLI edge decides which controller runs).
LoopFactory = Callable[[MetricsSource, Store, Election], TickLoop]
