"""Use validation: the budget does not grow while batch does not use what it has."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from borrowd.controller.laws.history import AppliedHistory
from borrowd.controller.policy import ControllerConfig, build_policy
from borrowd.models.budget import Mode
from borrowd.models.signals import Observation


def quiet(now_s: float, carried_tokens_per_s: float,
          batch_seqs: float = float("nan")) -> Observation:
    """A healthy pool with nothing above the SLOs and `carried_tokens_per_s` of batch carried
    by `batch_seqs` sequences in flight."""
    return Observation(
        now_s=now_s, age_s=0.5, ttft_p95_s=0.2, itl_p95_s=0.01, success_rate=1.0,
        kv_usage_frac=0.3, interactive_queue_depth=0.0, interactive_oldest_wait_s=0.0,
        interactive_tokens_per_s=2000.0, interactive_requests=20.0, batch_tokens_per_s=
        carried_tokens_per_s, itl_over_slo_frac=0.0, ttft_over_slo_frac=0.0, window_s=5.0,
        itl_samples=2000.0, ttft_samples=20.0, batch_running_seqs=batch_seqs,
    )


def test_no_batch_demand_keeps_the_budget_at_the_floor() -> None:
    """Without batch work the budget stays at the validation floor instead of winding up."""
    config = ControllerConfig()
    policy = build_policy(config, "p", None)
    budgets = [policy.step(quiet(float(t), 0.0), float(t)).budget for t in range(300)]
    floor = config.validation.floor_frac * config.u_max_tokens_per_s
    assert budgets[-1].mode == Mode.OPEN
    assert max(b.batch_tokens_per_s for b in budgets) <= floor + 1e-6


def test_budget_grows_from_what_is_carried() -> None:
    """When batch carries what it is given, the budget grows past the floor, never more than
    the headroom above the carried peak."""
    config = ControllerConfig()
    policy = build_policy(config, "p", None)
    u = 0.0
    for t in range(300):
        budget = policy.step(quiet(float(t), u), float(t)).budget
        assert budget.batch_tokens_per_s <= max(
            config.validation.floor_frac * config.u_max_tokens_per_s,
            (1 + config.validation.headroom) * u,
        ) + 1e-6
        u = budget.batch_tokens_per_s
    assert u > 2 * config.validation.floor_frac * config.u_max_tokens_per_s
    assert u == pytest.approx(config.u_max_tokens_per_s, rel=0.01)


def test_batch_held_by_its_sequence_cap_is_not_application_limited() -> None:
    """Long-decoding batch carries 130 tokens/s per sequence, far below the cap's 2000: each
    sequence the cap allows is in flight, so the budget is used, and it grows (with the cap
    that follows it) instead of holding the cap and the ceiling at the floor together."""
    config = ControllerConfig()
    policy = build_policy(config, "p", None)
    per_seq_tokens_per_s = 130.0
    seqs = 0
    for t in range(300):
        budget = policy.step(quiet(float(t), seqs * per_seq_tokens_per_s, float(seqs)),
                             float(t)).budget
        seqs = budget.max_batch_seqs  # the client fills every sequence the cap allows
    assert seqs == config.caps.max_seqs


def test_batch_below_its_sequence_cap_is_application_limited() -> None:
    """The same slow batch with fewer sequences in flight than the cap keeps the budget at
    the floor: it is not using what it has."""
    config = ControllerConfig()
    policy = build_policy(config, "p", None)
    floor = config.validation.floor_frac * config.u_max_tokens_per_s
    for t in range(300):
        budget = policy.step(quiet(float(t), 2 * 130.0, 2.0), float(t)).budget
        assert budget.batch_tokens_per_s <= floor + 1e-6


def lagged_run(demand_tokens_per_s: float, seconds: int = 200, lag_s: int = 8,
               itl_p95_s: float = 0.01) -> list[tuple[float, float, float]]:
    """(budget, carried, ceiling) per tick of a pool whose batch carries what the budget
    applied `lag_s` ago allowed, up to `demand_tokens_per_s`, read 3 s late over a 5 s
    window (as the rules read the proxy's counters), at a p95 ITL of `itl_p95_s`."""
    policy = build_policy(ControllerConfig(), "p", None)
    applied: list[float] = []
    out = []
    for t in range(seconds):
        carried = min(demand_tokens_per_s, applied[t - lag_s]) if t >= lag_s else 0.0
        obs = replace(quiet(float(t), carried), age_s=3.0, window_s=5.0, itl_p95_s=itl_p95_s)
        budget = policy.step(obs, float(t)).budget.batch_tokens_per_s
        applied.append(budget)
        out.append((budget, carried, policy.state()["validated_ceiling_tokens_per_s"]))
    return out


def test_a_budget_batch_fills_is_judged_by_the_budget_that_carried_it() -> None:
    """Batch that uses all it is given, measured 8 s late, is not application-limited: the
    budget outruns 1.5x the late carried rate (which would hold a climb to ln 1.5 per lag)
    and reaches u_max within two minutes."""
    config = ControllerConfig()
    run = lagged_run(math.inf)
    assert any(budget > (1 + config.validation.headroom) * carried + 1000
               for budget, carried, _ in run[20:])
    assert run[120][0] == pytest.approx(config.u_max_tokens_per_s)


def test_batch_that_stops_using_a_rising_budget_holds_it_at_the_headroom() -> None:
    """Batch that wants 20k tokens/s holds the budget at 1.5x that once the late reading
    catches up with the climb (an overshoot of one lag's rise on the way), not in a cycle
    of climbs on readings of its own past budgets."""
    run = lagged_run(20_000.0)
    assert max(budget for budget, _, _ in run) < 2 * 30_000.0
    assert all(budget == pytest.approx(30_000.0) for budget, _, _ in run[60:])


def test_near_its_slo_the_budget_grows_only_from_what_was_carried() -> None:
    """With the p95 ITL at 0.6x its SLO there is no room known to run into: the same late
    reading holds the budget to the headroom over the carried peak, as before."""
    config = ControllerConfig()
    run = lagged_run(math.inf, itl_p95_s=0.6 * config.slo_itl_p95_s)
    grow = 1 + config.validation.headroom
    floor = config.validation.floor_frac * config.u_max_tokens_per_s
    window = int(config.validation.window_s)
    for t, (budget, _, _) in enumerate(run):
        peak = max((carried for _, carried, _ in run[max(0, t - window + 1):t + 1]), default=0.0)
        assert budget <= max(floor, grow * peak) + 1e-6


def test_the_budget_in_force_when_a_span_begins_is_read_as_applied_over_it() -> None:
    """A reading's span that begins between two budget changes was carried partly under the
    budget in force at its start: the least budget over the span counts it, as the time-
    weighted mean does; an empty history reads 0, a span after the last change its budget."""
    history = AppliedHistory()
    assert history.least_since(0.0) == 0.0
    history.record(0.0, 10_000.0)
    history.record(10.0, 40_000.0)
    history.record(20.0, 30_000.0)
    assert history.least_since(5.0) == 10_000.0
    assert history.least_since(15.0) == 30_000.0
    assert history.least_since(25.0) == 30_000.0
    assert history.mean(5.0, 15.0) == pytest.approx(25_000.0)
