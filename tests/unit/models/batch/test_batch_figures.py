"""Carried rate, projected lateness and GPU cost per item."""

from __future__ import annotations

import math

import pytest
from borrowd.models.batch.figures import CostModel, carried_rate_per_s, per_hour, project_lateness
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
