"""The daemon's per-pool loop: observe -> decide -> publish (when leader), once per tick.

`PoolLoop.tick(now_s)` is the whole loop for one pool. It takes the time as an argument and
its source, store and election as protocols (`models.protocols`), so the daemon runs it on
wall time against Prometheus and Redis, the simulator on virtual time against itself, and
tests against fakes. Nothing here computes a budget (the policy does) or enforces one (the
adapters do), and nothing here knows the transport: store failures are `StoreError`.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import structlog
from borrowd.controller.loop_metrics import FOLLOWER, LEADER, OBSERVED_SIGNALS, DaemonMetrics
from borrowd.models.budget import Budget, Mode
from borrowd.models.errors import FencedError, StoreError
from borrowd.models.protocols import Election, MetricsSource, Store
from borrowd.models.signals import Observation


class ModeEventLike(Protocol):
    """A supervisor transition (`controller.supervisor.ModeEvent`)."""

    @property
    def from_mode(self) -> Mode:
        """The mode left."""
        ...

    @property
    def to_mode(self) -> Mode:
        """The mode entered."""
        ...

    @property
    def reason(self) -> str:
        """Why."""
        ...


class DecisionLike(Protocol):
    """One tick's decision (`controller.policy.Decision`)."""

    @property
    def budget(self) -> Budget:
        """The budget decided."""
        ...

    @property
    def u_law(self) -> float:
        """The law's own proposal (tokens/s), before the supervisor."""
        ...

    @property
    def events(self) -> Sequence[ModeEventLike]:
        """Mode transitions of this tick."""
        ...


class Controller(Protocol):
    """A pool's control policy (`controller.policy.ControllerPolicy`)."""

    @property
    def tick_s(self) -> float:
        """The control period."""
        ...

    def step(self, obs: Observation, now_s: float, *, stopped: bool = False,
             ceiling_tokens_per_s: float | None = None) -> DecisionLike:
        """Decide the next budget; `stopped` when the operator's stop switch is set;
        `ceiling_tokens_per_s` the operator's rollout ceiling (None: unset), the law's upper
        limit."""
        ...


@dataclass(frozen=True)
class TickReport:
    """What one tick of one pool did."""

    pool: str
    role: str
    epoch: int | None
    observation: Observation
    budget: Budget
    published: bool
    previous_mode: Mode | None
    duration_s: float
    query_age_s: float
    controller_state: Mapping[str, float]
    events: tuple[ModeEventLike, ...] = ()
    stop_reason: str | None = None

    @property
    def mode_changed(self) -> bool:
        """True when the mode differs from the previous tick's."""
        return self.previous_mode != self.budget.mode


class PoolLoop:
    """One pool's loop: observe -> decide -> (leader) publish, once per call of `tick`.

    Followers observe and decide too, so their law's state is warm when they take over, but
    only the lease holder publishes, fenced by its epoch. The rollout ceiling is read from the
    store each tick and handed to the controller, so its law saturates there (anti-windup)
    instead of winding up above a cap applied only at publish; a store error keeps the last
    ceiling read. Store trouble (`StoreError`) or a source's missing signals are counted and
    logged, never raised: the next tick tries again, and the budget's lease makes adapters
    close batch work if no record comes. The host calls `tick(now_s)` every `tick_s`: the
    daemon's scheduler on wall time, the simulator on virtual time.
    """

    def __init__(
        self,
        pool: str,
        *,
        ttl_ms: int,
        source: MetricsSource,
        policy: Controller,
        store: Store,
        election: Election,
        metrics: DaemonMetrics,
        query_age_s: Callable[[str, float], float],
        controller_state: Callable[[], Mapping[str, float]] = dict,
        log: Any = None,
    ) -> None:
        self.pool = pool
        self.ttl_ms = ttl_ms
        self.source = source
        self.policy = policy
        self.store = store
        self.election = election
        self.metrics = metrics
        self.query_age_s = query_age_s
        self.controller_state = controller_state
        self.log = log or structlog.get_logger("borrowd.daemon").bind(pool=pool)
        self.epoch: int | None = None
        self.mode: Mode | None = None
        self.last_tick_done_s: float | None = None
        self.ceiling_tokens_per_s: float | None = None
        self._lock = threading.Lock()

    @property
    def tick_s(self) -> float:
        """The controller's control period."""
        return self.policy.tick_s

    def tick(self, now_s: float) -> TickReport:
        """Run one tick at `now_s` and return what it did."""
        with self._lock:
            started = time.perf_counter()
            obs = self.source.observe(self.pool, now_s)
            stop_reason = self._stop_reason()
            self._read_ceiling()
            decision = self.policy.step(obs, now_s, stopped=stop_reason is not None,
                                        ceiling_tokens_per_s=self.ceiling_tokens_per_s)
            budget = decision.budget
            self._lead()
            published = False
            if self.epoch is not None:
                stored = self._publish(budget, now_s)
                if stored is not None:
                    budget, published = stored, True
            report = TickReport(
                pool=self.pool,
                role=LEADER if self.epoch is not None else FOLLOWER,
                epoch=self.epoch,
                observation=obs,
                budget=budget,
                published=published,
                previous_mode=self.mode,
                duration_s=time.perf_counter() - started,
                query_age_s=self.query_age_s(self.pool, now_s),
                controller_state={"u_law_tokens_per_s": decision.u_law,
                                  **self.controller_state()},
                events=tuple(decision.events),
                stop_reason=stop_reason,
            )
            self.mode = budget.mode
            self.last_tick_done_s = now_s
        record_tick(self.metrics, report)
        self._log(report)
        return report

    def shutdown(self) -> None:
        """Stop leading: release the lease so a standby takes over at once."""
        with self._lock:
            if self.epoch is None:
                return
            try:
                self.election.release()
                self.log.info("leader_released", epoch=self.epoch)
            except StoreError as exc:
                self._error("redis", "release", exc)
            self.epoch = None
            self.metrics.leader.labels(self.pool).set(0.0)
            self.metrics.epoch.labels(self.pool).set(0.0)

    def _stop_reason(self) -> str | None:
        """The stop switch's reason; a store error reads as not stopped (publish fails too)."""
        try:
            return self.store.stop_reason()
        except StoreError as exc:
            self._error("redis", "stop_switch", exc)
            return None

    def _read_ceiling(self) -> None:
        """The rollout ceiling for this tick; a store error keeps the last one read (the
        store clamps again at publish, and a failing store publishes nothing)."""
        try:
            self.ceiling_tokens_per_s = self.store.ceiling_tokens_per_s()
        except StoreError as exc:
            self._error("redis", "ceiling", exc)

    def _lead(self) -> None:
        """Renew the lease when holding it, else try to take it; a store error means follower."""
        held = self.epoch
        try:
            if held is not None and self.election.renew():
                return
            self.epoch = self.election.try_acquire()
        except StoreError as exc:
            self._error("redis", "election", exc)
            self.epoch = None
        if held is not None and self.epoch != held:
            self.log.warning("leadership_lost", epoch=held, new_epoch=self.epoch)
        if held is None and self.epoch is not None:
            self.log.info("leadership_acquired", epoch=self.epoch)

    def _publish(self, budget: Budget, now_s: float) -> Budget | None:
        assert self.epoch is not None
        try:
            return self.store.publish(budget, epoch=self.epoch, ttl_ms=self.ttl_ms, now_s=now_s)
        except FencedError as exc:
            self.log.warning("leadership_fenced", epoch=self.epoch,
                             newest_epoch=exc.newest_epoch)
            self.metrics.errors.labels(self.pool, "redis", "fenced").inc()
            self.epoch = None
        except StoreError as exc:
            self._error("redis", "publish", exc)
        return None

    def _error(self, source: str, kind: str, exc: BaseException) -> None:
        self.metrics.errors.labels(self.pool, source, kind).inc()
        self.log.error(f"{source}_error", kind=kind, error=f"{type(exc).__name__}: {exc}")

    def _log(self, report: TickReport) -> None:
        budget = report.budget
        obs = report.observation
        signals = {name: _finite_or_none(getattr(obs, name)) for name in OBSERVED_SIGNALS}
        self.log.info(
            "tick",
            role=report.role,
            epoch=report.epoch,
            mode=budget.mode.value,
            reason=budget.reason,
            batch_tokens_per_s=round(budget.batch_tokens_per_s, 3),
            max_batch_seqs=budget.max_batch_seqs,
            max_batch_kv_tokens=budget.max_batch_kv_tokens,
            max_batch_output_tokens=budget.max_batch_output_tokens,
            published=report.published,
            stop_reason=report.stop_reason,
            seq=budget.seq if report.published else None,
            duration_ms=round(report.duration_s * 1000, 2),
            observed=signals,
        )
        for event in report.events:
            self.log.warning(
                "mode_change",
                from_mode=event.from_mode.value,
                to_mode=event.to_mode.value,
                reason=event.reason,
                role=report.role,
            )
        if report.mode_changed and not report.events:
            # The store changed the record (stop switch) or this is the first tick.
            self.log.warning(
                "mode_change",
                from_mode=report.previous_mode.value if report.previous_mode else None,
                to_mode=budget.mode.value,
                reason=budget.reason,
                role=report.role,
            )


def _finite_or_none(value: float) -> float | None:
    return round(value, 6) if math.isfinite(value) else None


def record_tick(metrics: DaemonMetrics, report: TickReport) -> None:
    """Export what one tick decided and observed to `metrics`."""
    pool = report.pool
    metrics.budget_tokens_per_s.labels(pool).set(report.budget.batch_tokens_per_s)
    metrics.budget_max_batch_seqs.labels(pool).set(report.budget.max_batch_seqs)
    metrics.budget_max_batch_kv_tokens.labels(pool).set(report.budget.max_batch_kv_tokens)
    for mode in Mode:
        metrics.mode.labels(pool, mode.value).set(1.0 if mode == report.budget.mode else 0.0)
    metrics.leader.labels(pool).set(1.0 if report.role == LEADER else 0.0)
    metrics.epoch.labels(pool).set(float(report.epoch or 0))
    if report.published:
        metrics.published.labels(pool).inc()
    metrics.ticks.labels(pool, report.role).inc()
    metrics.tick_duration.labels(pool).observe(report.duration_s)
    metrics.query_age.labels(pool).set(report.query_age_s)
    for name in OBSERVED_SIGNALS:
        metrics.observed.labels(pool, name).set(getattr(report.observation, name))
    for name, value in report.controller_state.items():
        metrics.controller_state.labels(pool, name).set(value)
