"""Heracles-style slack-threshold controller: the comparator an operator would write by hand.

After Lo et al., "Heracles: Improving Resource Efficiency at Scale" (ISCA 2015): the latency
slack s = 1 - max_i(y_i), with y_i a p95 over its SLO, picks one of four actions:

    s < 0              -> budget to 0 (the supervisor's cut does the same)
    s < cut_below      -> budget * cut_factor      (shrink)
    s < grow_above     -> hold
    otherwise          -> budget + grow_step       (additive growth, capped)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from borrowd.controller.laws.base import LawSettings, LawTick, Proposal, tracked_outputs
from borrowd.models.config_loader import meta
from borrowd.models.errors import ConfigError


@dataclass(frozen=True)
class SlackConfig:
    """Thresholds on the latency slack and the budget steps taken."""

    cut_below: float = field(
        default=0.10, metadata={"unit": "1 - p95/SLO", "help": "shrink when slack is below"}
    )
    grow_above: float = field(
        default=0.30, metadata={"unit": "1 - p95/SLO", "help": "grow when slack is above"}
    )
    cut_factor: float = field(
        default=0.9, metadata={"unit": "1", "help": "budget multiplier when shrinking"}
    )
    grow_step_tokens_per_s: float = field(
        default=500.0,
        metadata=meta("tokens/s", "budget increment per tick", per_pool=True),
    )

    def __post_init__(self) -> None:
        if not 0 <= self.cut_below < self.grow_above < 1:
            raise ConfigError(
                f"slack needs 0 <= cut_below < grow_above < 1, got {self.cut_below!r}, "
                f"{self.grow_above!r}"
            )
        if not 0 <= self.cut_factor < 1:
            raise ConfigError(f"slack.cut_factor must be in [0, 1), got {self.cut_factor!r}")
        if self.grow_step_tokens_per_s <= 0:
            raise ConfigError(
                f"slack.grow_step_tokens_per_s must be > 0, got {self.grow_step_tokens_per_s!r}"
            )


def slack_step(
    outputs: tuple[float, ...], u_applied: float, config: SlackConfig, u_min: float, u_max: float
) -> float:
    """The next budget from normalised outputs (NaN ones ignored; all NaN: hold)."""
    measured = [y for y in outputs if math.isfinite(y)]
    if not measured:
        return u_applied
    slack = 1.0 - max(measured)
    if slack < 0:
        u = 0.0
    elif slack < config.cut_below:
        u = u_applied * config.cut_factor
    elif slack < config.grow_above:
        u = u_applied
    else:
        u = u_applied + config.grow_step_tokens_per_s
    return min(max(u, u_min), u_max)


class SlackLaw:
    """The slack-threshold law as a `Law`, on each output's SLO burn when measured, else
    its p95/SLO."""

    tracks_burn = True  # with `control_on_burn`, wherever the burn is measured

    def __init__(self, settings: LawSettings) -> None:
        self.config = settings.table("slack", SlackConfig)
        self.u_max_tokens_per_s = settings.u_max_tokens_per_s

    def propose(self, tick: LawTick) -> Proposal:
        """Shrink, hold or grow the budget applied last tick by the slack."""
        u = slack_step(tracked_outputs(tick), tick.u_applied_tokens_per_s, self.config, 0.0,
                       self.u_max_tokens_per_s)
        return Proposal(u, tick)

    def applied(self, tick: LawTick, u_tokens_per_s: float) -> None:
        """Nothing to do: the next step starts from the applied budget it is given."""

    def state(self) -> dict[str, float]:
        """No internal state."""
        return {}
