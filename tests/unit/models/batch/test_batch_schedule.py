"""Weighted fair share (start-time fair queuing) and EDF ordering."""

from __future__ import annotations

from collections import Counter

import pytest
from borrowd.models.batch.schedule import FairState, JobRef, charge, edf_order, pick_tenant
from borrowd.models.errors import ConfigError


def _run(weights: dict[str, float], dispatches: int, backlogged=None) -> Counter:
    state = FairState({})
    served: Counter = Counter()
    for step in range(dispatches):
        active = backlogged(step) if backlogged else weights
        tenant = pick_tenant(state, active)
        assert tenant is not None
        state = charge(state, tenant, 100, weights[tenant])
        served[tenant] += 100
    return served


@pytest.mark.parametrize(
    ("weights", "want"),
    [({"a": 2, "b": 1}, {"a": 2 / 3, "b": 1 / 3}),
     ({"a": 1, "b": 1, "c": 2}, {"a": 0.25, "b": 0.25, "c": 0.5})],
    ids=["2:1", "1:1:2"],
)
def test_backlogged_tenants_split_by_weight(weights: dict, want: dict) -> None:
    """Under contention, dispatched tokens split by weight (within one dispatch)."""
    served = _run(weights, 300)
    total = sum(served.values())
    for tenant, share in want.items():
        assert abs(served[tenant] - share * total) <= 100


def test_idle_tenant_share_goes_to_others_and_banks_no_credit() -> None:
    """While b is idle a gets everything; when b returns it does not catch up on a."""
    weights = {"a": 1.0, "b": 1.0}
    served = _run(weights, 200, lambda step: ["a"] if step < 100 else ["a", "b"])
    assert served["a"] == 100 * 100 + 50 * 100
    assert served["b"] == 50 * 100


def test_pick_of_nothing_and_bad_weight() -> None:
    """No backlogged tenant: None; a weight <= 0 is a configuration error."""
    assert pick_tenant(FairState({}), []) is None
    with pytest.raises(ConfigError):
        charge(FairState({}), "a", 1, 0)


def test_edf_orders_by_deadline_then_age() -> None:
    """Earliest deadline first; equal deadlines run oldest first."""
    jobs = [JobRef("late", 300, 1), JobRef("young", 100, 5), JobRef("old", 100, 2)]
    assert [j.job_id for j in edf_order(jobs)] == ["old", "young", "late"]
