"""Supervisor transitions, table-driven: cuts, hysteresis, quiet hold, ramp, stop, failsafe."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from borrowd.controller.burn import BurnReading
from borrowd.controller.supervisor import (
    RampInputs,
    SupervisorConfig,
    SupervisorState,
    ramp_doubling_s,
    supervise,
)
from borrowd.models.budget import Mode
from borrowd.models.signals import Observation, Slo

SLO = Slo()
CFG = SupervisorConfig(quiet_s=10.0, ramp_slew_tokens_per_s2=1000.0, ramp_cap_tokens_per_s=5000.0)


def obs(**over: float) -> Observation:
    """A healthy, quiet observation with fields overridden."""
    base = dict(
        now_s=0.0,
        age_s=0.5,
        ttft_p95_s=0.3,
        itl_p95_s=0.02,
        success_rate=1.0,
        kv_usage_frac=0.5,
        interactive_queue_depth=0.0,
        interactive_oldest_wait_s=0.1,
        interactive_tokens_per_s=1000.0,
    )
    base.update(over)
    return Observation(**base)


OPEN = SupervisorState(mode=Mode.OPEN, reason="open")
RAMP = SupervisorState(mode=Mode.RAMP, ramp_tokens_per_s=2000.0, reason="ramp")
CLOSED = SupervisorState(mode=Mode.CLOSED, reason="cut")


@pytest.mark.parametrize(
    ("state", "observation", "u_law", "stopped", "mode", "u", "reason"),
    [
        (OPEN, obs(), 8000.0, False, Mode.OPEN, 8000.0, "open"),
        (OPEN, obs(ttft_p95_s=1.05), 8000.0, False, Mode.CLOSED, 0.0, "TTFT"),
        (OPEN, obs(itl_p95_s=0.08), 8000.0, False, Mode.CLOSED, 0.0, "ITL"),
        (OPEN, obs(kv_usage_frac=0.98), 8000.0, False, Mode.CLOSED, 0.0, "KV"),
        (OPEN, obs(interactive_oldest_wait_s=3.0), 8000.0, False, Mode.CLOSED, 0.0, "wait"),
        (OPEN, obs(success_rate=0.95), 8000.0, False, Mode.CLOSED, 0.0, "success"),
        (RAMP, obs(ttft_p95_s=1.2), 8000.0, False, Mode.CLOSED, 0.0, "TTFT"),
        (OPEN, obs(ttft_p95_s=math.nan), 8000.0, False, Mode.FAILSAFE, 0.0, "ttft_p95_s"),
        (OPEN, obs(age_s=30.0), 8000.0, False, Mode.FAILSAFE, 0.0, "age"),
        (RAMP, obs(kv_usage_frac=math.nan), 8000.0, False, Mode.FAILSAFE, 0.0, "kv_usage"),
        (OPEN, obs(), 8000.0, True, Mode.STOPPED, 0.0, "operator"),
        (SupervisorState(mode=Mode.STOPPED), obs(), 8000.0, False, Mode.CLOSED, 0.0, "resumed"),
        (SupervisorState(mode=Mode.FAILSAFE), obs(), 8000.0, False, Mode.CLOSED, 0.0, "back"),
        (RAMP, obs(), 8000.0, False, Mode.RAMP, 2000.0 * 2.0 ** (1 / 15) + 1000.0, "ramp"),
        (RAMP, obs(), 2500.0, False, Mode.RAMP, 2000.0 * 2.0 ** (1 / 15) + 1000.0, "ramp"),
        (RAMP, obs(), 1500.0, False, Mode.OPEN, 1500.0, "law below"),
        (RAMP, obs(), 0.0, False, Mode.RAMP, 2000.0, "held"),
        (SupervisorState(mode=Mode.RAMP, ramp_tokens_per_s=4500.0), obs(), 9000.0, False,
         Mode.OPEN, 9000.0, "cap"),
        (CLOSED, obs(ttft_p95_s=0.9), 8000.0, False, Mode.CLOSED, 0.0, "cut"),
        (SupervisorState(mode=Mode.CLOSED, quiet_since_s=-10.0), obs(), 8000.0, False,
         Mode.RAMP, 2000.0, "quiet"),
        (SupervisorState(mode=Mode.CLOSED, quiet_since_s=-10.0, ramp_tokens_per_s=3500.0),
         obs(), 8000.0, False, Mode.RAMP, 3500.0, "quiet"),
        (SupervisorState(mode=Mode.CLOSED, quiet_since_s=-10.0, ramp_tokens_per_s=3500.0,
                         after_cut=True), obs(), 8000.0, False, Mode.OPEN, 3500.0, "budget kept"),
        (RAMP, obs(ttft_p95_s=0.9), 8000.0, False, Mode.OPEN, 8000.0, "ramp ends"),
        (SupervisorState(mode=Mode.CLOSED, quiet_since_s=-5.0), obs(), 8000.0, False,
         Mode.CLOSED, 0.0, ""),
        (OPEN, obs(itl_p95_s=0.2, itl_over_slo_frac=0.04), 8000.0, False, Mode.OPEN, 8000.0,
         "open"),
        (OPEN, obs(itl_over_slo_frac=0.08), 8000.0, False, Mode.CLOSED, 0.0, "ITL burn"),
        (OPEN, obs(ttft_over_slo_frac=0.1), 8000.0, False, Mode.CLOSED, 0.0, "TTFT burn"),
        (SupervisorState(mode=Mode.CLOSED, quiet_since_s=-10.0), obs(itl_over_slo_frac=0.045),
         8000.0, False, Mode.CLOSED, 0.0, ""),
    ],
    ids=[
        "open-stays-open",
        "open-ttft-burn-cuts",
        "open-itl-burn-cuts",
        "open-kv-limit-cuts",
        "open-queue-age-cuts",
        "open-success-drop-cuts",
        "ramp-burn-cuts",
        "nan-signal-failsafe",
        "stale-failsafe",
        "ramp-nan-failsafe",
        "stop-switch",
        "resume-holds-closed",
        "failsafe-recovers-to-closed",
        "ramp-doubles-and-slews-up",
        "ramp-goes-on-while-the-law-rises",
        "ramp-hands-to-a-law-that-asks-less",
        "ramp-holds-for-a-law-at-zero",
        "ramp-reaches-cap",
        "closed-between-thresholds-stays-closed",
        "closed-quiet-long-enough-ramps-from-the-least-start",
        "closed-quiet-ramps-from-its-restart",
        "closed-after-a-cut-reopens-open-at-the-budget-kept",
        "ramp-ends-when-a-signal-leaves-its-quiet-band",
        "closed-quiet-too-short-holds",
        "measured-burn-under-cut-overrides-a-p95-jump",
        "open-itl-slo-burn-cuts",
        "open-ttft-slo-burn-cuts",
        "closed-burn-above-reopen-is-not-quiet",
    ],
)
def test_transition(state, observation, u_law, stopped, mode, u, reason):
    """Each (mode, signals) pair leads to the expected mode, budget and reason."""
    decision = supervise(CFG, state, observation, SLO, u_law, 1.0, 0.0, stopped=stopped)
    assert decision.mode == mode
    assert decision.u == pytest.approx(u)
    assert reason in decision.reason
    assert bool(decision.events) == (mode != state.mode)
    if decision.events:
        assert decision.events[0].to_mode == mode
        assert decision.events[0].reason == decision.reason


def test_hysteresis_needs_the_lower_threshold_for_the_whole_quiet_interval():
    """After a cut, a signal between reopen and cut thresholds restarts the quiet clock."""
    state = CLOSED
    for t in range(0, 8):
        state = supervise(CFG, state, obs(), SLO, 8000.0, 1.0, float(t)).state
    # A single tick above reopen (0.8) but under the cut (1.0) resets the quiet interval.
    state = supervise(CFG, state, obs(ttft_p95_s=0.9), SLO, 8000.0, 1.0, 8.0).state
    assert state.mode == Mode.CLOSED and math.isnan(state.quiet_since_s)
    modes = []
    for t in range(9, 22):
        state = supervise(CFG, state, obs(), SLO, 8000.0, 1.0, float(t)).state
        modes.append(state.mode)
    assert modes.index(Mode.RAMP) == 10  # quiet from t=9, reopens at t=19


def test_failsafe_never_opens_on_missing_metrics():
    """With every signal NaN the budget stays at the floor for as long as it lasts."""
    state = OPEN
    cfg = replace(CFG, floor_tokens_per_s=0.0)
    blank = Observation(now_s=0.0, age_s=math.nan)
    for t in range(50):
        decision = supervise(cfg, state, blank, SLO, 1e6, 1.0, float(t))
        state = decision.state
        assert decision.mode == Mode.FAILSAFE and decision.u == 0.0


@pytest.mark.parametrize(("samples", "requests", "mode"), [
    (0.0, 3.0, Mode.OPEN), (2.0, 3.0, Mode.OPEN), (math.nan, 0.0, Mode.OPEN),
    (40.0, 3.0, Mode.FAILSAFE), (math.nan, 3.0, Mode.FAILSAFE),
], ids=["none-counted", "two-first-tokens-counted-after-the-rules-window",
        "no-count-no-request", "many-counted-but-no-p95", "no-count-with-traffic"])
def test_a_missing_p95_from_sparse_traffic_is_not_a_failsafe(
    samples: float, requests: float, mode: Mode
) -> None:
    """A p95 TTFT read as NaN is sparse traffic (a safe reading) when its window counted
    fewer than a handful of first tokens (the count's window ends at the last scrape, after
    the p95's rules window: one or two there is no broken signal); with many counted, or
    with traffic and no count at all, it is missing."""
    observed = obs(ttft_p95_s=math.nan, ttft_samples=samples, interactive_requests=requests)
    decision = supervise(CFG, OPEN, observed, SLO, 4000.0, 1.0, 0.0)
    assert decision.mode == mode


@pytest.mark.parametrize(("burn_read", "mode"), [(True, Mode.OPEN), (False, Mode.FAILSAFE)],
                         ids=["burn-read", "no-burn"])
def test_an_empty_p95_whose_burn_is_read_is_not_missing(burn_read: bool, mode: Mode) -> None:
    """The first requests after a quiet spell: the p95's rules window (a scrape earlier) held
    no gap while the burn window counted many. With the burn read, the checks use it and the
    p95 is not missing; without it (no histogram share), the p95 is missing."""
    observed = obs(itl_p95_s=math.nan, itl_samples=40.0, interactive_requests=3.0)
    itl = reading(0.2, 0.1, 0.1) if burn_read else None
    decision = supervise(CFG, OPEN, observed, SLO, 4000.0, 1.0, 0.0, burns=(None, itl))
    assert decision.mode == mode


def reading(burn: float, lower: float, slow: float, batch_share: float = math.nan) -> BurnReading:
    """A burn reading with the given fast burn, its lower bound and the slow burn."""
    return BurnReading(burn=burn, lower=lower, upper=burn * 1.5, samples=500.0, window_s=10.0,
                       slow_burn=slow, slow_lower=slow * 0.8, slow_samples=3000.0,
                       batch_share=batch_share)


@pytest.mark.parametrize(
    ("itl", "mode", "revoke"),
    [
        (reading(4.0, 0.5, 0.2), Mode.OPEN, False),
        (reading(1.6, 1.1, 0.3), Mode.OPEN, False),
        (reading(1.6, 1.1, 0.6), Mode.OPEN, False),
        (reading(5.0, 3.5, 0.1, batch_share=0.9), Mode.CLOSED, True),
        (reading(5.0, 3.5, 0.1, batch_share=0.2), Mode.CLOSED, False),
    ],
    ids=[
        "one-slow-step-among-few-gaps-holds",
        "fast-burn-with-slow-window-unspent-holds",
        "fast-and-slow-windows-back-off-first-without-revoking",
        "severe-burn-caused-by-batch-revokes",
        "severe-burn-not-caused-by-batch-only-stops-admission",
    ],
)
def test_multiwindow_burn_cuts(itl: BurnReading, mode: Mode, revoke: bool) -> None:
    """A burn acts only with confidence in the fast window and spent slow window (or a
    severe fast burn): a mild one backs off first, a severe one closes and revokes in-flight
    batch only when batch caused it."""
    burns = (reading(0.0, 0.0, 0.0), itl)
    decision = supervise(CFG, OPEN, obs(), SLO, 8000.0, 1.0, 0.0, burns=burns)
    assert decision.mode == mode
    assert ("back-off" in decision.reason) == (itl.slow_burn == 0.6)
    assert decision.revoke == revoke


@pytest.mark.parametrize(
    ("over", "slo", "mode", "revoke"),
    [
        ({"itl_p95_s": math.nan, "itl_samples": 0.0, "interactive_requests": 3.0}, SLO,
         Mode.OPEN, False),
        ({"interactive_oldest_wait_s": 3.0}, Slo(ttft_p95_s=8.0), Mode.OPEN, False),
        ({"interactive_oldest_wait_s": 17.0, "interactive_wait_batch_frac": 0.1},
         Slo(ttft_p95_s=8.0), Mode.CLOSED, False),
        ({"interactive_oldest_wait_s": 40.0, "interactive_wait_batch_frac": 0.9},
         Slo(ttft_p95_s=8.0), Mode.CLOSED, True),
        ({"kv_usage_frac": 0.99}, SLO, Mode.CLOSED, True),
    ],
    ids=[
        "no-interactive-decode-is-safe-not-missing",
        "oldest-wait-limit-follows-the-ttft-slo",
        "long-wait-not-behind-batch-only-stops-admission",
        "severe-wait-behind-batch-revokes",
        "kv-about-to-run-out-revokes",
    ],
)
def test_thresholds_follow_the_slo_and_revoke_only_when_it_helps(
    over: dict, slo: Slo, mode: Mode, revoke: bool
) -> None:
    """Idle is safe, the oldest-wait cut is a multiple of the TTFT SLO, and revocation needs
    KV about to run out or a severe wait that batch caused."""
    decision = supervise(CFG, OPEN, obs(**over), slo, 8000.0, 1.0, 0.0)
    assert decision.mode == mode
    assert decision.revoke == revoke


def ttft_reading(over: float, samples: float) -> BurnReading:
    """A TTFT burn reading with `over` of `samples` first tokens above the SLO (fast and
    slow windows alike)."""
    burn = over / samples / 0.05
    return BurnReading(burn, burn, burn, samples, 10.0, burn, burn, samples)


@pytest.mark.parametrize(
    ("wait_s", "late", "ttft", "mode"),
    [
        (0.97, 1.0, ttft_reading(1.0, 106.0), Mode.OPEN),
        (0.97, 1.0, ttft_reading(0.0, 5.0), Mode.CLOSED),
        (0.97, 1.0, ttft_reading(7.0, 100.0), Mode.CLOSED),
        (0.97, 8.0, ttft_reading(1.0, 106.0), Mode.CLOSED),
        (1.10, 1.0, ttft_reading(1.0, 106.0), Mode.CLOSED),
        (0.97, math.nan, ttft_reading(1.0, 106.0), Mode.CLOSED),
        (0.97, 1.0, None, Mode.CLOSED),
    ],
    ids=[
        "one-straggler-among-many-on-time-first-tokens-holds",
        "a-waiter-among-few-first-tokens-cuts",
        "a-waiter-that-tips-the-ttft-burn-cuts",
        "a-queue-of-late-waiters-cuts",
        "a-severe-wait-cuts-alone",
        "late-waiters-not-exported-the-wait-alone-cuts",
        "no-burn-read-the-wait-alone-cuts",
    ],
)
def test_the_oldest_wait_cuts_as_late_first_tokens(
    wait_s: float, late: float, ttft: BurnReading | None, mode: Mode
) -> None:
    """Past its limit (2 x a 0.27 s TTFT SLO), the oldest wait cuts where counting every
    request waiting past the TTFT SLO as a late first token takes the TTFT burn to its cut,
    or where it passes twice the limit; one request in its own long prefill among a hundred
    on time does not (the `code` shape's cut at 512 s), eight late at once do (a stall)."""
    slo = Slo(ttft_p95_s=0.27, itl_p95_s=0.008)
    quiet_itl = BurnReading(0.0, 0.0, 0.0, 1500.0, 10.0, 0.0, 0.0, 1500.0)
    burns = (ttft, quiet_itl) if ttft is not None else (None, None)
    observed = obs(interactive_oldest_wait_s=wait_s, interactive_late_waiters=late,
                   ttft_p95_s=0.2, itl_p95_s=0.005)
    decision = supervise(CFG, OPEN, observed, slo, 8000.0, 1.0, 0.0, burns=burns)
    assert decision.mode == mode, decision.reason
    assert ("oldest wait" in decision.reason) == (mode == Mode.CLOSED)


def test_a_cold_start_publishes_a_budget_from_the_reopen_on_and_doubles():
    """From the initial state, a law that creeps up from the applied budget (as the velocity
    PI does) gets a budget above 0 on every tick from the reopen, doubling about every
    `ramp_doubling_s`, until the cap hands over to it."""
    cfg = SupervisorConfig(quiet_s=2.0, ramp_slew_tokens_per_s2=0.0, ramp_cap_tokens_per_s=64000.0,
                           ramp_min_tokens_per_s=1000.0, ramp_doubling_s=5.0)
    state, applied, budgets = SupervisorState(), 0.0, []
    for t in range(40):
        decision = supervise(cfg, state, obs(), SLO, applied + 10.0, 1.0, float(t))
        state, applied = decision.state, decision.u
        if decision.mode != Mode.CLOSED:
            budgets.append((decision.mode, decision.u))
    assert all(u > 0 for _, u in budgets)
    ramp = [u for mode, u in budgets if mode == Mode.RAMP]
    assert ramp[0] == 1000.0 and ramp[5] == pytest.approx(2000.0)
    assert len(ramp) == 30  # 1000 * 2 ** (t / 5) reaches 64000 after 30 ticks
    assert budgets[len(ramp)][0] == Mode.OPEN


def test_a_cut_keeps_half_the_budget_for_an_open_reopen():
    """A cut from open remembers ramp_start_frac of the law's budget and reopens open there,
    with no ramp in between (one mode change out, one back)."""
    cut = supervise(CFG, OPEN, obs(ttft_p95_s=1.2), SLO, 8000.0, 1.0, 0.0)
    assert cut.mode == Mode.CLOSED and cut.state.after_cut
    state, modes = cut.state, []
    for t in range(1, 13):
        decision = supervise(CFG, state, obs(), SLO, 0.0, 1.0, float(t))
        state = decision.state
        modes.append(decision.mode)
        if decision.mode != Mode.CLOSED:
            break
    assert modes == [Mode.CLOSED] * 10 + [Mode.OPEN]
    assert decision.u == pytest.approx(4000.0)


def test_the_ramp_stops_where_batch_stops_using_its_budget():
    """A ramp whose next step passes the validated ceiling hands over to the law there."""
    decision = supervise(CFG, RAMP, obs(), SLO, 2400.0, 1.0, 0.0, ceiling=2500.0)
    assert decision.mode == Mode.OPEN and decision.u == pytest.approx(2400.0)
    assert "what batch uses" in decision.reason


def test_a_mild_burn_backs_off_once_per_window_and_closes_if_it_burns_on():
    """A confident, not severe ITL burn halves the budget without a mode change, holds the
    law's budget for one burn window, and closes if it still burns right after."""
    mild = (reading(0.0, 0.0, 0.0), reading(burn=2.0, lower=1.5, slow=0.8))
    cfg = replace(CFG, ramp_start_frac=0.5)
    first = supervise(cfg, OPEN, obs(), SLO, 8000.0, 1.0, 0.0, burns=mild)
    assert first.mode == Mode.OPEN and first.u == pytest.approx(4000.0) and not first.events
    assert "back-off" in first.reason and not first.revoke
    held = supervise(cfg, first.state, obs(), SLO, 4100.0, 1.0, 5.0, burns=mild)
    assert held.mode == Mode.OPEN and held.u == pytest.approx(4100.0)
    after = supervise(cfg, held.state, obs(), SLO, 4100.0, 1.0, 12.0, burns=mild)
    assert after.mode == Mode.CLOSED and "ITL burn" in after.reason


@pytest.mark.parametrize(
    ("close_at_s", "reopen_tokens_per_s"),
    [(12.0, 4000.0), (40.0, 2050.0)],
    ids=["same-event-keeps-the-back-off-budget", "later-event-halves-the-law"],
)
def test_a_close_right_after_a_back_off_decreases_once(close_at_s: float,
                                                       reopen_tokens_per_s: float) -> None:
    """A pool that backs off (8000 -> 4000) and still burns right after closes, and reopens
    where the back-off put it (4000), not at half the law's already halved budget (TCP
    decreases once per round trip). A burn well after the back-off is a new event: the
    reopen point is half the law's budget then."""
    mild = (reading(0.0, 0.0, 0.0), reading(burn=2.0, lower=1.5, slow=0.8))
    cfg = replace(CFG, ramp_start_frac=0.5)
    first = supervise(cfg, OPEN, obs(), SLO, 8000.0, 1.0, 0.0, burns=mild)
    assert first.u == pytest.approx(4000.0) and first.mode == Mode.OPEN
    if close_at_s > 20.0:
        quiet = (reading(0.0, 0.0, 0.0), reading(0.0, 0.0, 0.0))
        first = supervise(cfg, first.state, obs(), SLO, 4100.0, 1.0, close_at_s - 1.0,
                          burns=quiet)
    severe = (reading(0.0, 0.0, 0.0), reading(burn=4.0, lower=3.5, slow=1.0))
    closed = supervise(cfg, first.state, obs(), SLO, 4100.0, 1.0, close_at_s, burns=severe)
    assert closed.mode == Mode.CLOSED and closed.u == 0.0
    assert closed.state.ramp_tokens_per_s == pytest.approx(reopen_tokens_per_s)


@pytest.mark.parametrize(
    ("observation", "burns"),
    [(obs(), (reading(0.0, 0.0, 0.0), reading(burn=4.0, lower=3.5, slow=1.0))),
     (obs(kv_usage_frac=0.99), (reading(0.0, 0.0, 0.0), reading(burn=2.0, lower=1.5, slow=0.8))),
     (obs(), (reading(0.0, 0.0, 0.0), reading(burn=2.0, lower=1.5, slow=1.2)))],
    ids=["severe-burn", "kv-limit", "slow-window-past-the-slo"],
)
def test_a_severe_burn_or_a_hard_limit_closes_at_once(observation, burns):
    """Severe burns, hard limits and a burn whose SLO window is already past the SLO never
    back off: they close."""
    decision = supervise(CFG, OPEN, observation, SLO, 8000.0, 1.0, 0.0, burns=burns)
    assert decision.mode == Mode.CLOSED and decision.u == 0.0


def _reading(window_s: float, slow_samples: float) -> BurnReading:
    return BurnReading(0.0, 0.0, 0.5, slow_samples, window_s, 0.0, 0.0, slow_samples)


def test_the_ramp_doubles_once_per_window_of_a_sparse_signal_near_its_slo() -> None:
    """A TTFT burn that needed 60 s to hold its samples, with a p95 near the SLO, paces the
    ramp to one doubling per 60 s; the same sparse signal far under its SLO (known from 5
    samples or more) leaves the configured doubling; so do dense signals."""
    dense = _reading(10.0, 3000.0)
    near = obs(ttft_p95_s=0.7)
    far = obs(ttft_p95_s=0.2)
    assert ramp_doubling_s(CFG, near, SLO, (_reading(60.0, 24.0), dense)) == 60.0
    assert ramp_doubling_s(CFG, far, SLO, (_reading(60.0, 24.0), dense)) == CFG.ramp_doubling_s
    assert ramp_doubling_s(CFG, far, SLO, (_reading(60.0, 3.0), dense)) == 60.0
    assert ramp_doubling_s(CFG, near, SLO, (_reading(8.0, 200.0), dense)) == CFG.ramp_doubling_s
    config = replace(CFG, ramp_cap_tokens_per_s=1e9)
    state = SupervisorState(mode=Mode.RAMP, ramp_tokens_per_s=2000.0)
    sparse = (_reading(60.0, 24.0), dense)
    paced = supervise(config, state, near, SLO, 1e6, 15.0, 0.0, burns=sparse)
    free = supervise(config, state, far, SLO, 1e6, 15.0, 0.0, burns=sparse)
    assert paced.mode == free.mode == Mode.RAMP
    assert paced.u == pytest.approx(2000.0 * 2 ** 0.25 + 1000.0 * 15.0 / 60.0 * 15.0)
    assert free.u == pytest.approx(2000.0 * 2 ** (15.0 / 15.0) + 1000.0 * 15.0)


ENGINE_RAMP = replace(CFG, ramp_doubling_engine_s=3.0, ramp_cap_tokens_per_s=1e9)
GUARDED = RampInputs(step_guarded=True)


def test_a_guarded_ramp_doubles_at_its_own_pace_whatever_the_windows() -> None:
    """Under engine enforcement with `ramp_doubling_engine_s` set, a sparse TTFT near its SLO
    (which paces an admission pool's ramp to one doubling a minute) leaves the doubling at
    3 s; unset (0), or on an admission pool, the windows pace it as before."""
    state = SupervisorState(mode=Mode.RAMP, ramp_tokens_per_s=2000.0)
    sparse = (_reading(60.0, 24.0), _reading(10.0, 3000.0))
    near = obs(ttft_p95_s=0.7)
    guarded = supervise(ENGINE_RAMP, state, near, SLO, 1e6, 3.0, 0.0, burns=sparse, ramp=GUARDED)
    assert guarded.mode == Mode.RAMP
    assert guarded.u == pytest.approx(2000.0 * 2.0 + 1000.0 * 15.0 / 3.0 * 3.0)
    for config, ramp in ((ENGINE_RAMP, RampInputs()), (replace(ENGINE_RAMP,
                         ramp_doubling_engine_s=0.0), GUARDED)):
        paced = supervise(config, state, near, SLO, 1e6, 3.0, 0.0, burns=sparse, ramp=ramp)
        assert paced.u == pytest.approx(2000.0 * 2 ** (3.0 / 60.0) + 1000.0 * 15.0 / 60.0 * 3.0)


def test_a_guarded_ramp_ends_on_the_feedback_not_on_the_forecast() -> None:
    """A proposal below the ramp only by the forecast's move keeps a guarded ramp going;
    the law's feedback below the ramp ends it, as it ends any ramp."""
    state = SupervisorState(mode=Mode.RAMP, ramp_tokens_per_s=2000.0)
    forecast = RampInputs(step_guarded=True, forecast_tokens_per_s=-100.0)
    kept = supervise(ENGINE_RAMP, state, obs(), SLO, 1950.0, 1.0, 0.0, ramp=forecast)
    assert kept.mode == Mode.RAMP and kept.u > 2000.0
    ended = supervise(ENGINE_RAMP, state, obs(), SLO, 1850.0, 1.0, 0.0, ramp=forecast)
    assert ended.mode == Mode.OPEN and ended.u == 1850.0
    unguarded = supervise(ENGINE_RAMP, state, obs(), SLO, 1950.0, 1.0, 0.0,
                          ramp=replace(forecast, step_guarded=False))
    assert unguarded.mode == Mode.OPEN and "law below the ramp" in unguarded.reason


def test_a_guarded_ramp_holds_where_batch_stops_using_its_budget() -> None:
    """A guarded ramp that reaches the validated ceiling holds there in ramp (batch is
    application-limited, RFC 7661) and doubles on once the ceiling rises."""
    state = SupervisorState(mode=Mode.RAMP, ramp_tokens_per_s=2000.0)
    held = supervise(ENGINE_RAMP, state, obs(), SLO, 1e6, 1.0, 0.0, ceiling=2500.0, ramp=GUARDED)
    assert held.mode == Mode.RAMP and held.u == 2500.0
    assert "held at what batch uses" in held.reason
    on = supervise(ENGINE_RAMP, held.state, obs(), SLO, 1e6, 1.0, 1.0, ceiling=1e6, ramp=GUARDED)
    assert on.mode == Mode.RAMP and on.u > 2500.0


def test_a_guarded_ramp_holds_through_a_stalled_ceiling_only_while_no_p95_is_near() -> None:
    """A guarded ramp above a validated ceiling that stalled (the carried rate is late in a
    cold start) reads the law capped at that ceiling as the ceiling, not as the law asking
    for less, while no output's p95 is known near its SLO: it holds in ramp. With a p95
    known near (enough slow-window samples, at least half its SLO) it hands over as before;
    so does an admission pool."""
    state = SupervisorState(mode=Mode.RAMP, ramp_tokens_per_s=2000.0)
    quiet = (reading(0.1, 0.05, 0.1), reading(0.1, 0.05, 0.1))
    far = obs(itl_p95_s=0.02)
    held = supervise(ENGINE_RAMP, state, far, SLO, 1900.0, 1.0, 0.0, burns=quiet,
                     ceiling=1900.0, ramp=GUARDED)
    assert held.mode == Mode.RAMP and held.u == 2000.0
    assert "held at what batch uses" in held.reason
    near = obs(itl_p95_s=0.03)
    ended = supervise(ENGINE_RAMP, state, near, SLO, 1900.0, 1.0, 0.0, burns=quiet,
                      ceiling=1900.0, ramp=GUARDED)
    assert ended.mode == Mode.OPEN and "law below the ramp" in ended.reason
    assert ended.u == 1900.0
    below = supervise(ENGINE_RAMP, state, far, SLO, 1800.0, 1.0, 0.0, burns=quiet,
                      ceiling=1900.0, ramp=GUARDED)
    assert below.mode == Mode.OPEN and "law below the ramp" in below.reason
    admission = supervise(ENGINE_RAMP, state, far, SLO, 1900.0, 1.0, 0.0, burns=quiet,
                          ceiling=1900.0)
    assert admission.mode == Mode.OPEN


def test_an_admission_ramp_holds_at_what_batch_uses_only_when_told() -> None:
    """An admission pool's ramp that reaches the validated ceiling hands over to the law,
    unless `ramp_hold_at_use`: then it holds there in ramp, as a guarded ramp does, and
    doubles on once batch uses more."""
    config = replace(CFG, ramp_cap_tokens_per_s=1e9, ramp_hold_at_use=False)
    state = SupervisorState(mode=Mode.RAMP, ramp_tokens_per_s=2000.0)
    handed = supervise(config, state, obs(), SLO, 1e6, 1.0, 0.0, ceiling=2500.0)
    assert handed.mode == Mode.OPEN and handed.u == 2500.0
    assert "reached what batch uses" in handed.reason
    holding = replace(config, ramp_hold_at_use=True)
    held = supervise(holding, state, obs(), SLO, 1e6, 1.0, 0.0, ceiling=2500.0)
    assert held.mode == Mode.RAMP and held.u == 2500.0
    assert "held at what batch uses" in held.reason
    on = supervise(holding, held.state, obs(), SLO, 1e6, 1.0, 1.0, ceiling=1e6)
    assert on.mode == Mode.RAMP and on.u > 2500.0
    ended = supervise(holding, held.state, obs(), SLO, 2400.0, 1.0, 2.0, ceiling=1e6)
    assert ended.mode == Mode.OPEN and "law below the ramp" in ended.reason
