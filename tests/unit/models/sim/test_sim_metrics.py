"""Tests of the simulator's metrics: weighted quantiles and SLO windows."""

from __future__ import annotations

import math

import numpy as np
import pytest
from borrowd.models.signals import Slo
from borrowd.models.sim.metrics import (
    Recorder,
    quantile,
    slo_met,
    weighted_quantile,
    weighted_share_above,
    windows,
)


@pytest.mark.parametrize(
    ("values", "weights", "q", "expected"),
    [
        ([0.01, 0.2], [95, 5], 0.95, 0.01),
        ([0.01, 0.2], [94, 6], 0.95, 0.2),
        ([3.0, 1.0, 2.0], [1, 1, 1], 0.5, 2.0),
        ([5.0], [7], 0.99, 5.0),
    ],
    ids=["tail-at-edge", "tail-over-edge", "unsorted-median", "single"],
)
def test_weighted_quantile(values: list[float], weights: list[int], q: float,
                           expected: float) -> None:
    """A weighted quantile counts each value as many times as its weight."""
    got = weighted_quantile(np.array(values), np.array(weights, dtype=float), q)
    assert got == expected
    expanded = np.repeat(values, weights)
    assert quantile(expanded, q) == expected


def test_empty_quantiles_are_nan() -> None:
    """No samples gives NaN, and a window without samples does not fail its SLO."""
    assert math.isnan(weighted_quantile(np.array([]), np.array([]), 0.95))
    assert math.isnan(quantile(np.array([]), 0.95))
    nan = float("nan")
    assert slo_met({"ttft_p95_s": nan, "itl_p95_s": nan, "success_rate": nan}, Slo())


def test_windows_split_samples_by_time() -> None:
    """Per-window figures use only the samples produced in that window."""
    rec = Recorder(120.0)
    rec.ttft_t += [10.0, 70.0]
    rec.ttft_s += [0.2, 3.0]
    rec.itl_t += [10.0, 70.0]
    rec.itl_s += [0.01, 0.01]
    rec.itl_w += [100, 100]
    rec.outcome_t += [10.0, 70.0]
    rec.outcome_ok += [True, False]
    rec.busy_s_per_s[5] = 30.0
    wins = windows(rec, 120.0, 60.0, 1, Slo())
    assert [w.slo_met for w in wins] == [True, False]
    assert wins[0].interactive["ttft_p95_s"] == 0.2
    assert wins[1].interactive["success_rate"] == 0.0
    assert wins[0].gpu_busy_frac == 0.5


@pytest.mark.parametrize(
    ("values", "weights", "threshold", "expected"),
    [
        ([0.01, 0.2], [19, 1], 0.05, 0.05),
        ([0.01, 0.05, 0.2], [1, 1, 2], 0.05, 0.5),
        ([0.01, 0.02], [5, 5], 0.05, 0.0),
        ([], [], 0.05, math.nan),
    ],
    ids=["one-step-of-twenty-gaps", "at-threshold-is-not-above", "none-above", "empty"],
)
def test_weighted_share_above(values: list[float], weights: list[int], threshold: float,
                              expected: float) -> None:
    """Share of the weight strictly above the threshold; NaN without samples."""
    got = weighted_share_above(np.array(values), np.array(weights, dtype=float), threshold)
    assert got == pytest.approx(expected, nan_ok=True)


def test_slo_burn_weights_gaps_per_step_and_counts_first_tokens() -> None:
    """A window's shares above the SLOs: ITL steps by their gap count, TTFTs one each."""
    rec = Recorder(10.0)
    rec.itl_t += [1.0, 2.0, 3.0, 20.0]
    rec.itl_s += [0.008, 0.2, 0.008, 0.2]
    rec.itl_w += [30, 5, 15, 100]
    rec.ttft_t += [1.0, 2.0, 3.0, 4.0]
    rec.ttft_s += [0.3, 1.5, 0.2, 0.4]
    itl, ttft = rec.slo_burn(0.0, 5.0, Slo())
    assert itl == pytest.approx(5 / 50)
    assert ttft == pytest.approx(0.25)
    # At most 5% above the SLO is exactly p95 <= SLO.
    fig = rec.interactive_figures(0.0, 5.0)
    assert (fig["itl_p95_s"] <= Slo().itl_p95_s) == (itl <= 0.05)
