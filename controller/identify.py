"""What identification fits: per output, the signal the law tracks, computed from recorded
observations exactly as the policy computes it.

With `control_on_burn` a law that tracks the burn (PI, slack; not the MPC, which plans on
p95/SLO) tracks each output's counted fast SLO burn
(`controller.burn`: the share of samples above the SLO over the 5% a p95 allows, in a window
lengthened while sparse); without, its p95 over the SLO through the policy's asymmetric
smoothing. Identifying, tuning and scheduling gains on anything else would fit a plant the
loop never sees (the p95 jumps where the burn moves smoothly).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from borrowd.controller.burn import BurnWindow
from borrowd.controller.laws.registry import law_tracks_burn
from borrowd.controller.laws.smoothing import smooth_step
from borrowd.controller.policy import ControllerConfig
from borrowd.models.errors import InputError
from borrowd.models.plant.model import SIGNAL_BURN, SIGNAL_P95
from borrowd.models.signals import Observation

OUTPUT_NAMES = ("ttft", "itl")


def tracked_signal(config: ControllerConfig) -> str:
    """The plant signal the configured law tracks (`burn` or `p95_over_slo`): the burn with
    `control_on_burn` for a law that tracks it (PI, slack), else p95/SLO (the MPC)."""
    return SIGNAL_BURN if config.control_on_burn and law_tracks_burn(config.law) else SIGNAL_P95


def tracked_series(
    observations: Sequence[Observation], config: ControllerConfig, dt_s: float
) -> dict[str, np.ndarray]:
    """Per output, the tracked signal at every observation (gaps carry the last value)."""
    if tracked_signal(config) == SIGNAL_BURN:
        return {name: _fill(series) for name, series in _burn_series(observations, config,
                                                                     dt_s).items()}
    slo = config.slo()
    out = {}
    for name, norm in (("ttft", Observation.ttft_norm), ("itl", Observation.itl_norm)):
        raw = _fill(np.array([norm(o, slo) for o in observations], dtype=float))
        prev, smoothed = math.nan, []
        for value in raw:
            prev = smooth_step(prev, float(value), dt_s, config.filter_rise_s,
                               config.filter_fall_s)
            smoothed.append(prev)
        out[name] = np.array(smoothed)
    return out


def _burn_series(
    observations: Sequence[Observation], config: ControllerConfig, dt_s: float
) -> dict[str, np.ndarray]:
    windows = {name: BurnWindow(config.burn) for name in OUTPUT_NAMES}
    series: dict[str, list[float]] = {name: [] for name in OUTPUT_NAMES}
    for obs in observations:
        counted = {
            "ttft": (obs.ttft_over_slo_frac, obs.ttft_samples, obs.interactive_wait_batch_frac),
            "itl": (obs.itl_over_slo_frac, obs.itl_samples, obs.itl_over_slo_batch_frac),
        }
        for name, (share, samples, batch) in counted.items():
            added = windows[name].add(obs.now_s, share, samples, obs.window_s, dt_s, batch)
            series[name].append(windows[name].reading(obs.now_s).burn if added else math.nan)
    return {name: np.array(values, dtype=float) for name, values in series.items()}


def _fill(y: np.ndarray) -> np.ndarray:
    """Carry the last measured value over NaN gaps (none before the first: its value)."""
    y = y.copy()
    finite = np.flatnonzero(np.isfinite(y))
    if len(finite) == 0:
        raise InputError("the experiment measured no interactive latency at all")
    y[: finite[0]] = y[finite[0]]
    for k in range(finite[0] + 1, len(y)):
        if not math.isfinite(y[k]):
            y[k] = y[k - 1]
    return y
