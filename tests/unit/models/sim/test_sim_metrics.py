"""Tests of the simulator's metrics: weighted quantiles and SLO windows."""

from __future__ import annotations

import math

import numpy as np
import pytest

from models.signals import Slo
from models.sim.metrics import Recorder, quantile, slo_met, weighted_quantile, windows


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
