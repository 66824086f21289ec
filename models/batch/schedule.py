"""Which batch work runs next: weighted fair share between tenants, EDF within a tenant.

Fair share is start-time fair queuing (Goyal, Vin, Cheng 1996) over the tokens each
dispatch costs. Tenant t holds a finish tag F_t; the system holds a virtual time V.
A dispatch of cost c for tenant t takes start tag S_t = max(F_t, V), sets
F_t = S_t + c / w_t and V = max(V, S_t); the next dispatch goes to the backlogged tenant
with the smallest max(F_t, V). Under contention, dispatched tokens split by weight; a
tenant with nothing to run is skipped (its share goes to the others), and one that comes
back starts at V, so it banks no credit from its idle time.

Within a tenant, jobs run earliest deadline first (then oldest first).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from borrowd.models.errors import ConfigError


@dataclass(frozen=True)
class FairState:
    """Finish tags per tenant and the virtual time, in weighted tokens."""

    finish_tags: Mapping[str, float]
    vtime: float = 0.0

    def start_tag(self, tenant: str) -> float:
        """S_t = max(F_t, V)."""
        return max(self.finish_tags.get(tenant, 0.0), self.vtime)


def pick_tenant(state: FairState, backlogged: Iterable[str]) -> str | None:
    """The backlogged tenant with the smallest start tag (ties by name), or None."""
    best: tuple[float, str] | None = None
    for tenant in backlogged:
        key = (state.start_tag(tenant), tenant)
        if best is None or key < best:
            best = key
    return None if best is None else best[1]


def charge(state: FairState, tenant: str, cost_tokens: float, weight: float) -> FairState:
    """The state after dispatching `cost_tokens` of work for `tenant` of `weight`."""
    if weight <= 0:
        raise ConfigError(f"tenant {tenant!r}: weight must be > 0, got {weight}")
    start = state.start_tag(tenant)
    tags = dict(state.finish_tags)
    tags[tenant] = start + cost_tokens / weight
    return FairState(tags, max(state.vtime, start))


@dataclass(frozen=True)
class JobRef:
    """What ordering needs of a job: its id, deadline and creation time (epoch seconds)."""

    job_id: str
    deadline_s: float
    created_s: float


def edf_order(jobs: Sequence[JobRef]) -> list[JobRef]:
    """Jobs earliest deadline first, then oldest first, then by id."""
    return sorted(jobs, key=lambda j: (j.deadline_s, j.created_s, j.job_id))


def next_job(state: FairState, jobs: Iterable[tuple[str, JobRef]]) -> JobRef | None:
    """The job the next dispatch takes from, among (tenant, job) pairs with work waiting:
    the tenant with the smallest start tag, then that tenant's earliest deadline (None when
    there is none). The workers and the simulator both pick with this."""
    by_tenant: dict[str, list[JobRef]] = {}
    for name, job in jobs:
        by_tenant.setdefault(name, []).append(job)
    picked = pick_tenant(state, by_tenant)
    return None if picked is None else edf_order(by_tenant[picked])[0]


def dispatch_cost_tokens(prompt_tokens: int, max_output_tokens: int) -> int:
    """What a dispatch is charged: its prompt plus the output it may generate."""
    return max(1, prompt_tokens + max_output_tokens)
