"""SLO burn from counted samples: windows, lengthening, Wilson bounds, idle, attribution."""

from __future__ import annotations

import math

import pytest
from borrowd.controller.burn import IDLE, BurnConfig, BurnWindow, attributed_shares, wilson_bounds

NAN = math.nan


def _feed(window: BurnWindow, ticks: int, share: float, samples: float, start_s: float = 0.0,
          batch: float = math.nan) -> float:
    """Add one observation a second (5 s windows) and return the last time."""
    t = start_s
    for k in range(ticks):
        t = start_s + k
        assert window.add(t, share, samples, 5.0, 1.0, batch)
    return t


@pytest.mark.parametrize(
    ("over", "n", "low", "high"),
    [(0.0, 0.0, 0.0, 0.0), (5.0, 100.0, 0.0212, 0.1134), (0.0, 10.0, 0.0, 0.2857)],
    ids=["no-samples", "five-percent", "none-over-few"],
)
def test_wilson_bounds(over: float, n: float, low: float, high: float) -> None:
    """The Wilson interval at z = 2 (no samples: a degenerate interval at 0)."""
    lo, hi = wilson_bounds(over, n, 2.0)
    assert lo == pytest.approx(low, abs=1e-3)
    assert hi == pytest.approx(high, abs=1e-3)


def test_steady_share_reads_as_its_burn_in_both_windows() -> None:
    """A steady 5% above the SLO reads as burn 1 fast and slow, bounds around it."""
    window = BurnWindow(BurnConfig())
    t = _feed(window, 90, 0.05, 5000.0)
    r = window.reading(t)
    assert r.burn == pytest.approx(1.0)
    assert r.slow_burn == pytest.approx(1.0)
    assert r.lower < 1.0 < r.upper
    assert r.window_s == pytest.approx(10.0)
    assert r.samples == pytest.approx(10 * 5000.0 / 5.0)


def test_one_slow_step_among_few_gaps_is_not_confident() -> None:
    """Sparse traffic: the fast window lengthens to hold enough samples, and one slow gap
    among a handful leaves the lower bound under the SLO's edge."""
    window = BurnWindow(BurnConfig(min_samples=100.0))
    t = _feed(window, 59, 0.0, 5.0)
    window.add(t + 1, 0.2, 5.0, 5.0, 1.0)  # one gap in five above the SLO
    r = window.reading(t + 1)
    assert r.window_s > 10.0
    assert r.lower < 1.0


def test_no_interactive_traffic_is_idle_not_missing() -> None:
    """Windows without samples read as burn 0; a share with samples but no value is
    refused (nothing added)."""
    window = BurnWindow(BurnConfig())
    _feed(window, 10, math.nan, 0.0)
    assert window.reading(9.0) == IDLE
    assert not window.add(10.0, math.nan, 50.0, 5.0, 1.0)


def test_old_samples_leave_the_slow_window() -> None:
    """A burn 70 s ago is gone from both windows."""
    window = BurnWindow(BurnConfig())
    _feed(window, 10, 0.5, 1000.0)
    t = _feed(window, 70, 0.0, 1000.0, start_s=10.0)
    r = window.reading(t)
    assert r.burn == 0.0 and r.slow_burn == 0.0


def test_batch_share_follows_the_attribution() -> None:
    """The share of over-SLO samples caused by batch is carried through."""
    window = BurnWindow(BurnConfig())
    t = _feed(window, 20, 0.1, 1000.0, batch=0.8)
    assert window.reading(t).batch_share == pytest.approx(0.8)
    unknown = BurnWindow(BurnConfig())
    t = _feed(unknown, 20, 0.1, 1000.0)
    assert math.isnan(unknown.reading(t).batch_share)


def test_ticks_with_nothing_over_the_slo_leave_the_share_known() -> None:
    """A tick with no sample over the SLO has no share to report (0/0: NaN from the engines),
    and nothing of it was caused by batch: the window's share comes from the ticks that had
    samples over the SLO, not unknown for a quiet tick among them. Without attribution at
    all the share stays unknown."""
    window = BurnWindow(BurnConfig())
    t = 0.0
    for i in range(20):
        over, share = (0.1, 0.6) if i % 2 else (0.0, math.nan)
        window.add(t, over, 1000.0, 5.0, 1.0, share)
        t += 1.0
    assert window.reading(t - 1.0).batch_share == pytest.approx(0.6)
    bare = BurnWindow(BurnConfig())
    for i in range(20):
        bare.add(float(i), 0.1 if i % 2 else 0.0, 1000.0, 5.0, 1.0, math.nan)
    assert math.isnan(bare.reading(19.0).batch_share)


@pytest.mark.parametrize(("shares", "on", "expected"), [
    ((NAN, 0.6), True, (0.6, 0.6)),  # no queue wait to attribute: the step share stands in
    ((NAN, 0.6), False, (NAN, 0.6)),  # switched off: as read
    ((0.2, 0.6), True, (0.2, 0.6)),  # a measured wait share is never replaced
    ((NAN, NAN), True, (NAN, NAN)),  # bare engines (no series): nothing to stand in
], ids=["wait-unknown", "off", "wait-measured", "bare-engines"])
def test_an_unknown_ttft_share_takes_the_measured_step_share(
    shares: tuple[float, float], on: bool, expected: tuple[float, float]
) -> None:
    assert attributed_shares(shares, on) == pytest.approx(expected, nan_ok=True)
