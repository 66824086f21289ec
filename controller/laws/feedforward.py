"""Feed-forward from the measured interactive offered token rate.

Interactive tokens and batch tokens share the same GPU steps, so a rise of the interactive
rate takes room from batch work before latency shows it. The forecast is a short-horizon
linear extrapolation of an exponentially smoothed level and trend (Holt's method):

    level[k] = alpha * d[k] + (1 - alpha) * (level[k-1] + trend[k-1])
    trend[k] = beta * (level[k] - level[k-1]) + (1 - beta) * trend[k-1]
    d_hat[k + h] = level[k] + h * trend[k]      (h in ticks; only rises are extrapolated)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class FeedForwardConfig:
    """Holt forecast of the interactive token rate and the feed-forward gain."""

    gain: float = field(
        default=1.0,
        metadata={"unit": "batch tokens per interactive token", "help": "budget cut per unit rise",
                  "min": 0.0},
    )
    alpha: float = field(
        default=0.5,
        metadata={"unit": "1", "help": "level smoothing in (0, 1]", "gt": 0.0, "max": 1.0},
    )
    beta: float = field(
        default=0.3,
        metadata={"unit": "1", "help": "trend smoothing in [0, 1]", "min": 0.0, "max": 1.0},
    )
    horizon_s: float = field(
        default=5.0, metadata={"unit": "s", "help": "how far ahead the rate is forecast", "gt": 0.0}
    )
    capacity: bool = field(
        default=True,
        metadata={"unit": "bool",
                  "help": "scale the budget with the KV capacity of the engines up (a replica "
                          "lost or back)"},
    )


@dataclass(frozen=True)
class ForecastState:
    """Holt level and trend of the interactive token rate (tokens/s, tokens/s per tick)."""

    level: float = math.nan
    trend: float = 0.0


def forecast_update(
    state: ForecastState, rate_tokens_per_s: float, config: FeedForwardConfig
) -> ForecastState:
    """Fold one measured rate in; a NaN measurement leaves the state unchanged."""
    if not math.isfinite(rate_tokens_per_s):
        return state
    if not math.isfinite(state.level):
        return ForecastState(level=rate_tokens_per_s, trend=0.0)
    level = config.alpha * rate_tokens_per_s + (1 - config.alpha) * (state.level + state.trend)
    trend = config.beta * (level - state.level) + (1 - config.beta) * state.trend
    return ForecastState(level=level, trend=trend)


def forecast(state: ForecastState, steps: int) -> np.ndarray:
    """Rate over the next `steps` ticks (1..steps ahead); falls are not extrapolated."""
    if not math.isfinite(state.level):
        return np.zeros(steps)
    trend = max(state.trend, 0.0)
    return state.level + trend * np.arange(1, steps + 1)


def forecast_peak(state: ForecastState, horizon_ticks: int) -> float:
    """Highest forecast rate within `horizon_ticks` (the current level when none ahead)."""
    if not math.isfinite(state.level):
        return math.nan
    if horizon_ticks <= 0:
        return state.level
    return float(np.max(forecast(state, horizon_ticks)))
