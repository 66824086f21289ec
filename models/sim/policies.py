"""Batch policies a simulation runs under: how batch work is admitted and scheduled.

- `none`: no batch work at all.
- `unrestricted`: batch admitted freely (up to the client's concurrency), FCFS engines.
- `priority`: batch admitted freely, engines on the priority policy, batch at lower priority.
- `static:R[:S]`: priority engines plus a constant budget of R batch tokens/s and a cap of S
  batch sequences (default 8 per replica that may take batch), through the same gate a
  controller drives.
- any other name: a closed-loop controller from the `ControllerCatalog` the caller passes
  in (the CLI passes `controller.closed_loop`'s; nothing here imports the controller).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from borrowd.models.budget import Budget, Mode
from borrowd.models.errors import InputError
from borrowd.models.protocols import LoopFactory
from borrowd.models.sim.engine import FCFS, PRIORITY
from borrowd.models.sim.scenario import Scenario

STATIC_SEQS_PER_REPLICA = 8
BUILTIN = ("none", "unrestricted", "priority")


@dataclass(frozen=True)
class PolicySpec:
    """A resolved policy: engine scheduling policy, batch on/off, and the budget source.

    Exactly one of `budget` (published once at the start) and `loop` (the factory of the
    pool's control loop, ticked every `tick_s` against the simulation) is set when `batch`
    is true. `observe_window_s` is the window the loop's signals are read over when its
    config names one (the daemon's Prometheus rules window), else the scenario's.
    """

    name: str
    engine_policy: str
    batch: bool
    budget: Budget | None = None
    loop: LoopFactory | None = None
    observe_window_s: float | None = None  # the loop's signal window; None: the scenario's


class ControllerCatalog(Protocol):
    """Closed-loop policies by name, built at the CLI edge (`controller.closed_loop`)."""

    def names(self) -> tuple[str, ...]:
        """The policy names it builds (its registered control laws)."""
        ...

    def spec(self, name: str, scenario: Scenario, plant_path: Path | None) -> PolicySpec:
        """The resolved policy `name` on `scenario`; `InputError` when it cannot be built."""
        ...


def free_budget(scenario: Scenario) -> Budget:
    """A budget that limits batch only by the client's own concurrency."""
    concurrency = scenario.batch.client_concurrency
    return Budget(
        pool=scenario.pool,
        mode=Mode.OPEN,
        reason="free admission",
        batch_tokens_per_s=1e12,
        batch_burst_tokens=2**53,
        max_batch_seqs=concurrency,
        max_batch_kv_tokens=2**53,
        max_batch_output_tokens=scenario.batch.output_clip_tokens,
    )


def static_budget(scenario: Scenario, tokens_per_s: float, seqs: int | None = None) -> Budget:
    """A constant budget: R tokens/s, a bucket of 2 s of R (at least one largest request),
    S sequences (default 8 per replica eligible for batch)."""
    if seqs is None:
        seqs = STATIC_SEQS_PER_REPLICA * len(scenario.batch_replicas())
    largest = scenario.batch.prompt_clip_tokens + scenario.batch.output_clip_tokens
    return Budget(
        pool=scenario.pool,
        mode=Mode.OPEN,
        reason=f"static {tokens_per_s:g} tokens/s",
        batch_tokens_per_s=float(tokens_per_s),
        batch_burst_tokens=int(max(2 * tokens_per_s, largest)),
        max_batch_seqs=seqs,
        max_batch_kv_tokens=seqs * largest,
        max_batch_output_tokens=scenario.batch.output_clip_tokens,
    )


def parse_policy(
    name: str,
    scenario: Scenario,
    plant_path: Path | None = None,
    controllers: ControllerCatalog | None = None,
) -> PolicySpec:
    """Resolve a policy name (closed-loop ones through `controllers`); `InputError` naming
    the problem when it is not one."""
    if name == "none":
        return PolicySpec(name, PRIORITY, batch=False)
    if name == "unrestricted":
        return PolicySpec(name, FCFS, batch=True, budget=free_budget(scenario))
    if name == "priority":
        return PolicySpec(name, PRIORITY, batch=True, budget=free_budget(scenario))
    if name.startswith("static:"):
        parts = name.split(":")
        try:
            rate = float(parts[1])
            seqs = int(parts[2]) if len(parts) > 2 else None
        except (ValueError, IndexError):
            raise InputError(f"policy {name!r}: expected static:TOKENS_PER_S[:SEQS]") from None
        if len(parts) > 3 or rate < 0 or (seqs is not None and seqs < 0):
            raise InputError(f"policy {name!r}: expected static:TOKENS_PER_S[:SEQS] >= 0")
        return PolicySpec(name, PRIORITY, batch=True, budget=static_budget(scenario, rate, seqs))
    if controllers is not None and name in controllers.names():
        return controllers.spec(name, scenario, plant_path)
    closed = controllers.names() if controllers is not None else ()
    known = ", ".join((*BUILTIN, "static:R[:S]", *closed))
    raise InputError(f"unknown policy {name!r} (known: {known})")
