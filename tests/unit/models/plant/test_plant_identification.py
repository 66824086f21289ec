"""Identification: FOPDT and ARX fits, usability refusals, JSON round trip, excitation, RLS."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from borrowd.models.errors import InputError
from borrowd.models.plant.arx import fit_arx
from borrowd.models.plant.excitation import prbs, step_sequence
from borrowd.models.plant.fopdt import fit_fopdt, simulate_fopdt
from borrowd.models.plant.model import PlantModel, UnusableFitError, identify_plant
from borrowd.models.plant.rls import LocalGain, RlsState, rls_update


def fopdt_response(u: np.ndarray, gain: float, tau_s: float, dead_steps: int, dt_s: float,
                   y0: float = 0.3) -> np.ndarray:
    """Exact ZOH response of a FOPDT plant around u0 = 0."""
    return simulate_fopdt(
        u, a=math.exp(-dt_s / tau_s), gain=gain, dead_steps=dead_steps, u0=0.0, y0=y0, y_init=y0
    )


@pytest.mark.parametrize(
    ("gain", "tau_s", "dead_steps", "dt_s", "noise"),
    [
        (1e-5, 5.0, 2, 1.0, 0.005),
        (2e-5, 12.0, 4, 1.0, 0.01),
        (5e-6, 3.0, 1, 0.5, 0.002),
        (1e-5, 8.0, 0, 2.0, 0.005),
    ],
    ids=["tau5-dead2", "tau12-dead4", "fast-halfsecond", "no-dead-time"],
)
def test_fopdt_fit_recovers_known_parameters(gain, tau_s, dead_steps, dt_s, noise):
    """FOPDT least squares recovers gain, tau and dead time within 10% from noisy PRBS data."""
    u = prbs(0.0, 40_000.0, 1200.0, dt_s, 20.0, seed=3)
    y = fopdt_response(u, gain, tau_s, dead_steps, dt_s)
    y = y + np.random.default_rng(1).normal(0.0, noise, len(y))
    fit = fit_fopdt(u, y, dt_s, max_dead_s=10.0)
    assert fit.gain == pytest.approx(gain, rel=0.10)
    assert fit.tau_s == pytest.approx(tau_s, rel=0.10)
    assert fit.dead_s == pytest.approx(dead_steps * dt_s, abs=0.1 * max(dead_steps * dt_s, dt_s))
    assert fit.r2 > 0.9


def test_arx_fit_matches_fopdt_static_gain():
    """ARX(2,2,nk) on FOPDT data has the FOPDT static gain and a near-perfect fit."""
    u = prbs(0.0, 40_000.0, 800.0, 1.0, 15.0, seed=4)
    y = fopdt_response(u, 1e-5, 6.0, 2, 1.0)
    fit = fit_arx(u, y, 1.0, na=2, nb=2, nk=3)
    assert fit.is_stable()
    assert fit.static_gain() == pytest.approx(1e-5, rel=0.05)
    assert fit.r2 > 0.99


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("wrong-sign", "wrong sign"),
        ("flat-input", "too little excitation"),
        ("noise-only", "poor fit"),
    ],
    ids=["wrong-sign", "flat-input", "noise-only"],
)
def test_unusable_fit_is_refused_with_reason(case, reason):
    """Wrong sign, too little excitation and a poor fit are refused naming the reason."""
    rng = np.random.default_rng(7)
    u = prbs(0.0, 40_000.0, 600.0, 1.0, 15.0, seed=5)
    y = fopdt_response(u, 1e-5, 5.0, 2, 1.0)
    if case == "wrong-sign":
        y = 1.0 - y
    elif case == "flat-input":
        u = np.full_like(u, 20_000.0)
        y = 0.5 + rng.normal(0.0, 0.01, len(u))
    else:
        y = 0.5 + rng.normal(0.0, 0.05, len(u))
    with pytest.raises(UnusableFitError, match=reason):
        identify_plant(u, {"ttft": y}, 1.0, interactive_tokens_per_s=1000.0, source="test")


def test_plant_model_json_round_trip(tmp_path: Path):
    """A saved plant loads back equal; a missing or malformed file is an InputError naming it."""
    u = prbs(0.0, 40_000.0, 600.0, 1.0, 15.0, seed=6)
    y = fopdt_response(u, 1e-5, 5.0, 2, 1.0)
    plant = identify_plant(
        u, {"ttft": y, "itl": 0.5 * y}, 1.0, interactive_tokens_per_s=900.0, source="synthetic"
    )
    path = tmp_path / "plant.json"
    plant.save(path)
    assert PlantModel.load(path) == plant
    with pytest.raises(InputError, match=r"missing\.json"):
        PlantModel.load(tmp_path / "missing.json")
    path.write_text("{]")
    with pytest.raises(InputError, match="not JSON"):
        PlantModel.load(path)


@pytest.mark.parametrize("kind", ["steps", "prbs"], ids=["steps", "prbs"])
def test_excitation_stays_within_bounds_and_holds(kind):
    """Excitation signals use only the two bounds and hold each level at least hold_s."""
    args = (1000.0, 30_000.0, 300.0, 1.0, 10.0)
    u = step_sequence(*args) if kind == "steps" else prbs(*args, seed=2)
    assert set(np.unique(u)) == {1000.0, 30_000.0}
    change = np.flatnonzero(np.diff(u)) + 1
    runs = np.diff(np.concatenate([[0], change]))
    assert runs.min() >= 10


def test_excitation_rejects_bad_bounds():
    """Bounds out of order are an InputError."""
    with pytest.raises(InputError, match="u_low < u_high"):
        step_sequence(5.0, 1.0, 100.0, 1.0, 10.0)


def test_rls_tracks_a_gain_change():
    """RLS with forgetting moves its local-gain estimate to a doubled plant gain."""
    dt_s, tau_s, dead = 1.0, 5.0, 2
    a = math.exp(-dt_s / tau_s)
    u = prbs(0.0, 40_000.0, 1200.0, dt_s, 10.0, seed=8)
    gain = np.where(np.arange(len(u)) < 600, 1e-5, 2e-5)
    y = np.empty(len(u))
    y[0] = 0.3
    for k in range(len(u) - 1):
        y[k + 1] = a * y[k] + (1 - a) * (0.3 + gain[k] * u[max(k - dead, 0)])
    est = LocalGain.start(1e-5, a, 0.3, 0.0, dead, u_scale=40_000.0)
    for k in range(1, len(u)):
        est = est.update(u[k], y[k], forgetting=0.98, max_trace=100.0)
        if k == 599:
            assert est.gain() == pytest.approx(1e-5, rel=0.1)
    assert est.gain() == pytest.approx(2e-5, rel=0.1)


def test_burn_plant_keeps_its_signal_and_leaves_an_idle_burn_out(tmp_path: Path):
    """A plant fitted on SLO burns says so; a burn that never left 0 is left out with the
    reason, and the plant round-trips through JSON with both."""
    u = prbs(0.0, 40_000.0, 600.0, 1.0, 15.0, seed=6)
    y = fopdt_response(u, 1e-5, 5.0, 2, 1.0)
    plant = identify_plant(
        u, {"ttft": np.zeros_like(y), "itl": y}, 1.0, interactive_tokens_per_s=900.0,
        source="synthetic", signal="burn",
    )
    assert plant.signal == "burn"
    assert [o.name for o in plant.outputs] == ["itl"]
    assert "ttft" in plant.unmodelled[0]
    path = tmp_path / "plant.json"
    plant.save(path)
    assert PlantModel.load(path) == plant
    with pytest.raises(UnusableFitError, match="burn stayed 0"):
        identify_plant(u, {"itl": np.zeros_like(y)}, 1.0, interactive_tokens_per_s=900.0,
                       source="synthetic", signal="burn")


def test_rls_step_is_exactly_rounded() -> None:
    """RLS's inner products are exactly rounded, not left to a BLAS kernel: a regressor whose
    products cancel (1e16 + 1 - 1e16) gives the prediction error of the exact sum, so the
    estimate is the same on every CPU."""
    state = RlsState(theta=np.array([1.0, 1.0, 1.0]), p=np.eye(3))
    phi = np.array([1e16, 1.0, -1e16])
    # phi . theta is exactly 1.0; y = 1.0 leaves no error, so theta stays where it was.
    after = rls_update(state, phi, 1.0, forgetting=1.0, max_trace=1e40)
    assert np.array_equal(after.theta, state.theta)
