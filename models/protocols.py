"""The seams of borrowd as small protocols.

The daemon loop wires a `MetricsSource` to a control policy to a `BudgetSink`; the
simulator implements the source and the sink too, so the same loop runs against it.
"""

from __future__ import annotations

from typing import Protocol

from models.budget import Budget
from models.signals import Observation


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


class BudgetSink(Protocol):
    """Publishes a pool's budget to whatever enforces it."""

    def publish(self, budget: Budget, now_s: float) -> None:
        """Make `budget` the pool's budget from `now_s` on."""
        ...


class BudgetPolicy(Protocol):
    """Decides a pool's budget every `tick_s` from an observation (controller or static)."""

    tick_s: float

    def decide(self, obs: Observation, now_s: float) -> Budget:
        """The budget for the next tick."""
        ...
