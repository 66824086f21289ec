"""Which batch work runs next: weighted fair share between tenants, EDF within a tenant.

Fair share is start-time fair queuing (Goyal, Vin, Cheng 1996) over the tokens each
dispatch costs. Tenant t holds a finish tag F_t; the system holds a virtual time V.
A dispatch of cost c for tenant t takes start tag S_t = max(F_t, V), sets
F_t = S_t + c / w_t and V = max(V, S_t); the next dispatch goes to the backlogged tenant
with the smallest max(F_t, V). Under contention, dispatched tokens split by weight; a
tenant with nothing to run is skipped (its share goes to the others), and one that comes
back starts at V, so it banks no credit from its idle time.

Many workers dispatch at once, so picking and charging are one step (`dispatch`, one Lua
script in Redis): a worker that picked on tags another had just moved would charge a tenant
out of turn, push V past the others' tags, and take their credit (three workers split 2:1
weights 1.3:1 that way). What a dispatch costs is not known when it is picked (nor until
the item ends: the model may stop before max_tokens, the engine counts the prompt its own
way), so it is charged the tenant's expected cost C_t and settled when the item ends:
F_t += (actual - C_t) / w_t, C_t += a (actual - C_t), actual = the engine's prompt tokens
+ the output generated. Charging max_tokens instead would give a tenant whose items stop
early a fraction of its share (one generating a tenth of its max_tokens got a tenth).

Within a tenant, jobs run earliest deadline first (then oldest first).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from borrowd.models.errors import ConfigError

DEFAULT_COST_TOKENS = 1024.0
"""C_t of a tenant before its first item ends."""
COST_SMOOTHING = 0.1
"""a: the weight of an ended item in its tenant's expected cost C_t."""


@dataclass(frozen=True)
class FairState:
    """Finish tags per tenant and the virtual time, in weighted tokens, and each tenant's
    expected cost of a dispatch C_t, in tokens."""

    finish_tags: Mapping[str, float]
    vtime: float = 0.0
    expected_costs: Mapping[str, float] = field(default_factory=dict)

    def start_tag(self, tenant: str) -> float:
        """S_t = max(F_t, V)."""
        return max(self.finish_tags.get(tenant, 0.0), self.vtime)

    def expected_cost(self, tenant: str) -> float:
        """C_t: what the tenant's items have been costing (the default before any)."""
        return self.expected_costs.get(tenant, DEFAULT_COST_TOKENS)


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
    return FairState(tags, max(state.vtime, start), state.expected_costs)


@dataclass(frozen=True)
class Dispatch:
    """A dispatch: the tenant picked, what it was charged (tokens), the state after."""

    tenant: str
    charged_tokens: float
    state: FairState


def dispatch(state: FairState, weights: Mapping[str, float]) -> Dispatch | None:
    """Pick among the backlogged tenants (tenant -> weight) and charge the winner its
    expected cost, in one step; None when none is backlogged."""
    tenant = pick_tenant(state, weights)
    if tenant is None:
        return None
    cost = state.expected_cost(tenant)
    return Dispatch(tenant, cost, charge(state, tenant, cost, weights[tenant]))


@dataclass(frozen=True)
class Settlement:
    """How an ended dispatch corrects its tenant's state: the finish tag moves by
    `tag_delta` (weighted tokens); `cost_tokens` (None: the item did not finish here) feeds
    C_t."""

    tag_delta: float
    cost_tokens: float | None


def settlement(charged_tokens: float, actual_tokens: int, weight: float,
               finished: bool) -> Settlement:
    """The correction of a dispatch charged `charged_tokens` that cost `actual_tokens`:
    (actual - charged) / w; the cost feeds C_t only when the item finished (a run handed
    over mid-way, or a pick that found no item, says nothing of what items cost)."""
    if weight <= 0:
        raise ConfigError(f"weight must be > 0, got {weight}")
    return Settlement((actual_tokens - charged_tokens) / weight,
                      float(actual_tokens) if finished else None)


def settle(state: FairState, tenant: str, settled: Settlement,
           smoothing: float = COST_SMOOTHING) -> FairState:
    """The state after `settled`: F_t += delta; C_t += a (cost - C_t) if it finished."""
    tags = dict(state.finish_tags)
    tags[tenant] = tags.get(tenant, 0.0) + settled.tag_delta
    costs = dict(state.expected_costs)
    if settled.cost_tokens is not None:
        cost = state.expected_cost(tenant)
        costs[tenant] = cost + smoothing * (settled.cost_tokens - cost)
    return FairState(tags, state.vtime, costs)


@dataclass(frozen=True)
class JobRef:
    """What ordering needs of a job: its id, deadline and creation time (epoch seconds)."""

    job_id: str
    deadline_s: float
    created_s: float


def edf_order(jobs: Sequence[JobRef]) -> list[JobRef]:
    """Jobs earliest deadline first, then oldest first, then by id."""
    return sorted(jobs, key=lambda j: (j.deadline_s, j.created_s, j.job_id))


def dispatch_cost_tokens(prompt_tokens: int, max_output_tokens: int) -> int:
    """Prompt plus output tokens (at least 1): the most a dispatch of that many output
    tokens may cost, and what one that generated them did cost."""
    return max(1, prompt_tokens + max_output_tokens)
