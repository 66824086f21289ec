"""Control laws on step tests: PI min-selector and anti-windup, MPC constraints, slack law."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from borrowd.controller.laws.base import LawSettings, LawTick, Proposal
from borrowd.controller.laws.feedforward import (
    FeedForwardConfig,
    ForecastState,
    forecast,
    forecast_update,
)
from borrowd.controller.laws.mpc import (
    MpcConfig,
    MpcOutput,
    mpc_advance,
    mpc_initial_state,
    mpc_step,
)
from borrowd.controller.laws.pi import PiConfig, PiGains, PiLaw, PiLoop, PiState, pi_gains, pi_step
from borrowd.controller.laws.slack import SlackConfig, slack_step
from borrowd.controller.laws.wrappers import FeedForward
from borrowd.models.errors import ConfigError
from borrowd.models.plant.fopdt import FopdtFit
from borrowd.models.signals import Observation

LOOPS = (
    PiLoop("ttft", 0.6, PiGains(kp=10_000.0, ki_per_s=2_000.0)),
    PiLoop("itl", 0.8, PiGains(kp=10_000.0, ki_per_s=2_000.0)),
)


def test_min_selector_picks_the_tighter_loop():
    """The loop with the least room (largest output over setpoint) sets the budget."""
    state = PiState(errors=(0.0, 0.0))
    result = pi_step(LOOPS, state, (0.5, 0.95), 20_000.0, 1.0, 0.0, 100_000.0)
    assert result.selected == 1
    assert result.u < 20_000.0


def test_unselected_loop_does_not_wind_up():
    """External reset: a loop kept out by the selector for long does not accumulate input."""
    state = PiState.initial(2)
    u = 10_000.0
    for _ in range(200):
        # TTFT far below its setpoint (its own PI would grow without bound); ITL on setpoint.
        result = pi_step(LOOPS, state, (0.1, 0.8), u, 1.0, 0.0, 1e9)
        state, u = result.state, result.u
    assert u == pytest.approx(10_000.0)
    # When ITL then rises, the budget falls at once instead of unwinding a stored integral.
    result = pi_step(LOOPS, state, (0.1, 0.9), u, 1.0, 0.0, 1e9)
    assert result.u < 10_000.0


@pytest.mark.parametrize(
    ("u_applied", "outputs", "expected"),
    [(0.0, (1.5, 1.5), 0.0), (50_000.0, (0.0, 0.0), 50_000.0)],
    ids=["clamped-at-zero", "clamped-at-max"],
)
def test_saturation_holds_at_the_bound_without_windup(u_applied, outputs, expected):
    """At a bound the input stays there, and one tick of opposite error leaves it at once."""
    state = PiState.initial(2)
    u = u_applied
    for _ in range(100):
        result = pi_step(LOOPS, state, outputs, u, 1.0, 0.0, 50_000.0)
        state, u = result.state, result.u
    assert u == expected
    reverse = (0.0, 0.0) if expected == 0.0 else (1.5, 1.5)
    moved = pi_step(LOOPS, state, reverse, u, 1.0, 0.0, 50_000.0).u
    assert moved != expected


def test_pi_closed_loop_settles_on_setpoint_without_overshoot_past_slo():
    """SIMC-tuned PI on a FOPDT plant settles at the setpoint and never crosses the SLO."""
    gain, tau_s, dead, dt = 1e-5, 5.0, 2, 1.0
    fit = FopdtFit(gain, tau_s, dead * dt, 0.0, 0.3, dt, 0.0, 1.0)
    gains = pi_gains(fit, "simc", 0.0, dt)
    loop = (PiLoop("ttft", 0.6, gains),)
    a = math.exp(-dt / tau_s)
    y, u, state, hist = 0.3, 0.0, PiState.initial(1), [0.0] * (dead + 1)
    ys = []
    for _ in range(150):
        result = pi_step(loop, state, (y,), u, dt, 0.0, 1e6)
        state, u = result.state, result.u
        hist.append(u)
        y = a * y + (1 - a) * (0.3 + gain * hist[-2 - dead])
        ys.append(y)
    assert ys[-1] == pytest.approx(0.6, abs=0.01)
    assert max(ys) < 1.0


@pytest.mark.parametrize("method", ["simc", "imc"], ids=["simc", "imc"])
def test_tuning_rules_give_positive_gains_inverse_to_plant_gain(method):
    """SIMC/IMC gains are positive and halve when the plant gain doubles."""
    fit = FopdtFit(1e-5, 5.0, 2.0, 0.0, 0.3, 1.0, 0.0, 1.0)
    double = FopdtFit(2e-5, 5.0, 2.0, 0.0, 0.3, 1.0, 0.0, 1.0)
    g1, g2 = pi_gains(fit, method, 0.0, 1.0), pi_gains(double, method, 0.0, 1.0)
    assert g1.kp > 0 and g1.ki_per_s > 0
    assert g2.kp == pytest.approx(g1.kp / 2)


def _mpc_plant():
    return (MpcOutput("ttft", 1e-5, math.exp(-1 / 5.0), 2, 0.6),)


def test_mpc_holds_prediction_under_setpoint_and_maximises_budget():
    """MPC on its own model converges to the largest budget whose output sits at the setpoint."""
    outs = _mpc_plant()
    cfg = MpcConfig(horizon_s=30.0, up_rate_tokens_per_s2=5000.0)
    state = mpc_initial_state(outs, 0.0)
    y, u = 0.3, 0.0
    offset = 0.3
    for _ in range(200):
        res = mpc_step(outs, state, (y,), u, np.zeros(30), 0.0, cfg, 1.0, 0.0, 1e6)
        u = res.u
        state = mpc_advance(outs, state, u)
        y = state.model_outputs[0] + offset
        assert y <= 0.6 + 1e-6
    assert u == pytest.approx((0.6 - offset) / 1e-5, rel=0.02)


def test_mpc_rate_limits_rise_and_cuts_fast():
    """MPC raises the budget at most at its up rate and cuts when the output is over setpoint."""
    outs = _mpc_plant()
    cfg = MpcConfig(up_rate_tokens_per_s2=1000.0, down_rate_tokens_per_s2=20_000.0)
    state = mpc_initial_state(outs, 10_000.0)
    up = mpc_step(outs, state, (0.2,), 10_000.0, np.zeros(30), 0.0, cfg, 1.0, 0.0, 1e6)
    assert up.u == pytest.approx(11_000.0)
    down = mpc_step(outs, state, (1.2,), 10_000.0, np.zeros(30), 0.0, cfg, 1.0, 0.0, 1e6)
    assert down.u < 10_000.0
    assert down.violated


def test_mpc_feedforward_cuts_before_latency_moves():
    """A forecast rise of the interactive rate lowers the budget while the output is unchanged."""
    outs = _mpc_plant()
    cfg = MpcConfig()
    state = mpc_initial_state(outs, 30_000.0)
    flat = mpc_step(outs, state, (0.6,), 20_000.0, np.full(30, 10_000.0), 1.0, cfg, 1.0, 0, 1e6)
    rising = np.full(30, 25_000.0)  # the rate has just risen; the output has not moved yet
    ahead = mpc_step(outs, state, (0.6,), 20_000.0, rising, 1.0, cfg, 1.0, 0, 1e6)
    assert ahead.u < flat.u


def test_forecast_extrapolates_rises_only():
    """Holt forecast extrapolates a rising rate and holds a falling one at its level."""
    cfg = FeedForwardConfig(alpha=0.5, beta=0.5)
    state = ForecastState()
    for rate in (1000, 2000, 3000, 4000):
        state = forecast_update(state, rate, cfg)
    assert forecast(state, 3)[-1] > state.level
    for rate in (3000, 2000, 1000, 500):
        state = forecast_update(state, rate, cfg)
    assert np.all(forecast(state, 3) == state.level)


@pytest.mark.parametrize(
    ("outputs", "u_applied", "expected"),
    [
        ((1.1, 0.5), 20_000.0, 0.0),
        ((0.95, 0.5), 20_000.0, 18_000.0),
        ((0.8, 0.5), 20_000.0, 20_000.0),
        ((0.5, 0.5), 20_000.0, 20_500.0),
        ((math.nan, math.nan), 20_000.0, 20_000.0),
    ],
    ids=["over-slo-cut", "low-slack-shrink", "hold", "grow", "unmeasured-hold"],
)
def test_slack_law_actions(outputs, u_applied, expected):
    """The Heracles-style law cuts, shrinks, holds or grows by the slack band."""
    assert slack_step(outputs, u_applied, SlackConfig(), 0.0, 1e6) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("u", "reference", "expected"),
    [(70_000.0, 70_000.0, 1.0), (140_000.0, 70_000.0, 1.0), (14_000.0, 70_000.0, 0.2),
     (0.0, 70_000.0, 0.1), (5_000.0, 0.0, 1.0)],
    ids=["at-reference", "above-reference-capped", "fifth-of-reference", "floor", "off"],
)
def test_pi_gains_scale_with_the_budget_below_the_reference(u, reference, expected):
    """Configured PI gains scale with the budget below the reference, floored, never up."""
    config = PiConfig(gain_reference_tokens_per_s=reference, min_gain_scale=0.1)
    assert config.operating_scale(u) == pytest.approx(expected)


def burn_tick(u: float, itl_burn: float, now_s: float) -> LawTick:
    """A tick at budget `u` whose ITL burn is `itl_burn` (no TTFT sample)."""
    return LawTick(Observation(now_s=now_s, age_s=0.5), (math.nan, math.nan), u, 1.0,
                   burns=(0.0, itl_burn))


def test_pi_law_falls_at_most_one_multiplicative_step_per_window():
    """A burn jump far over the setpoint takes the law down to fall_floor_frac of its
    highest budget of fall_window_s and no further, until that peak leaves the window."""
    config = PiConfig(setpoint_itl_burn=0.9, fall_floor_frac=0.7, fall_window_s=10.0)
    law = PiLaw(LawSettings(1.0, 200_000.0, None, {"pi": config}))
    u = 40_000.0
    for t in range(3):
        u = law.propose(burn_tick(u, 0.5, float(t))).u_tokens_per_s
    peak = u
    falls = []
    for t in range(3, 13):
        u = law.propose(burn_tick(u, 5.0, float(t))).u_tokens_per_s
        falls.append(u)
    assert min(falls) == pytest.approx(0.7 * peak)
    assert law.propose(burn_tick(u, 5.0, 14.0)).u_tokens_per_s < 0.7 * peak


@pytest.mark.parametrize(("follows", "falls"), [(True, 1), (False, 3)],
                         ids=["follows-burn", "fixed-window"])
def test_pi_falls_once_per_burn_window_when_it_follows_the_burn(follows, falls):
    """A burn held by a 40 s window (sparse samples) is one event: with
    `fall_window_follows_burn` the law falls one multiplicative step for it in those 40 s,
    where a fixed 10 s fall window lets it fall again every 10 s."""
    config = PiConfig(setpoint_itl_burn=0.9, fall_floor_frac=0.7, fall_window_s=10.0,
                      fall_window_follows_burn=follows)
    law = PiLaw(LawSettings(1.0, 200_000.0, None, {"pi": config}))

    def tick(u: float, burn: float, now_s: float) -> LawTick:
        return replace(burn_tick(u, burn, now_s), burn_windows_s=(math.nan, 40.0))

    u = 40_000.0
    for t in range(3):
        u = law.propose(tick(u, 0.5, float(t))).u_tokens_per_s
    peak = u
    for t in range(3, 30):
        u = law.propose(tick(u, 5.0, float(t))).u_tokens_per_s
    assert u == pytest.approx(0.7**falls * peak)


@pytest.mark.parametrize("frac", [-0.1, 1.0], ids=["negative", "one"])
def test_pi_fall_floor_out_of_range_is_refused(frac):
    """fall_floor_frac must lie in [0, 1): the error names the key."""
    with pytest.raises(ConfigError, match="fall_floor_frac"):
        PiConfig(fall_floor_frac=frac)


class Recorder:
    """An inner `Law` that proposes u_applied + du_ff and remembers the ticks it saw."""

    def __init__(self) -> None:
        self.ticks: list[LawTick] = []

    def propose(self, tick: LawTick) -> Proposal:
        """Propose the applied budget plus the feed-forward step."""
        self.ticks.append(tick)
        return Proposal(tick.u_applied_tokens_per_s + tick.du_ff_tokens_per_s, tick)

    def applied(self, tick: LawTick, u_tokens_per_s: float) -> None:
        """Nothing to remember."""

    def state(self) -> dict[str, float]:
        """No state."""
        return {}


@pytest.mark.parametrize(
    ("capacities", "expected"),
    [((400e3, 400e3, 300e3), 45_000.0), ((300e3, 300e3, 400e3), 80_000.0),
     ((400e3, math.nan, 400e3), 60_000.0)],
    ids=["replica-lost", "replica-back", "unmeasured-holds"],
)
def test_capacity_feedforward_scales_the_budget_with_the_engines_up(capacities, expected):
    """When the KV capacity of the engines up moves by a ratio, the budget moves by it at
    once; an unmeasured capacity moves nothing."""
    law = FeedForward(Recorder(), FeedForwardConfig(gain=0.0), 1.0)
    u = 60_000.0
    for t, capacity in enumerate(capacities):
        obs = Observation(now_s=float(t), age_s=0.5, kv_capacity_tokens=capacity)
        u = law.propose(LawTick(obs, (0.5, 0.5), u, 1.0)).u_tokens_per_s
    assert u == pytest.approx(expected)


class Climber(Recorder):
    """An inner `Law` that asks for 5k tokens/s more than applied each tick, plus the step."""

    def propose(self, tick: LawTick) -> Proposal:
        """Climb by 5k on top of the feed-forward step."""
        return Proposal(tick.u_applied_tokens_per_s + tick.du_ff_tokens_per_s + 5000.0, tick)


def test_after_a_replica_is_lost_no_increase_for_one_signal_lag():
    """The burns read for one window (10 s) plus the observation's age after a replica is
    lost describe the fleet before: the budget steps down with the capacity and the law's
    increases wait until the readings cover the smaller fleet; a replica back holds nothing."""
    law = FeedForward(Climber(), FeedForwardConfig(gain=0.0), 1.0)
    u, budgets = 60_000.0, []
    for t in range(20):
        capacity = 400e3 if t < 2 else 300e3
        obs = Observation(now_s=float(t), age_s=0.5, window_s=15.0, kv_capacity_tokens=capacity)
        tick = LawTick(obs, (0.5, 0.5), u, 1.0, burn_windows_s=(10.0, 10.0))
        u = law.propose(tick).u_tokens_per_s
        budgets.append(u)
    assert budgets[1] == pytest.approx(70_000.0)
    assert budgets[2:13] == pytest.approx([52_500.0] * 11)  # 70k * 3/4, held 10.5 s
    assert budgets[13] == pytest.approx(57_500.0)
    back = FeedForward(Climber(), FeedForwardConfig(gain=0.0), 1.0)
    u = 45_000.0
    for t, capacity in enumerate((300e3, 400e3, 400e3)):
        obs = Observation(now_s=float(t), age_s=0.5, kv_capacity_tokens=capacity)
        u = back.propose(LawTick(obs, (0.5, 0.5), u, 1.0)).u_tokens_per_s
    assert u == pytest.approx((50_000.0 * 4 / 3 + 5000.0) + 5000.0)


def test_pi_fall_floor_lets_a_feedforward_step_through():
    """The fall floor bounds the feedback only: a feed-forward cut (an interactive burst
    forecast) takes the budget below it at once."""
    config = PiConfig(setpoint_itl_burn=0.9, fall_floor_frac=0.7, fall_window_s=10.0)
    law = PiLaw(LawSettings(1.0, 200_000.0, None, {"pi": config}))
    law.propose(burn_tick(40_000.0, 0.9, 0.0))
    tick = replace(burn_tick(40_000.0, 0.9, 1.0), du_ff_tokens_per_s=-30_000.0)
    assert law.propose(tick).u_tokens_per_s == pytest.approx(10_000.0)


@pytest.mark.parametrize(
    ("window_s", "itl_norm", "expected_scale"),
    [(40.0, 0.8, 0.25), (10.0, 0.8, 1.0), (40.0, 0.3, 1.0), (math.nan, 0.8, 1.0)],
    ids=["late-and-near-runs-slower", "on-time", "late-but-far", "window-unknown"],
)
def test_pi_loop_on_a_late_signal_near_its_slo_runs_slower(window_s, itl_norm, expected_scale):
    """A burn whose window had to lengthen to 40 s (fast window 10 s) to hold its samples is
    a loop with four times the dead time: near its SLO its step is a quarter as large; an
    on-time signal, or one far under its SLO, keeps its gains."""
    config = PiConfig(setpoint_itl_burn=0.9, gain_reference_tokens_per_s=0.0,
                      fall_floor_frac=0.0)

    def step(windows: tuple[float, float]) -> float:
        law = PiLaw(LawSettings(1.0, 200_000.0, None, {"pi": config}))
        tick = LawTick(Observation(now_s=0.0, age_s=0.5), (math.nan, itl_norm), 40_000.0, 1.0,
                       burns=(math.nan, 0.4), burn_windows_s=windows)
        return law.propose(tick).u_tokens_per_s - 40_000.0

    assert step((math.nan, window_s)) == pytest.approx(expected_scale * step((math.nan, 10.0)))


@pytest.mark.parametrize(("enforcement", "setpoint"), [("admission", 0.95), ("engine", 0.8)])
def test_pi_itl_burn_setpoint_follows_the_pools_enforcement(enforcement, setpoint):
    """A pool whose engines run the plugin (`controller.enforcement = "engine"`) tracks the
    ITL burn at `pi.setpoint_itl_burn_engine`, one with admission only at
    `pi.setpoint_itl_burn`: at that burn the loop holds the budget still."""
    config = PiConfig(gain_reference_tokens_per_s=0.0, fall_floor_frac=0.0)
    law = PiLaw(LawSettings(1.0, 200_000.0, None, {"pi": config}, enforcement=enforcement))
    tick = LawTick(Observation(now_s=0.0, age_s=0.5), (math.nan, 0.5), 40_000.0, 1.0,
                   burns=(math.nan, setpoint), burn_windows_s=(math.nan, 10.0))
    assert law.propose(tick).u_tokens_per_s == pytest.approx(40_000.0)
