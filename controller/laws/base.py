"""The control-law seam: what a law sees each tick (`LawTick`), what it proposes
(`Proposal`), and the `Law` protocol that every law and every law wrapper implements.

A law proposes the next batch budget u from one tick and is then told the u the supervisor
applied. A wrapper is a `Law` around another `Law` (as concurrency-limits' `WindowedLimit`
wraps any `Limit`): it rewrites the tick on the way in (smoothing, feed-forward, gain
schedule), keeps its own state, and passes the applied u on. Laws are pure in time: `dt_s`
comes in the tick; nothing here reads a clock or does I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from borrowd.controller.laws.feedforward import ForecastState
from borrowd.models.enforcement import ADMISSION
from borrowd.models.errors import ConfigError
from borrowd.models.plant.model import PlantModel
from borrowd.models.signals import Observation

OUTPUTS = ("ttft", "itl")
NAN_PER_OUTPUT = (math.nan,) * len(OUTPUTS)
T = TypeVar("T")


@dataclass(frozen=True)
class LawTick:
    """One tick as a law sees it.

    `ys` are p95/SLO per output (`OUTPUTS` order) and `burns` the SLO burns (share above the
    SLO / 0.05; NaN when not measured or not tracked); `du_ff_tokens_per_s` (of which
    `du_forecast_tokens_per_s` is the forecast's part, the rest the capacity step), `forecast`
    and `ff_gain` come from the feed-forward wrapper, `gain_ratios` (local/nominal plant gain per
    output) from the gain-scheduling wrapper; without them they are neutral.
    `batch_seqs_cap` is the sequence cap of the budget in force (inf: none known), so a
    wrapper can tell batch that is held by its caps from batch that has no more work;
    `burn_windows_s` how long a window each burn took to hold its least sample count (NaN:
    not read), i.e. how late that signal is; `burn_batch_shares` the share of each burn's
    over-SLO samples that batch caused (NaN: not measured); `burn_slow_samples` how many
    samples each burn's slow (SLO) window holds (NaN: not read).
    """

    obs: Observation
    ys: tuple[float, ...]
    u_applied_tokens_per_s: float
    dt_s: float
    burns: tuple[float, ...] = NAN_PER_OUTPUT
    du_ff_tokens_per_s: float = 0.0
    du_forecast_tokens_per_s: float = 0.0
    forecast: ForecastState = field(default_factory=ForecastState)
    ff_gain: float = 0.0
    gain_ratios: tuple[float, ...] = (1.0,) * len(OUTPUTS)
    batch_seqs_cap: float = math.inf
    burn_windows_s: tuple[float, ...] = NAN_PER_OUTPUT
    burn_batch_shares: tuple[float, ...] = NAN_PER_OUTPUT
    burn_slow_samples: tuple[float, ...] = NAN_PER_OUTPUT


@dataclass(frozen=True)
class Proposal:
    """A law's proposed budget, the tick as the innermost law saw it, and the most any
    budget may be this tick by the law's wrappers (use validation; inf: no such bound), which
    the supervisor's ramp respects too."""

    u_tokens_per_s: float
    tick: LawTick
    ceiling_tokens_per_s: float = math.inf


class Law(Protocol):
    """A control law, or a wrapper around one."""

    def propose(self, tick: LawTick) -> Proposal:
        """The budget this law proposes for the tick."""
        ...

    def applied(self, tick: LawTick, u_tokens_per_s: float) -> None:
        """The supervisor applied `u_tokens_per_s` on `tick` (the proposal's own tick)."""
        ...

    def state(self) -> dict[str, float]:
        """Internal state as named numbers (exported as `borrowd_controller_state`)."""
        ...


@dataclass(frozen=True)
class LawSettings:
    """What a law factory is built from: the pool's control period, budget range, plant
    and the controller's config tables by name (`pi`, `mpc`, `slack`, ...)."""

    tick_s: float
    u_max_tokens_per_s: float
    plant: PlantModel | None
    tables: Mapping[str, object]
    # How the pool's budget is enforced (`controller.enforcement`: ADMISSION or ENGINE).
    enforcement: str = ADMISSION

    def table(self, name: str, kind: type[T]) -> T:
        """The config table `name` (its defaults when the config has no such table)."""
        value = self.tables.get(name)
        if value is None:
            return kind()
        if not isinstance(value, kind):
            raise ConfigError(f"controller.{name} must be a {kind.__name__} table")
        return value

    def plant_outputs(self) -> tuple[str, ...]:
        """The outputs (in `OUTPUTS` order) that the plant models."""
        names = {o.name for o in self.plant.outputs} if self.plant else set()
        return tuple(n for n in OUTPUTS if n in names)


LawFactory = Callable[[LawSettings], Law]


def tracked_outputs(tick: LawTick) -> tuple[float, ...]:
    """What a burn-tracking law follows per output: its SLO burn when measured, else
    p95/SLO."""
    return tuple(
        burn if math.isfinite(burn) else y for y, burn in zip(tick.ys, tick.burns, strict=True)
    )
