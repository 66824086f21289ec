"""SLO burn from counted samples: a fast and a slow window, sample counts, Wilson bounds.

Each observation carries, per output, the share of interactive samples (inter-token gaps,
first tokens) above the SLO over the source's window and how many samples that window held.
Read every tick over a longer window, observations overlap, so each adds its counts scaled
by dt / window (about the samples new since the last tick). Over a window W:

    burn(W)  = (over / n) / (1 - 0.95)        1.0: a p95 exactly at the SLO
    bounds   = Wilson score interval of over / n at z, over 0.05
    fast     = the last `fast_s`, lengthened (up to `slow_s`) until it holds `min_samples`
    slow     = the last `slow_s` (the SLO's own window)

No sample at all (no interactive traffic) reads as burn 0 with bounds (0, 0): nothing to
protect is a safe reading, not a missing one. `batch_share` is the share of the samples
above the SLO that batch work caused (gaps in steps carrying batch tokens; first-token
wait spent behind batch prefill), for deciding whether revoking batch would help.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from borrowd.models.errors import ConfigError
from borrowd.models.signals import SLO_QUANTILE

ALLOWED_SHARE = 1.0 - SLO_QUANTILE
# A p95 at or above this share of its SLO is near it: there a late (sparse) burn paces
# the cold start (`supervisor.ramp_doubling_s`) and slows the PI (`pi.delay_scale`).
NEAR_SLO_NORM = 0.5
KNOWN_SAMPLES = 5.0  # a p95 read from fewer samples says nothing of the room under its SLO


def known_far(slow_samples: float, p95_norm: float) -> bool:
    """True when a p95 (over its SLO) read from at least `KNOWN_SAMPLES` samples of the slow
    window is under `NEAR_SLO_NORM`: room the budget may run into before its late signals
    show it (the cold start's doubling, use validation's reading of a late carried rate)."""
    return slow_samples >= KNOWN_SAMPLES and p95_norm < NEAR_SLO_NORM


def known_near(slow_samples: float, p95_norm: float) -> bool:
    """True when a p95 (over its SLO) read from at least `KNOWN_SAMPLES` samples of the slow
    window is at or above `NEAR_SLO_NORM`: known to leave little room (a guarded cold start
    then ends where what batch uses stalls). A p95 not read (NaN) is not known near."""
    return slow_samples >= KNOWN_SAMPLES and p95_norm >= NEAR_SLO_NORM


@dataclass(frozen=True)
class BurnConfig:
    """Windows, least sample count and confidence of the burn estimate."""

    fast_s: float = field(
        default=10.0, metadata={"unit": "s", "help": "fast burn window (before lengthening)"}
    )
    slow_s: float = field(
        default=60.0, metadata={"unit": "s", "help": "slow burn window (the SLO's window)"}
    )
    min_samples: float = field(
        default=100.0,
        metadata={"unit": "samples", "help": "the fast window lengthens until it holds this many"},
    )
    z: float = field(
        default=2.0, metadata={"unit": "1", "help": "Wilson bound width (standard deviations)"}
    )
    step_share_for_ttft: bool = field(
        default=True,
        metadata={"unit": "bool", "help": "where the TTFT burn's batch share is unknown (no "
                                          "interactive queue wait to attribute) and the ITL "
                                          "one is measured, the law reads the ITL share for "
                                          "TTFT too (burn prediction, edge memory)"},
    )

    def __post_init__(self) -> None:
        if not 0 < self.fast_s <= self.slow_s:
            raise ConfigError(
                f"burn needs 0 < fast_s <= slow_s, got {self.fast_s!r}, {self.slow_s!r}"
            )
        for name in ("min_samples", "z"):
            if getattr(self, name) < 0:
                raise ConfigError(f"burn.{name} must be >= 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class BurnReading:
    """One output's burn: fast window (point, Wilson bounds, samples, length) and slow window
    (point, lower bound, samples), and the share of over-SLO samples batch caused (NaN: not
    measured or none over)."""

    burn: float
    lower: float
    upper: float
    samples: float
    window_s: float
    slow_burn: float
    slow_lower: float
    slow_samples: float
    batch_share: float = math.nan


IDLE = BurnReading(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


def attributed_shares(shares: tuple[float, ...], step_share_for_ttft: bool) -> tuple[float, ...]:
    """The batch shares the law reads, (TTFT, ITL): as measured, except that with
    `step_share_for_ttft` an unknown TTFT share is the ITL one where that is measured. The
    engines attribute a first token's lateness by the queue wait it spent behind batch
    prefill; a window whose interactive requests waited not at all reads 0/0 (unknown), and
    its late first tokens were late in their own prefill steps, which batch slows as it
    slows the decode steps the ITL share attributes. A measured ITL share means the engines
    export the series, so bare engines (both unknown) stay as they were."""
    ttft, itl = shares
    if step_share_for_ttft and math.isnan(ttft) and math.isfinite(itl):
        return (itl, itl)
    return shares


def wilson_bounds(over: float, n: float, z: float) -> tuple[float, float]:
    """Wilson score interval of the proportion over / n (0, 0 when n is 0)."""
    if n <= 0:
        return 0.0, 0.0
    p = min(max(over / n, 0.0), 1.0)
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


class BurnWindow:
    """Per-tick sample increments of one output and the readings made from them."""

    def __init__(self, config: BurnConfig) -> None:
        self.config = config
        self._ticks: deque[tuple[float, float, float, float]] = deque()

    def add(self, now_s: float, over_frac: float, samples: float, window_s: float,
            dt_s: float, batch_frac: float = math.nan) -> bool:
        """Fold one observation in; False (nothing added) when its share is not measured
        although it had samples. `batch_frac` is the share of its over-SLO samples batch
        caused (NaN: unknown)."""
        if not math.isfinite(samples):
            # A source that does not count: each window weighs as the least sample count.
            samples = self.config.min_samples
        if samples <= 0:
            over_frac = 0.0
        elif not math.isfinite(over_frac):
            return False
        scale = min(1.0, dt_s / window_s) if window_s > 0 and math.isfinite(window_s) else 1.0
        n = samples * scale
        over = over_frac * n
        # No sample over the SLO: nothing for batch to have caused, whatever the share
        # (the engines' share is 0/0 there, and must not make the window's share unknown).
        caused = over * batch_frac if math.isfinite(batch_frac) else (
            0.0 if over == 0.0 else math.nan)
        self._ticks.append((now_s, over, n, caused))
        horizon = now_s - self.config.slow_s
        while self._ticks and self._ticks[0][0] <= horizon:
            self._ticks.popleft()
        return True

    def reading(self, now_s: float) -> BurnReading:
        """The fast and slow burns ending at `now_s` (module docstring)."""
        cfg = self.config
        over = n = caused = 0.0
        caused_known = True
        fast_over = fast_n = fast_caused = math.nan
        fast_window_s = cfg.slow_s
        for t, o, k, c in reversed(self._ticks):
            if math.isnan(fast_n) and now_s - t >= cfg.fast_s and n >= cfg.min_samples:
                fast_over, fast_n, fast_caused = over, n, caused
                fast_window_s = now_s - t
            over += o
            n += k
            if math.isfinite(c):
                caused += c
            else:
                caused_known = False
        if math.isnan(fast_n):
            fast_over, fast_n, fast_caused = over, n, caused
        if n <= 0:
            return IDLE
        lo, hi = wilson_bounds(fast_over, fast_n, cfg.z)
        slow_lo, _ = wilson_bounds(over, n, cfg.z)
        share = (
            fast_caused / fast_over if caused_known and fast_over > 0 else math.nan
        )
        return BurnReading(
            burn=_burn(fast_over, fast_n),
            lower=lo / ALLOWED_SHARE,
            upper=hi / ALLOWED_SHARE,
            samples=fast_n,
            window_s=min(fast_window_s, cfg.slow_s),
            slow_burn=_burn(over, n),
            slow_lower=slow_lo / ALLOWED_SHARE,
            slow_samples=n,
            batch_share=share,
        )


def _burn(over: float, n: float) -> float:
    return over / n / ALLOWED_SHARE if n > 0 else 0.0
