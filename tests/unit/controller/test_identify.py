"""Identification fits the signal the law tracks, computed as the policy computes it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from borrowd.controller.identify import tracked_series, tracked_signal
from borrowd.controller.policy import ControllerConfig
from borrowd.models.signals import Observation


def stream(shares: list[float]) -> list[Observation]:
    """One observation a second with the given ITL share above the SLO (TTFT never above)."""
    return [
        Observation(now_s=float(t), age_s=0.0, ttft_p95_s=0.2, itl_p95_s=0.04 + share,
                    itl_over_slo_frac=share, ttft_over_slo_frac=0.0, window_s=5.0,
                    itl_samples=1000.0, ttft_samples=20.0, interactive_requests=20.0)
        for t, share in enumerate(shares)
    ]


def test_burn_series_is_the_counted_fast_burn():
    """With control_on_burn the ITL series is the fast burn: 5% above the SLO reads 1.0."""
    obs = stream([0.0] * 30 + [0.05] * 30)
    series = tracked_series(obs, ControllerConfig(), 1.0)
    assert tracked_signal(ControllerConfig()) == "burn"
    assert series["itl"][0] == 0.0
    assert series["itl"][-1] == pytest.approx(1.0)
    assert np.all(series["ttft"] == 0.0)


def test_without_burn_control_the_series_is_the_smoothed_p95():
    """With control_on_burn off the series is p95/SLO through the policy's smoothing."""
    config = replace(ControllerConfig(), control_on_burn=False)
    series = tracked_series(stream([0.0] * 60), config, 1.0)
    assert tracked_signal(config) == "p95_over_slo"
    assert series["itl"][-1] == pytest.approx(0.8)


def test_a_plant_for_the_mpc_is_fitted_on_p95_even_with_burn_control():
    """The MPC plans on p95/SLO whatever `control_on_burn` says, so its plant is fitted on
    the smoothed p95 (a burn plant would be refused when the MPC is built)."""
    config = replace(ControllerConfig(), law="mpc")
    series = tracked_series(stream([0.0] * 60), config, 1.0)
    assert config.control_on_burn and tracked_signal(config) == "p95_over_slo"
    assert series["itl"][-1] == pytest.approx(0.8)
