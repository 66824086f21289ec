"""Rolling borrowing out in measured steps: how long each step must hold, the step schedule,
the verdict on a step against the interactive-only baseline, and the ceiling a pool's budget
is clamped to.

Samples for a quantile: the q-quantile of n samples sits at rank n*q, and the count of
samples above it is binomial with mean n(1-q) and deviation sqrt(n q (1-q)). Knowing that
tail count to within a relative error e at confidence z needs

    n >= z^2 * q / (e^2 * (1 - q))

(p95 at e = 0.2, z = 1.96: 1825 samples; p99: 9508). A step holds until the slowest-sampled
signal (first tokens for TTFT, token gaps for ITL) has that many at the current rate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import pairwise

from borrowd.models.budget import Budget, Mode, closed_budget
from borrowd.models.errors import InputError
from borrowd.models.signals import Slo

Z_95 = 1.959964


def samples_for_quantile(q: float, tail_error: float, z: float = Z_95) -> int:
    """Samples needed so the count above the q-quantile is known within `tail_error`."""
    if not 0 < q < 1:
        raise InputError(f"quantile must be in (0, 1), got {q}")
    if not tail_error > 0:
        raise InputError(f"tail error must be > 0, got {tail_error}")
    return math.ceil(z * z * q / (tail_error * tail_error * (1 - q)))


@dataclass(frozen=True)
class HoldPlan:
    """How long a step holds, and why."""

    needed_samples: int
    ttft_samples_per_s: float
    itl_samples_per_s: float
    needed_s: float
    hold_s: float
    capped: bool


def plan_hold(quantiles: Sequence[float], tail_error: float, ttft_samples_per_s: float,
              itl_samples_per_s: float, min_hold_s: float, max_hold_s: float) -> HoldPlan:
    """Hold for the highest quantile's samples at the slower of the two sample rates, within
    [min_hold_s, max_hold_s] (`capped` when the cap cut it short; no rate: capped)."""
    needed = max(samples_for_quantile(q, tail_error) for q in quantiles)
    slowest = min(ttft_samples_per_s, itl_samples_per_s)
    needed_s = needed / slowest if slowest > 0 and math.isfinite(slowest) else math.inf
    hold_s = min(max(needed_s, min_hold_s), max_hold_s)
    return HoldPlan(needed, ttft_samples_per_s, itl_samples_per_s, needed_s, hold_s,
                    capped=needed_s > max_hold_s)


def step_schedule(first_tokens_per_s: float, growth: float,
                  max_tokens_per_s: float) -> tuple[float, ...]:
    """first, first*growth, ... while <= max, and max itself last."""
    if not (first_tokens_per_s > 0 and growth > 1 and max_tokens_per_s >= first_tokens_per_s):
        raise InputError("step schedule needs first > 0, growth > 1 and max >= first, got "
                         f"{first_tokens_per_s}, {growth}, {max_tokens_per_s}")
    steps = []
    value = first_tokens_per_s
    while value < max_tokens_per_s:
        steps.append(value)
        value *= growth
    steps.append(max_tokens_per_s)
    return tuple(steps)


def check_steps(steps: Sequence[float]) -> tuple[float, ...]:
    """`steps` if every one is finite, > 0, and they strictly increase; else InputError."""
    if not steps:
        raise InputError("no rollout step given")
    for value in steps:
        if not (math.isfinite(value) and value > 0):
            raise InputError(f"a rollout step must be > 0 tokens/s, got {value}")
    if any(b <= a for a, b in pairwise(steps)):
        raise InputError(f"rollout steps must increase, got {list(steps)}")
    return tuple(steps)


@dataclass(frozen=True)
class StepFigures:
    """Interactive figures over one hold, with what was watched beside them."""

    ttft_p95_s: float
    ttft_p99_s: float
    itl_p95_s: float
    itl_p99_s: float
    success_frac: float
    ttft_samples: float
    itl_samples: float
    kv_usage_max_frac: float
    preemptions: float
    oldest_wait_max_s: float
    batch_tokens_per_s: float


@dataclass(frozen=True)
class Tolerance:
    """How far above the baseline a step may move each figure (0.25 = 25 % above)."""

    p95: float = 0.25
    p99: float = 1.0


def burns(step: StepFigures, baseline: StepFigures, slo: Slo,
          tolerance: Tolerance) -> tuple[str, ...]:
    """The figures of `step` that burn: a p95 past its SLO, success under its SLO, or a p95
    (p99) more than `tolerance` above the baseline's. Empty when the step is good."""
    out = []
    for name, value, limit in (("ttft_p95_s", step.ttft_p95_s, slo.ttft_p95_s),
                               ("itl_p95_s", step.itl_p95_s, slo.itl_p95_s)):
        if value > limit:
            out.append(f"{name} {value:.4g} > SLO {limit:g}")
    if step.success_frac < slo.success_rate:
        out.append(f"success {step.success_frac:.4g} < SLO {slo.success_rate:g}")
    for name, allowed in (("ttft_p95_s", tolerance.p95), ("itl_p95_s", tolerance.p95),
                          ("ttft_p99_s", tolerance.p99), ("itl_p99_s", tolerance.p99)):
        value, base = getattr(step, name), getattr(baseline, name)
        if math.isfinite(base) and base > 0 and value > base * (1 + allowed):
            out.append(f"{name} {value:.4g} > baseline {base:.4g} x {1 + allowed:g}")
    return tuple(out)


def apply_ceiling(budget: Budget, ceiling_tokens_per_s: float | None) -> Budget:
    """`budget` held under the rollout ceiling: the rate clamped to it and the sequence cap
    scaled alike (at least 1); a ceiling of 0 closes batch (its work in flight is revoked,
    also when the controller already saw the ceiling and decided a zero rate). None (no
    ceiling set) leaves the budget as it is."""
    if ceiling_tokens_per_s is None:
        return budget
    if ceiling_tokens_per_s <= 0:
        if budget.batch_tokens_per_s <= 0 and budget.max_batch_seqs <= 0:
            return budget
        return closed_budget(budget.pool, Mode.CLOSED, f"rollout ceiling 0; {budget.reason}")
    if budget.batch_tokens_per_s <= ceiling_tokens_per_s:
        return budget
    ratio = ceiling_tokens_per_s / budget.batch_tokens_per_s
    return replace(
        budget,
        batch_tokens_per_s=ceiling_tokens_per_s,
        max_batch_seqs=max(1, math.ceil(budget.max_batch_seqs * ratio)),
        reason=f"{budget.reason}; rollout ceiling {ceiling_tokens_per_s:g}",
    )


def parse_ceiling(text: str | None) -> float | None:
    """A stored ceiling in tokens/s, None when unset; a malformed one (not a finite decimal
    >= 0) reads as 0, closing batch, as a malformed budget record does."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        return 0.0
    return value if math.isfinite(value) and value >= 0 else 0.0
