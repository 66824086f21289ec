"""Use validation: the budget does not grow while batch does not use what it has."""

from __future__ import annotations

import pytest
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
