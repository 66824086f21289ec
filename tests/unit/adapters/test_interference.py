"""Interference counting: gaps and wait by whether the step carried batch tokens."""

from __future__ import annotations

import pytest
from borrowd.adapters.interference import (
    ITL_METRIC,
    WAIT_METRIC,
    InterferenceMetrics,
    StepAttribution,
    StepRequest,
)
from borrowd.models.enforcement import MAX_STEP_S
from prometheus_client import CollectorRegistry


def _value(registry: CollectorRegistry, name: str, batch_step: str) -> float:
    value = registry.get_sample_value(name, {"model_name": "m", "engine": "0",
                                             "batch_step": batch_step})
    assert value is not None, name
    return value


@pytest.fixture
def registry() -> CollectorRegistry:
    """A fresh registry per test."""
    return CollectorRegistry()


def test_both_children_exist_before_any_step(registry: CollectorRegistry) -> None:
    """A fresh engine exports zeros for both labels, so the share reads 0, not missing."""
    InterferenceMetrics(registry, "m", "0")
    for flag in ("true", "false"):
        assert _value(registry, ITL_METRIC + "_count", flag) == 0
        assert _value(registry, WAIT_METRIC + "_total", flag) == 0


@pytest.mark.parametrize("carried_batch,flag,other", [(True, "true", "false"),
                                                      (False, "false", "true")],
                         ids=["batch-step", "clean-step"])
def test_step_counts_under_its_own_label(registry: CollectorRegistry, carried_batch: bool,
                                         flag: str, other: str) -> None:
    """A step's gaps and its waiting requests x step time go to the step's label only."""
    metrics = InterferenceMetrics(registry, "m", "0")
    metrics.step(carried_batch=carried_batch, itl_gaps_s=[0.02, 0.08],
                 interactive_waiting=3, step_s=0.5)
    assert _value(registry, ITL_METRIC + "_count", flag) == 2
    for le, below in (("0.01", 0), ("0.05", 1), ("0.1", 2)):
        assert registry.get_sample_value(ITL_METRIC + "_bucket", {
            "model_name": "m", "engine": "0", "batch_step": flag, "le": le}) == below
    assert _value(registry, WAIT_METRIC + "_total", flag) == pytest.approx(1.5)
    assert _value(registry, ITL_METRIC + "_count", other) == 0
    assert _value(registry, WAIT_METRIC + "_total", other) == 0


def test_attribution_gaps_run_from_the_previous_token(registry: CollectorRegistry) -> None:
    """Gaps are measured token to token per request; a batch request marks the step; a
    request that left is forgotten; the first step counts the given step time."""
    metrics = InterferenceMetrics(registry, "m", "0")
    attribution = StepAttribution(metrics, first_step_s=0.03)
    first = [StepRequest("i0", False, True, False), StepRequest("i1", False, False, True)]
    attribution.finished(1.0, first, interactive_queued=1, live={"i0", "i1"})
    assert _value(registry, WAIT_METRIC + "_total", "false") == pytest.approx(2 * 0.03)
    second = [StepRequest("i0", False, True, False), StepRequest("i1", False, True, False),
              StepRequest("b0", True, False, True)]
    attribution.finished(1.25, second, interactive_queued=0, live={"i0", "i1", "b0"})
    assert _value(registry, ITL_METRIC + "_count", "true") == 1  # i1's first token: no gap
    assert _value(registry, ITL_METRIC + "_sum", "true") == pytest.approx(0.25)
    attribution.finished(1.5, [StepRequest("i0", False, True, False)], 0, live={"i0"})
    assert _value(registry, ITL_METRIC + "_sum", "false") == pytest.approx(0.25)
    attribution.finished(9.0, [StepRequest("i1", False, True, False)], 2, live={"i1"})
    # i1 was forgotten when it left `live`: its return opens no gap; the stall is capped.
    assert _value(registry, ITL_METRIC + "_count", "false") == 1
    assert _value(registry, WAIT_METRIC + "_total", "false") == pytest.approx(
        2 * 0.03 + 2 * MAX_STEP_S)
