"""Carried rate, projected lateness and GPU cost per item."""

from __future__ import annotations

import math

import pytest
from borrowd.models.batch.figures import (
    CostModel,
    carried_rate_per_s,
    fair_share_error,
    per_hour,
    project_lateness,
    verdict_grace_s,
)
from borrowd.models.batch.openai_format import Status, can_move, completion_window_s
from borrowd.models.errors import InputError


def test_carried_rate_uses_the_recent_window() -> None:
    """Only samples inside the window count; under a second of span gives None."""
    samples = [(0.0, 0), (50.0, 10), (60.0, 30), (70.0, 50)]
    assert carried_rate_per_s(samples, 70.0, 20.0) == pytest.approx(2.0)
    assert carried_rate_per_s([(0.0, 0), (0.5, 3)], 0.5, 60.0) is None


@pytest.mark.parametrize(
    ("remaining", "rate", "lateness", "at_risk"),
    [(100, 1.0, -900.0, False), (100, 0.05, 1000.0, True), (0, None, -1000.0, False),
     (10, 0.0, math.inf, True), (10, None, None, False)],
    ids=["on-time", "late", "done", "stalled", "no-rate-yet"],
)
def test_projected_lateness(remaining: int, rate: float | None, lateness: float | None,
                            at_risk: bool) -> None:
    """Lateness = now + remaining / rate - deadline; at risk when positive."""
    got = project_lateness(0.0, 1000.0, remaining, rate)
    assert got.lateness_s == lateness
    assert got.at_risk is at_risk


@pytest.mark.parametrize(
    ("now_s", "running_s", "rate", "at_risk"),
    [(10.0, 10.0, 0.0, False), (10.0, 10.0, 0.05, False), (60.0, 60.0, 0.0, True),
     (60.0, 60.0, 0.05, True), (1001.0, 5.0, 0.0, True)],
    ids=["stalled-in-grace", "late-in-grace", "stalled-after", "late-after",
         "past-deadline"],
)
def test_no_verdict_before_the_grace(now_s: float, running_s: float, rate: float,
                                     at_risk: bool) -> None:
    """A job's first seconds carry little or nothing: no at-risk verdict until it has run
    the grace (a rate window, or a quarter of its window), unless the deadline passed."""
    grace_s = verdict_grace_s(60.0, 1000.0)
    assert grace_s == 60.0 and verdict_grace_s(60.0, 4.0) == 1.0
    got = project_lateness(now_s, 1000.0, 100, rate, running_s, grace_s)
    assert got.at_risk is at_risk


def test_fair_share_error_counts_only_contended_intervals() -> None:
    """Measured / entitled - 1 per tenant, over intervals where two or more contended."""
    weights = {"a": 2.0, "b": 1.0, "c": 1.0}
    intervals = [({"a": 200.0, "b": 100.0}, {"a", "b"}),
                 ({"a": 300.0, "b": 100.0, "c": 100.0}, {"a", "b", "c"}),
                 ({"c": 999.0}, {"c"})]
    errors = fair_share_error(intervals, weights)
    assert errors["a"] == pytest.approx((200 + 300) / (200 + 250) - 1)
    assert errors["b"] == pytest.approx((100 + 100) / (100 + 125) - 1)
    assert errors["c"] == pytest.approx(100 / 125 - 1)


def test_cost_per_item_counts_every_processed_token() -> None:
    """GPU time from prefill and decode rates, priced per GPU-hour, shared by items."""
    model = CostModel(price_per_gpu_hour=3.6, prefill_tokens_per_gpu_s=1000.0,
                      decode_tokens_per_gpu_s=100.0)
    assert model.gpu_s(2000, 300) == pytest.approx(5.0)
    assert model.cost_per_item(2000, 300, 5) == pytest.approx(0.001)
    assert model.cost_per_item(2000, 300, 0) is None
    assert per_hour(10, 1800.0) == 20.0


def test_status_transitions_and_windows() -> None:
    """OpenAI's lifecycle; completion windows in s, m, h or d."""
    assert can_move(Status.IN_PROGRESS, Status.FINALIZING)
    assert not can_move(Status.COMPLETED, Status.CANCELLING)
    assert not can_move(Status.FINALIZING, Status.CANCELLING)
    assert completion_window_s("24h") == 86400
    assert completion_window_s("90s") == 90
    with pytest.raises(InputError):
        completion_window_s("soon")
