"""The figures that judge borrowing from the batch owner's side: rate, lateness, cost.

- Carried rate: items completed per second over a recent window of (time, completed)
  samples.
- Projected lateness = now + remaining_items / carried_rate - deadline (> 0: late); a
  verdict (at risk) once the job has run min(rate window, completion window / 4).
- GPU time batch occupied = prompt_tokens / prefill_tokens_per_gpu_s
  + generated_tokens / decode_tokens_per_gpu_s, counting every token the engines processed
  for batch (resumed prefills and redone output included, so waste costs money);
  cost per completed item = price_per_gpu_hour * gpu_hours / completed items.
- Fair-share error of tenant t over the intervals when at least two tenants contended:
  measured_t / expected_t - 1, where expected_t sums, per interval, the contending
  tenants' tokens x w_t / (sum of the contending weights).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass


def carried_rate_per_s(samples: Sequence[tuple[float, int]], now_s: float,
                       window_s: float) -> float | None:
    """Completions per second over the last `window_s` of (time_s, cumulative) samples;
    None while the samples span less than a second."""
    recent = [s for s in samples if s[0] >= now_s - window_s]
    if len(recent) < 2:
        return None
    span_s = recent[-1][0] - recent[0][0]
    if span_s < 1.0:
        return None
    return max(0.0, (recent[-1][1] - recent[0][1]) / span_s)


@dataclass(frozen=True)
class Lateness:
    """Projection of when a job finishes against its deadline (epoch seconds)."""

    projected_finish_s: float | None
    lateness_s: float | None
    at_risk: bool


def project_lateness(now_s: float, deadline_s: float, remaining_items: int,
                     rate_per_s: float | None, running_s: float = math.inf,
                     grace_s: float = 0.0) -> Lateness:
    """Projected finish and lateness at the carried rate; at risk when it lands after the
    deadline (or nothing is carried while work remains), once the job has run `grace_s`
    (its first items are still running before that: little or nothing is carried yet), or
    when the deadline has passed."""
    if remaining_items <= 0:
        return Lateness(now_s, min(0.0, now_s - deadline_s), False)
    judged = running_s >= grace_s or now_s > deadline_s
    if rate_per_s is None:
        return Lateness(None, None, now_s > deadline_s)
    if rate_per_s <= 0:
        return Lateness(None, math.inf, judged)
    finish_s = now_s + remaining_items / rate_per_s
    return Lateness(finish_s, finish_s - deadline_s, judged and finish_s > deadline_s)


def verdict_grace_s(rate_window_s: float, completion_window_s: float) -> float:
    """How long a job runs before its projection can put it at risk: one rate window, or a
    quarter of its completion window when that is shorter."""
    return min(rate_window_s, completion_window_s / 4)


@dataclass(frozen=True)
class CostModel:
    """Price of a GPU-hour and the token rates one GPU sustains for batch work."""

    price_per_gpu_hour: float
    prefill_tokens_per_gpu_s: float
    decode_tokens_per_gpu_s: float

    def gpu_s(self, prompt_tokens: int, generated_tokens: int) -> float:
        """GPU seconds occupied by that many prompt (prefilled) and generated tokens."""
        return (prompt_tokens / self.prefill_tokens_per_gpu_s
                + generated_tokens / self.decode_tokens_per_gpu_s)

    def cost_per_item(self, prompt_tokens: int, generated_tokens: int,
                      completed_items: int) -> float | None:
        """Money per completed item (None before the first completes)."""
        return cost_per_item(self.price_per_gpu_hour,
                             self.gpu_s(prompt_tokens, generated_tokens), completed_items)


def cost_per_item(price_per_gpu_hour: float, gpu_s: float,
                  completed_items: int) -> float | None:
    """price_per_gpu_hour * gpu_s / 3600 / completed_items (None before the first)."""
    if completed_items <= 0:
        return None
    return price_per_gpu_hour * gpu_s / 3600.0 / completed_items


def per_hour(count: int, elapsed_s: float) -> float:
    """A count as a rate per hour over `elapsed_s` (0 when no time has passed)."""
    return count * 3600.0 / elapsed_s if elapsed_s > 0 else 0.0


def fair_share_error(intervals: Iterable[tuple[Mapping[str, float], Collection[str]]],
                     weights: Mapping[str, float]) -> dict[str, float]:
    """Per tenant: tokens carried over tokens its weight entitled it to, minus 1, over the
    (tokens per tenant, contending tenants) intervals where two or more contended."""
    measured: dict[str, float] = {}
    expected: dict[str, float] = {}
    for tokens, contending in intervals:
        if len(contending) < 2:
            continue
        total = sum(tokens.get(t, 0.0) for t in contending)
        weight_sum = sum(weights[t] for t in contending)
        for tenant in contending:
            measured[tenant] = measured.get(tenant, 0.0) + tokens.get(tenant, 0.0)
            expected[tenant] = expected.get(tenant, 0.0) + total * weights[tenant] / weight_sum
    return {t: measured[t] / expected[t] - 1.0 for t in sorted(expected) if expected[t] > 0}
