"""Law wrappers that add a behaviour to any law: feed-forward and gain scheduling.

- `FeedForward`: a Holt forecast of the interactive token rate d; the wrapped law gets the
  forecast, the feed-forward gain g and the budget change it implies,
  du_ff = -(g * peak(d_hat)[k] - g * peak(d_hat)[k-1]) (the PI adds it to its increment;
  the MPC plans on v = u + g * d), plus, when the pool's engine capacity C (KV tokens of the
  engines up) moves, u_applied * (C[k] / C[k-1] - 1): a replica lost takes its share of the
  budget at once instead of after the SLO burn has shown it. For one signal lag after a
  replica is lost (the longest burn window read, else the observation's window, plus its
  age) the wrapped law's increases are held back: its readings still describe the larger
  fleet, and on `chat-2x-failure` under admission the law climbed on them into a cut.
- `GainScheduled`: an RLS estimate of each output's local gain K_local (on the signal the
  plant was identified on: the tracked SLO burn, or p95/SLO); the wrapped law
  gets ratio_i = clip(K_local_i / K_nominal_i, min_ratio, max_ratio) (1 until `min_samples`
  ticks, or without a plant), and scales its gains by it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from borrowd.controller.laws.base import (
    OUTPUTS,
    Law,
    LawSettings,
    LawTick,
    Proposal,
    tracked_outputs,
)
from borrowd.controller.laws.feedforward import (
    FeedForwardConfig,
    ForecastState,
    forecast_peak,
    forecast_update,
)
from borrowd.models.errors import ConfigError
from borrowd.models.plant.model import SIGNAL_BURN
from borrowd.models.plant.rls import LocalGain


class FeedForward:
    """A `Law` whose wrapped law sees the forecast interactive rate (module docstring)."""

    def __init__(self, inner: Law, config: FeedForwardConfig, tick_s: float) -> None:
        self.inner = inner
        self.config = config
        self.tick_s = tick_s
        self.forecast_state = ForecastState()
        self.prev_ff_tokens_per_s = math.nan
        self.prev_capacity_tokens = math.nan
        self.capacity_hold_until_s = math.nan

    def propose(self, tick: LawTick) -> Proposal:
        """Fold the interactive rate into the forecast, then ask the wrapped law."""
        ff = self.config
        self.forecast_state = forecast_update(
            self.forecast_state, tick.obs.interactive_tokens_per_s, ff
        )
        peak = forecast_peak(self.forecast_state, round(ff.horizon_s / self.tick_s))
        ff_now = ff.gain * peak if math.isfinite(peak) else math.nan
        du_ff = 0.0
        if math.isfinite(ff_now) and math.isfinite(self.prev_ff_tokens_per_s):
            du_ff = -(ff_now - self.prev_ff_tokens_per_s)
        if math.isfinite(ff_now):
            self.prev_ff_tokens_per_s = ff_now
        step = self._capacity_step(tick)
        proposal = self.inner.propose(replace(
            tick, du_ff_tokens_per_s=du_ff + step,
            du_forecast_tokens_per_s=du_ff, forecast=self.forecast_state, ff_gain=ff.gain,
        ))
        if step < 0:
            # Readings for one signal lag after a replica is lost describe the fleet before.
            windows = [w for w in tick.burn_windows_s if math.isfinite(w)]
            lag_s = max(windows, default=tick.obs.window_s) + tick.obs.age_s
            self.capacity_hold_until_s = (tick.obs.now_s + lag_s if math.isfinite(lag_s)
                                          else math.nan)
        if tick.obs.now_s < self.capacity_hold_until_s:
            held = tick.u_applied_tokens_per_s + min(step, 0.0)
            if proposal.u_tokens_per_s > held:
                proposal = replace(proposal, u_tokens_per_s=held)
        return proposal

    def _capacity_step(self, tick: LawTick) -> float:
        """u_applied * (C[k] / C[k-1] - 1) when the engine capacity C moved (module docstring)."""
        capacity = tick.obs.kv_capacity_tokens
        if not self.config.capacity or not capacity > 0:
            return 0.0
        prev, self.prev_capacity_tokens = self.prev_capacity_tokens, capacity
        if not prev > 0:
            return 0.0
        return tick.u_applied_tokens_per_s * (capacity / prev - 1.0)

    def applied(self, tick: LawTick, u_tokens_per_s: float) -> None:
        """Pass the applied budget on."""
        self.inner.applied(tick, u_tokens_per_s)

    def state(self) -> dict[str, float]:
        """The forecast level beside the wrapped law's state."""
        return {"forecast_interactive_tokens_per_s": self.forecast_state.level,
                **self.inner.state()}


@dataclass(frozen=True)
class ScheduleConfig:
    """Gain scheduling from an RLS estimate of each output's local gain."""

    enabled: bool = field(default=True, metadata={"unit": "bool", "help": "schedule gains"})
    forgetting: float = field(
        default=0.98, metadata={"unit": "1", "help": "RLS forgetting factor in (0, 1]"}
    )
    max_trace: float = field(
        default=100.0, metadata={"unit": "1", "help": "bound on the RLS covariance trace"}
    )
    min_samples: int = field(
        default=30, metadata={"unit": "ticks", "help": "ticks before the estimate is used"}
    )
    min_ratio: float = field(
        default=0.5, metadata={"unit": "1", "help": "least local/nominal gain ratio used"}
    )
    max_ratio: float = field(
        default=4.0, metadata={"unit": "1", "help": "largest local/nominal gain ratio used"}
    )

    def __post_init__(self) -> None:
        if not 0 < self.forgetting <= 1:
            raise ConfigError(f"schedule.forgetting must be in (0, 1], got {self.forgetting!r}")
        if not 0 < self.min_ratio <= 1 <= self.max_ratio:
            raise ConfigError(
                "schedule needs 0 < min_ratio <= 1 <= max_ratio, got "
                f"{self.min_ratio!r}, {self.max_ratio!r}"
            )


class GainScheduled:
    """A `Law` whose wrapped law sees the local/nominal gain ratio per output."""

    def __init__(self, inner: Law, config: ScheduleConfig, settings: LawSettings) -> None:
        self.inner = inner
        self.config = config
        plant = settings.plant
        modelled = settings.plant_outputs()
        self.nominal_gains = tuple(
            plant.output(name).gain_per_token_s if plant and name in modelled else math.nan
            for name in OUTPUTS
        )
        self.local_gains: tuple[LocalGain | None, ...] = (None,) * len(OUTPUTS)
        # The RLS follows the signal the plant was identified on (the tracked burn, or p95).
        self.on_burn = plant is not None and plant.signal == SIGNAL_BURN
        if plant is not None and config.enabled:
            self.local_gains = tuple(
                LocalGain.start(
                    gain=plant.output(name).gain_per_token_s,
                    pole=math.exp(-settings.tick_s / plant.output(name).tau_s),
                    y0=plant.output(name).y0,
                    u0=plant.u0_tokens_per_s,
                    dead_steps=round(plant.output(name).dead_s / settings.tick_s),
                    u_scale=max(plant.u_high_tokens_per_s, 1.0),
                )
                if name in modelled
                else None
                for name in OUTPUTS
            )

    def gain_ratios(self) -> tuple[float, ...]:
        """Local/nominal gain per output from RLS, clipped to the schedule's range (1: none)."""
        sched = self.config
        ratios = []
        for est, nominal in zip(self.local_gains, self.nominal_gains, strict=True):
            if est is None or est.samples < sched.min_samples or not nominal > 0:
                ratios.append(1.0)
                continue
            local = est.gain()
            ratio = local / nominal if math.isfinite(local) else 1.0
            ratios.append(min(max(ratio, sched.min_ratio), sched.max_ratio))
        return tuple(ratios)

    def propose(self, tick: LawTick) -> Proposal:
        """Ask the wrapped law with this tick's gain ratios."""
        return self.inner.propose(replace(tick, gain_ratios=self.gain_ratios()))

    def applied(self, tick: LawTick, u_tokens_per_s: float) -> None:
        """Pass the applied budget on, then fold (u, y) into each output's RLS estimate."""
        self.inner.applied(tick, u_tokens_per_s)
        sched = self.config
        self.local_gains = tuple(
            est.update(u_tokens_per_s, y, sched.forgetting, sched.max_trace)
            if est is not None
            else None
            for est, y in zip(
                self.local_gains, tracked_outputs(tick) if self.on_burn else tick.ys, strict=True
            )
        )

    def state(self) -> dict[str, float]:
        """The gain ratio per output beside the wrapped law's state."""
        ratios = self.gain_ratios()
        return {**{f"gain_ratio_{name}": ratios[i] for i, name in enumerate(OUTPUTS)},
                **self.inner.state()}
