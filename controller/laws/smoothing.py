"""Smoothing of the latency signals, as a wrapper around any law.

    y[k] = y[k-1] + (1 - exp(-dt / tau)) * (raw[k] - y[k-1])
    tau  = rise_s when raw > y[k-1], else fall_s          (p95s: errs on the safe side)

The SLO burns are not filtered but counted (`controller.burn`): each tick's samples go into
a window that lengthens while it holds too few of them, with Wilson bounds, and a slow
window beside it; the law tracks the fast burn, the supervisor reads both (`readings`).
The law reads each burn's batch share as `attributed_shares` gives it (a TTFT share unknown
for want of queue wait takes the measured ITL step share), so every wrapper reads the same.

A short sliding-window p95 over a few requests is noisy; the smoothing rises faster than it
falls. A window without interactive requests holds the smoothed value; a p95 missing for any
other reason stays NaN (the supervisor's failsafe). The wrapped law, and the supervisor after
it, see the smoothed observation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from borrowd.controller.burn import BurnConfig, BurnReading, BurnWindow, attributed_shares
from borrowd.controller.laws.base import NAN_PER_OUTPUT, Law, LawTick, Proposal
from borrowd.models.signals import SLO_QUANTILE, Observation, Slo


def smooth_step(prev: float, raw: float, dt_s: float, rise_s: float, fall_s: float) -> float:
    """One step of asymmetric exponential smoothing (time constant rise_s up, fall_s down).

    A NaN `prev` starts the filter at `raw`; a NaN `raw` holds `prev`.
    """
    if not math.isfinite(raw):
        return prev
    if not math.isfinite(prev):
        return raw
    tau_s = rise_s if raw > prev else fall_s
    return prev + (1.0 - math.exp(-dt_s / tau_s)) * (raw - prev)


@dataclass(frozen=True)
class SmoothingConfig:
    """Time constants of the smoothing, and whether the law tracks the SLO burn."""

    slo: Slo
    rise_s: float
    fall_s: float
    burn: BurnConfig
    control_on_burn: bool


class Smoothed:
    """A `Law` that hands the wrapped law smoothed p95s, success rate and SLO burns."""

    def __init__(self, inner: Law, config: SmoothingConfig) -> None:
        self.inner = inner
        self.config = config
        self.smoothed: tuple[float, ...] = (math.nan, math.nan)
        self.burns: tuple[float, ...] = NAN_PER_OUTPUT
        self.windows = (BurnWindow(config.burn), BurnWindow(config.burn))
        self.readings: tuple[BurnReading | None, BurnReading | None] = (None, None)
        self.last_success_rate = math.nan

    def propose(self, tick: LawTick) -> Proposal:
        """Smooth the tick's signals, then ask the wrapped law."""
        cfg = self.config
        self._smooth_burns(tick.obs, tick.dt_s)
        obs = self._smooth(tick.obs, tick.dt_s)
        ys = (obs.ttft_norm(cfg.slo), obs.itl_norm(cfg.slo))
        burns = self.burns if cfg.control_on_burn else NAN_PER_OUTPUT
        windows = tuple(r.window_s if r is not None and cfg.control_on_burn else math.nan
                        for r in self.readings)
        shares = attributed_shares(
            tuple(r.batch_share if r is not None and cfg.control_on_burn else math.nan
                  for r in self.readings),
            cfg.burn.step_share_for_ttft)
        slow_samples = tuple(r.slow_samples if r is not None else math.nan
                             for r in self.readings)
        return self.inner.propose(replace(tick, obs=obs, ys=ys, burns=burns,
                                          burn_windows_s=windows, burn_batch_shares=shares,
                                          burn_slow_samples=slow_samples))

    def applied(self, tick: LawTick, u_tokens_per_s: float) -> None:
        """Pass the applied budget on."""
        self.inner.applied(tick, u_tokens_per_s)

    def state(self) -> dict[str, float]:
        """The wrapped law's state."""
        return self.inner.state()

    def _smooth(self, obs: Observation, dt_s: float) -> Observation:
        """The observation with its p95s, success rate and shares above the SLOs smoothed
        (the shares NaN when `control_on_burn` is off)."""
        cfg = self.config
        values = []
        for raw, prev, idle in zip((obs.ttft_p95_s, obs.itl_p95_s), self.smoothed,
                                   (obs.ttft_idle(), obs.itl_idle()), strict=True):
            if not math.isfinite(raw):
                values.append(prev if idle else math.nan)
                continue
            values.append(smooth_step(prev, raw, dt_s, cfg.rise_s, cfg.fall_s))
        self.smoothed = tuple(
            v if math.isfinite(v) else p for v, p in zip(values, self.smoothed, strict=True)
        )
        success = obs.success_rate
        if math.isfinite(success):
            self.last_success_rate = success
        elif math.isfinite(obs.interactive_requests):
            # No request completed in the window: no failure seen; keep the last rate.
            success = self.last_success_rate if math.isfinite(self.last_success_rate) else 1.0
        ttft_share, itl_share = (
            (b * (1.0 - SLO_QUANTILE) if cfg.control_on_burn else math.nan) for b in self.burns
        )
        return replace(
            obs,
            ttft_p95_s=values[0],
            itl_p95_s=values[1],
            success_rate=success,
            ttft_over_slo_frac=ttft_share,
            itl_over_slo_frac=itl_share,
        )

    def _smooth_burns(self, obs: Observation, dt_s: float) -> None:
        """Count this window's samples above the SLOs into the burn windows; the fast burns
        become what the law tracks (NaN until a window has a measured sample)."""
        counted = (
            (obs.ttft_over_slo_frac, obs.ttft_samples, obs.interactive_wait_batch_frac),
            (obs.itl_over_slo_frac, obs.itl_samples, obs.itl_over_slo_batch_frac),
        )
        readings: list[BurnReading | None] = []
        for window, (share, samples, batch) in zip(self.windows, counted, strict=True):
            if window.add(obs.now_s, share, samples, obs.window_s, dt_s, batch):
                readings.append(window.reading(obs.now_s))
            else:
                # Samples came but their share was not read (a histogram without the SLO's
                # bound): no burn this tick, so the checks fall back to the p95.
                readings.append(None)
        self.readings = (readings[0], readings[1])
        self.burns = tuple(r.burn if r is not None else math.nan for r in self.readings)
