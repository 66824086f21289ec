"""Rollout steps: samples a quantile needs, hold plans, schedules, verdicts, the ceiling."""

from __future__ import annotations

import math

import pytest
from borrowd.models.budget import Budget, Mode
from borrowd.models.errors import InputError
from borrowd.models.rollout import (
    StepFigures,
    Tolerance,
    apply_ceiling,
    burns,
    check_steps,
    parse_ceiling,
    plan_hold,
    samples_for_quantile,
    step_schedule,
)
from borrowd.models.signals import Slo

OPEN = Budget(pool="chat", mode=Mode.OPEN, reason="quiet", batch_tokens_per_s=8000.0,
              batch_burst_tokens=33792, max_batch_seqs=8, max_batch_kv_tokens=80000,
              max_batch_output_tokens=512)


@pytest.mark.parametrize(("q", "tail_error", "samples"), [
    (0.95, 0.2, 1825), (0.99, 0.2, 9508), (0.95, 0.5, 292), (0.5, 0.1, 385),
], ids=["p95", "p99", "p95-loose", "median"])
def test_samples_for_quantile(q: float, tail_error: float, samples: int) -> None:
    """n = z^2 q / (e^2 (1 - q)): the tail count above the quantile known within e."""
    assert samples_for_quantile(q, tail_error) == samples


@pytest.mark.parametrize(("q", "tail_error"), [(1.0, 0.2), (0.0, 0.2), (0.95, 0.0)])
def test_samples_for_quantile_refuses_nonsense(q: float, tail_error: float) -> None:
    """A quantile outside (0, 1) or a zero error is an input error."""
    with pytest.raises(InputError):
        samples_for_quantile(q, tail_error)


def test_plan_hold_waits_for_the_slowest_sampled_signal() -> None:
    """First tokens come far slower than gaps: they set the hold, within its bounds."""
    plan = plan_hold((0.95, 0.99), 0.2, ttft_samples_per_s=50.0, itl_samples_per_s=2000.0,
                     min_hold_s=30.0, max_hold_s=600.0)
    assert plan.needed_samples == 9508
    assert plan.needed_s == pytest.approx(9508 / 50.0)
    assert plan.hold_s == pytest.approx(9508 / 50.0) and not plan.capped
    capped = plan_hold((0.99,), 0.2, 5.0, 100.0, min_hold_s=10.0, max_hold_s=60.0)
    assert capped.hold_s == 60.0 and capped.capped
    idle = plan_hold((0.95,), 0.2, 0.0, 0.0, min_hold_s=10.0, max_hold_s=60.0)
    assert idle.hold_s == 60.0 and idle.capped and math.isinf(idle.needed_s)


def test_step_schedule_grows_to_the_maximum() -> None:
    """Geometric steps, ending exactly at the maximum."""
    assert step_schedule(1000, 2, 7000) == (1000, 2000, 4000, 7000)
    assert step_schedule(1000, 2, 1000) == (1000,)


@pytest.mark.parametrize("steps", [[], [0, 1000], [2000, 1000], [1000, math.inf]],
                         ids=["none", "zero", "decreasing", "inf"])
def test_check_steps_refuses_bad_schedules(steps: list[float]) -> None:
    """Steps must be positive, finite and increasing."""
    with pytest.raises(InputError):
        check_steps(steps)


def figures(ttft_p95: float = 0.3, itl_p95: float = 0.02, ttft_p99: float = 0.5,
            itl_p99: float = 0.04, success: float = 1.0) -> StepFigures:
    return StepFigures(ttft_p95_s=ttft_p95, ttft_p99_s=ttft_p99, itl_p95_s=itl_p95,
                       itl_p99_s=itl_p99, success_frac=success, ttft_samples=1000,
                       itl_samples=20000, kv_usage_max_frac=0.5, preemptions=0,
                       oldest_wait_max_s=0.1, batch_tokens_per_s=1000)


@pytest.mark.parametrize(("step", "burning"), [
    (figures(), ()),
    (figures(ttft_p95=1.2), ("ttft_p95_s 1.2 > SLO 1", "ttft_p95_s 1.2 > baseline 0.3 x 1.25")),
    (figures(itl_p95=0.024), ()),
    (figures(itl_p95=0.026), ("itl_p95_s 0.026 > baseline 0.02 x 1.25",)),
    (figures(itl_p99=0.09), ("itl_p99_s 0.09 > baseline 0.04 x 2",)),
    (figures(success=0.98), ("success 0.98 < SLO 0.99",)),
], ids=["good", "ttft-slo", "within-tolerance", "itl-baseline", "p99-baseline", "success"])
def test_burns(step: StepFigures, burning: tuple[str, ...]) -> None:
    """A step burns on an SLO or on moving a p95 / p99 past the baseline's tolerance."""
    assert burns(step, figures(), Slo(), Tolerance(p95=0.25, p99=1.0)) == burning


def test_apply_ceiling() -> None:
    """Rate clamped and sequence cap scaled; 0 closes; None or a higher ceiling is a no-op."""
    held = apply_ceiling(OPEN, 2000.0)
    assert held.batch_tokens_per_s == 2000.0 and held.max_batch_seqs == 2
    assert held.mode is Mode.OPEN and "rollout ceiling 2000" in held.reason
    assert held.max_batch_kv_tokens == OPEN.max_batch_kv_tokens
    closed = apply_ceiling(OPEN, 0.0)
    assert closed.mode is Mode.CLOSED and closed.max_batch_seqs == 0
    assert apply_ceiling(OPEN, None) is OPEN
    assert apply_ceiling(OPEN, 9000.0) is OPEN


@pytest.mark.parametrize(("text", "value"), [
    (None, None), ("4000", 4000.0), ("0", 0.0), ("junk", 0.0), ("-5", 0.0), ("nan", 0.0),
], ids=["unset", "set", "zero", "junk", "negative", "nan"])
def test_parse_ceiling(text: str | None, value: float | None) -> None:
    """Unset is no ceiling; anything malformed closes batch, as a malformed record does."""
    assert parse_ceiling(text) == value
