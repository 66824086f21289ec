"""The figures of a simulated run's batch jobs, per job and per tenant, and their tables.

Per job: items completed (and where the others are), completion time, lateness
(finish - deadline), the first projection that put the finish past the deadline
(`models.batch.figures.project_lateness` over the carried rate, as the service's monitor
projects it), items the service would have expired, tokens kept / processed / recomputed,
revocations and resumes, GPU time and cost per completed item. Per tenant: the same
summed, and the fair-share error over the seconds when tenants contended
(`models.batch.figures.fair_share_error`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from borrowd.models.batch.figures import cost_per_item, fair_share_error


@dataclass(frozen=True)
class JobFigures:
    """One job at the end of a run (times in seconds from the start of the run).

    `completed_tokens`: prompt + output tokens of the completed items; `processed_tokens`:
    every token the engines computed for the job (recomputed ones included);
    `revocations`: attempts cut before their item's end (revoked by the budget, stopped at
    the budget's output cap, or lost with a replica); `resumes`: continuations of a cut item
    from its output so far, which re-prefill `reprefill_tokens`."""

    job: str
    tenant: str
    items: int
    completed: int
    in_flight: int
    waiting: int
    not_arrived: int
    arrival_s: float
    deadline_s: float
    finish_s: float | None
    completion_time_s: float | None
    lateness_s: float | None
    late_projected_at_s: float | None
    first_late_projection_s: float | None
    projected_lateness_s: float | None
    items_after_deadline: int
    items_per_hour: float
    completed_tokens: int
    processed_tokens: int
    recomputed_tokens: int
    reprefill_tokens: int
    revocations: int
    resumes: int
    gpu_s: float
    cost_per_item: float | None

    @property
    def accounted(self) -> int:
        """Items completed, in flight, waiting or not yet submitted (= items: none vanish)."""
        return self.completed + self.in_flight + self.waiting + self.not_arrived


@dataclass(frozen=True)
class TenantFigures:
    """One tenant's jobs summed, and its share of the tokens processed under contention."""

    tenant: str
    weight: float
    items: int
    completed: int
    completed_tokens: int
    recomputed_tokens: int
    contended_tokens: int
    contended_share: float | None
    fair_share_error: float | None
    gpu_s: float
    cost_per_item: float | None


@dataclass(frozen=True)
class JobsReport:
    """Every job's and tenant's figures of one run."""

    price_per_gpu_hour: float
    batch_gpu_s: float
    contended_s: int
    fair_share_error_max: float | None
    jobs: tuple[JobFigures, ...]
    tenants: tuple[TenantFigures, ...]

    def to_json(self) -> dict[str, Any]:
        """The report as JSON (floats rounded; an infinite projection is null)."""
        return _rounded(dataclasses.asdict(self))


def jobs_report(jobs: Sequence[JobFigures], weights: Mapping[str, float],
                intervals: Sequence[tuple[Mapping[str, float], frozenset[str]]],
                price_per_gpu_hour: float, batch_gpu_s: float) -> JobsReport:
    """The report of a run: its jobs' figures, and per tenant their sums and fair share over
    the (tokens per tenant, contending tenants) intervals."""
    errors = fair_share_error(intervals, weights)
    contended = dict.fromkeys(weights, 0.0)
    contended_s = 0
    for tokens, contending in intervals:
        if len(contending) >= 2:
            contended_s += 1
            for tenant in contending:
                contended[tenant] += tokens.get(tenant, 0.0)
    total = sum(contended.values())
    tenants = []
    for tenant, weight in weights.items():
        mine = [j for j in jobs if j.tenant == tenant]
        completed = sum(j.completed for j in mine)
        gpu_s = sum(j.gpu_s for j in mine)
        tenants.append(TenantFigures(
            tenant=tenant, weight=weight, items=sum(j.items for j in mine), completed=completed,
            completed_tokens=sum(j.completed_tokens for j in mine),
            recomputed_tokens=sum(j.recomputed_tokens for j in mine),
            contended_tokens=int(contended[tenant]),
            contended_share=contended[tenant] / total if total else None,
            fair_share_error=errors.get(tenant), gpu_s=gpu_s,
            cost_per_item=cost_per_item(price_per_gpu_hour, gpu_s, completed),
        ))
    worst = max((abs(e) for e in errors.values()), default=None)
    return JobsReport(price_per_gpu_hour, batch_gpu_s, contended_s, worst, tuple(jobs),
                      tuple(tenants))


def _rounded(value: Any) -> Any:
    """Floats to 4 decimals (cost per item to 6), through dicts and lists; inf to None."""
    if isinstance(value, dict):
        return {k: (round(v, 6) if k == "cost_per_item" and isinstance(v, float)
                    else _rounded(v)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_rounded(v) for v in value]
    if isinstance(value, float):
        return round(value, 4) if math.isfinite(value) else None
    return value


JOB_COLUMNS = (
    ("job", "job", "{}"), ("tenant", "tenant", "{}"), ("items", "items", "{}"),
    ("done", "completed", "{}"), ("finish s", "finish_s", "{:.0f}"),
    ("late s", "lateness_s", "{:.0f}"), ("flagged late at s", "late_projected_at_s", "{:.0f}"),
    ("projected late s", "first_late_projection_s", "{:.0f}"),
    ("expired", "items_after_deadline", "{}"), ("items/h", "items_per_hour", "{:.0f}"),
    ("recomputed tok", "recomputed_tokens", "{}"), ("revoked", "revocations", "{}"),
    ("cost/item", "cost_per_item", "{:.6f}"),
)
TENANT_COLUMNS = (
    ("tenant", "tenant", "{}"), ("weight", "weight", "{:g}"), ("done", "completed", "{}"),
    ("contended tok", "contended_tokens", "{}"), ("share", "contended_share", "{:.4f}"),
    ("fair-share error", "fair_share_error", "{:+.4f}"), ("cost/item", "cost_per_item",
                                                          "{:.6f}"),
)


def format_jobs_tables(policy: str, report: Mapping[str, Any]) -> str:
    """A run's jobs and tenants (the `to_json` form) as two Markdown tables."""
    lines = [f"batch jobs under {policy}: {report['contended_s']} s contended, fair-share "
             f"error at most {_cell('{:.4f}', report['fair_share_error_max'])}, "
             f"{report['price_per_gpu_hour']:g} per GPU-hour"]
    for columns, rows in ((JOB_COLUMNS, report["jobs"]), (TENANT_COLUMNS, report["tenants"])):
        lines.append("")
        lines.append("| " + " | ".join(c[0] for c in columns) + " |")
        lines.append("|" + "|".join("---" for _ in columns) + "|")
        for row in rows:
            lines.append("| " + " | ".join(_cell(fmt, row[key]) for _, key, fmt in columns)
                         + " |")
    return "\n".join(lines)


def _cell(fmt: str, value: object) -> str:
    return "-" if value is None else fmt.format(value)
