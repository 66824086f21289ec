"""The daemon loop: per pool and per tick, observe -> decide -> publish (when leader).

`PoolLoop.tick` is the whole loop for one pool and takes the time as an argument, so tests
drive it with fakes; `Daemon` runs the loops on an APScheduler (no overlapping ticks, overruns
and misfires logged and counted), serves `/metrics`, tells systemd it is ready and alive, and
on SIGTERM stops ticking and releases its leader leases. Nothing here computes a budget: the
policy does; nothing here enforces one: the adapters do.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol
from wsgiref.simple_server import WSGIServer

import redis
import structlog
from apscheduler.events import (
    EVENT_JOB_ERROR,
    EVENT_JOB_MAX_INSTANCES,
    EVENT_JOB_MISSED,
    JobEvent,
    JobExecutionEvent,
)
from apscheduler.schedulers.background import BackgroundScheduler
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from adapters.redact import redact_event
from adapters.redis_conn import connect, redact_url
from adapters.store import BudgetStore, FencedError, LeaderElection
from controller.config import BorrowdConfig, PoolConfig
from controller.policy import ControllerConfig, ControllerPolicy, build_policy
from controller.prom_source import PrometheusSource, connect_prometheus
from controller.sdnotify import Notifier
from models.budget import Budget, Mode
from models.plant.model import PlantModel
from models.protocols import MetricsSource
from models.signals import Observation

LEADER = "leader"
FOLLOWER = "follower"
QUERY_ERROR_LOG_PERIOD_S = 60.0

# Observation fields exported as `borrowd_observed{signal=...}`.
OBSERVED_SIGNALS = tuple(
    f.name for f in fields(Observation) if f.name not in ("now_s",)
)


class Election(Protocol):
    """Leader election of one pool (`adapters.store.LeaderElection`)."""

    def try_acquire(self) -> int | None:
        """Take or keep the lease; the epoch, or None when another replica holds it."""
        ...

    def renew(self) -> bool:
        """Extend the lease; False when it is lost."""
        ...

    def release(self) -> None:
        """Give the lease up."""
        ...


class Store(Protocol):
    """Budget store of one pool (`adapters.store.BudgetStore`)."""

    def publish(self, budget: Budget, *, epoch: int, ttl_ms: int, now_s: float) -> Budget:
        """Write `budget` fenced by `epoch`; the record as stored; FencedError if deposed."""
        ...

    def stop_reason(self) -> str | None:
        """The operator's reason while the stop switch is set, else None."""
        ...


class ModeEventLike(Protocol):
    """A supervisor transition (`controller.supervisor.ModeEvent`)."""

    from_mode: Mode
    to_mode: Mode
    reason: str


class DecisionLike(Protocol):
    """One tick's decision (`controller.policy.Decision`)."""

    budget: Budget
    u_law: float
    events: tuple[ModeEventLike, ...]


class Controller(Protocol):
    """A pool's control policy (`controller.policy.ControllerPolicy`)."""

    tick_s: float

    def step(self, obs: Observation, now_s: float, *, stopped: bool = False) -> DecisionLike:
        """Decide the next budget; `stopped` when the operator's stop switch is set."""
        ...


class WallClock:
    """Unix time, the time base of budgets and Prometheus queries."""

    def now_s(self) -> float:
        """Current Unix time in seconds."""
        return time.time()


class DaemonMetrics:
    """The daemon's own Prometheus metrics, in a registry of its own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.budget_tokens_per_s = Gauge(
            "borrowd_budget_tokens_per_s", "Batch token budget last decided (tokens/s).",
            ["pool"], registry=r)
        self.budget_max_batch_seqs = Gauge(
            "borrowd_budget_max_batch_seqs", "Batch sequence cap last decided.", ["pool"],
            registry=r)
        self.budget_max_batch_kv_tokens = Gauge(
            "borrowd_budget_max_batch_kv_tokens", "Batch KV-token cap last decided.", ["pool"],
            registry=r)
        self.mode = Gauge(
            "borrowd_mode", "1 for the pool's current supervisor mode, 0 for the others.",
            ["pool", "mode"], registry=r)
        self.leader = Gauge(
            "borrowd_leader", "1 while this daemon leads the pool (publishes its budget).",
            ["pool"], registry=r)
        self.epoch = Gauge(
            "borrowd_epoch", "Epoch (fencing token) this daemon publishes with; 0 as follower.",
            ["pool"], registry=r)
        self.published = Counter(
            "borrowd_budgets_published_total", "Budget records written to Redis.", ["pool"],
            registry=r)
        self.ticks = Counter(
            "borrowd_ticks_total", "Completed ticks, by role.", ["pool", "role"], registry=r)
        self.tick_duration = Histogram(
            "borrowd_tick_duration_seconds", "Wall time of one tick (observe, decide, publish).",
            ["pool"], registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))
        self.errors = Counter(
            "borrowd_errors_total", "Errors by pool, source (prometheus, redis, policy, "
            "scheduler) and kind.", ["pool", "source", "kind"], registry=r)
        self.query_age = Gauge(
            "borrowd_last_successful_query_age_seconds",
            "Age of the freshest data Prometheus last reported for the pool (+Inf: never).",
            ["pool"], registry=r)
        self.observed = Gauge(
            "borrowd_observed", "Signals of the last observation (NaN: not measured).",
            ["pool", "signal"], registry=r)
        self.controller_state = Gauge(
            "borrowd_controller_state", "Internal state of the pool's control law (integral "
            "term, estimates), by name.", ["pool", "name"], registry=r)

    def record_tick(self, report: TickReport) -> None:
        """Export what one tick decided and observed."""
        pool = report.pool
        self.budget_tokens_per_s.labels(pool).set(report.budget.batch_tokens_per_s)
        self.budget_max_batch_seqs.labels(pool).set(report.budget.max_batch_seqs)
        self.budget_max_batch_kv_tokens.labels(pool).set(report.budget.max_batch_kv_tokens)
        for mode in Mode:
            self.mode.labels(pool, mode.value).set(1.0 if mode == report.budget.mode else 0.0)
        self.leader.labels(pool).set(1.0 if report.role == LEADER else 0.0)
        self.epoch.labels(pool).set(float(report.epoch or 0))
        if report.published:
            self.published.labels(pool).inc()
        self.ticks.labels(pool, report.role).inc()
        self.tick_duration.labels(pool).observe(report.duration_s)
        self.query_age.labels(pool).set(report.query_age_s)
        for name in OBSERVED_SIGNALS:
            self.observed.labels(pool, name).set(getattr(report.observation, name))
        for name, value in report.controller_state.items():
            self.controller_state.labels(pool, name).set(value)


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
    only the lease holder publishes, fenced by its epoch. Redis or Prometheus trouble is
    counted and logged, never raised: the next tick tries again, and the budget's lease makes
    adapters close batch work if no record comes.
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
        self._lock = threading.Lock()

    def tick(self, now_s: float) -> TickReport:
        """Run one tick at `now_s` and return what it did."""
        with self._lock:
            started = time.perf_counter()
            obs = self.source.observe(self.pool, now_s)
            stop_reason = self._stop_reason()
            decision = self.policy.step(obs, now_s, stopped=stop_reason is not None)
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
        self.metrics.record_tick(report)
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
            except redis.RedisError as exc:
                self._error("redis", "release", exc)
            self.epoch = None
            self.metrics.leader.labels(self.pool).set(0.0)
            self.metrics.epoch.labels(self.pool).set(0.0)

    def _stop_reason(self) -> str | None:
        """The stop switch's reason; a Redis error reads as not stopped (publish fails too)."""
        try:
            return self.store.stop_reason()
        except redis.RedisError as exc:
            self._error("redis", "stop_switch", exc)
            return None

    def _lead(self) -> None:
        """Renew the lease when holding it, else try to take it; a Redis error means follower."""
        held = self.epoch
        try:
            if held is not None and self.election.renew():
                return
            self.epoch = self.election.try_acquire()
        except redis.RedisError as exc:
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
        except redis.RedisError as exc:
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


class Daemon:
    """Runs every pool's loop on a scheduler until `stop` is set (SIGTERM / SIGINT).

    Ticks of one pool never overlap (`max_instances=1`); a tick that is still running when the
    next is due makes the scheduler skip that one (counted as an overrun), and late runs are
    coalesced into one (counted as a misfire). systemd gets READY=1 once ticking, WATCHDOG=1
    while every pool ticked within three periods, and STOPPING=1 on the way out.
    """

    def __init__(
        self,
        loops: Mapping[str, PoolLoop],
        tick_s: Mapping[str, float],
        *,
        metrics: DaemonMetrics,
        clock: WallClock | None = None,
        notifier: Notifier | None = None,
        log: Any = None,
    ) -> None:
        self.loops = dict(loops)
        self.tick_s = dict(tick_s)
        self.metrics = metrics
        self.clock = clock or WallClock()
        self.notifier = notifier or Notifier({})
        self.log = log or structlog.get_logger("borrowd.daemon")
        self.started_s = self.clock.now_s()
        self.scheduler = BackgroundScheduler(
            timezone="UTC",
            job_defaults={"max_instances": 1, "coalesce": True},
        )
        self.scheduler.add_listener(
            self._on_event, EVENT_JOB_MISSED | EVENT_JOB_MAX_INSTANCES | EVENT_JOB_ERROR
        )

    def start(self) -> None:
        """Schedule every pool's tick (the first one now) and tell systemd we are ready."""
        for pool, loop in self.loops.items():
            self.scheduler.add_job(
                self._run_tick, "interval", seconds=self.tick_s[pool], args=[loop], id=pool,
                name=f"tick {pool}", misfire_grace_time=max(1, int(self.tick_s[pool])),
                next_run_time=datetime.now(UTC),
            )
        self.scheduler.start()
        self.notifier.notify("READY=1", f"STATUS=ticking {len(self.loops)} pool(s)")
        self.log.info("daemon_started", pools=sorted(self.loops),
                      watchdog_s=self.notifier.watchdog_s)

    def run_until(self, stop: threading.Event) -> None:
        """Start, ping the watchdog while healthy, and shut down cleanly once `stop` is set."""
        self.start()
        period_s = min(self.tick_s.values())
        if self.notifier.watchdog_s:
            period_s = min(period_s, self.notifier.watchdog_s / 2)
        try:
            while not stop.wait(period_s):
                if self.notifier.watchdog_s and self.healthy(self.clock.now_s()):
                    self.notifier.notify("WATCHDOG=1")
        finally:
            self.shutdown()

    def healthy(self, now_s: float) -> bool:
        """True while every pool finished a tick within three of its periods."""
        for pool, loop in self.loops.items():
            last = loop.last_tick_done_s if loop.last_tick_done_s is not None else self.started_s
            if now_s - last > 3 * self.tick_s[pool]:
                return False
        return True

    def shutdown(self) -> None:
        """Stop ticking (waiting for running ticks), then release every leader lease."""
        self.notifier.notify("STOPPING=1")
        self.log.info("daemon_stopping")
        if self.scheduler.running:
            self.scheduler.shutdown(wait=True)
        for loop in self.loops.values():
            loop.shutdown()
        self.log.info("daemon_stopped")

    def _run_tick(self, loop: PoolLoop) -> None:
        # An exception here reaches `_on_event` as EVENT_JOB_ERROR; the job keeps its schedule,
        # and the budget's lease closes batch work if ticks keep failing.
        loop.tick(self.clock.now_s())

    def _on_event(self, event: JobEvent) -> None:
        pool = event.job_id
        if event.code == EVENT_JOB_MAX_INSTANCES:
            self.metrics.errors.labels(pool, "scheduler", "overrun").inc()
            self.log.warning("tick_overrun", pool=pool,
                             detail="previous tick still running; this one skipped")
        elif event.code == EVENT_JOB_MISSED:
            self.metrics.errors.labels(pool, "scheduler", "misfire").inc()
            scheduled = getattr(event, "scheduled_run_time", None)
            self.log.warning("tick_misfire", pool=pool,
                             scheduled=scheduled.isoformat() if scheduled else None)
        elif isinstance(event, JobExecutionEvent) and event.exception is not None:
            self.metrics.errors.labels(pool, "policy", type(event.exception).__name__).inc()
            self.log.error("tick_failed", pool=pool, error=repr(event.exception),
                           traceback=event.traceback)


# ---------------------------------------------------------------------------------------------
# Wiring: the config's pools onto Prometheus, Redis and the controller policy.


def configure_logging(level: str) -> None:
    """structlog to stdout as one JSON object per line, at `level` and above."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            redact_event,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stdout),
        cache_logger_on_first_use=True,
    )


def policy_state(policy: ControllerPolicy) -> dict[str, float]:
    """The control law's internal state as named numbers, for `borrowd_controller_state`."""
    return policy.state()


def load_plant(pool: PoolConfig) -> PlantModel | None:
    """The pool's identified plant, or None when `plant_file` is empty."""
    return PlantModel.load(Path(pool.plant_file)) if pool.plant_file else None


# The SLO-burn recording rules (deploy/prometheus/borrowd.rules.yml) count the share of
# interactive samples above these bucket bounds.
RULES_SLO_TTFT_S = 1.0
RULES_SLO_ITL_S = 0.05


def burn_matches_rules(controller: ControllerConfig) -> bool:
    """True when the pool's SLOs are the bounds the burn recording rules measure against."""
    return (
        math.isclose(controller.slo_ttft_p95_s, RULES_SLO_TTFT_S)
        and math.isclose(controller.slo_itl_p95_s, RULES_SLO_ITL_S)
    )


def build_policies(config: BorrowdConfig) -> dict[str, ControllerPolicy]:
    """One controller policy per pool (reads plant files; no network).

    A pool whose SLOs differ from the burn rules' bucket bounds controls on its p95s: the
    burn read from Prometheus would measure a different line than its SLO.
    """
    policies = {}
    for pool in config.pools:
        controller = pool.controller
        if controller.control_on_burn and not burn_matches_rules(controller):
            structlog.get_logger("borrowd.daemon").warning(
                "burn_off_for_slo", pool=pool.name, slo_ttft_p95_s=controller.slo_ttft_p95_s,
                slo_itl_p95_s=controller.slo_itl_p95_s, rules_ttft_s=RULES_SLO_TTFT_S,
                rules_itl_s=RULES_SLO_ITL_S,
            )
            controller = dataclasses.replace(controller, control_on_burn=False)
        policies[pool.name] = build_policy(controller, pool.name, load_plant(pool))
    return policies


def build_daemon(
    config: BorrowdConfig,
    *,
    redis_client: redis.Redis | None = None,
    notifier: Notifier | None = None,
) -> Daemon:
    """A `Daemon` for `config`: Prometheus source, Redis store and election, policies."""
    log = structlog.get_logger("borrowd.daemon")
    metrics = DaemonMetrics()
    client = redis_client or connect(
        config.redis.url,
        connect_timeout_s=config.redis.connect_timeout_s,
        socket_timeout_s=config.redis.socket_timeout_s,
    )
    prom = connect_prometheus(config.prometheus.url, config.prometheus.timeout_s)

    last_logged: dict[tuple[str, str, str], float] = {}

    def on_query_error(pool: str, field: str, kind: str, detail: str) -> None:
        metrics.errors.labels(pool, "prometheus", kind).inc()
        # Every failure is counted; a failure that repeats each tick is logged once a minute.
        key, now = (pool, field, kind), time.monotonic()
        if now - last_logged.get(key, -math.inf) >= QUERY_ERROR_LOG_PERIOD_S:
            last_logged[key] = now
            log.warning("prometheus_query_failed", pool=pool, field=field, kind=kind,
                        detail=detail)

    source = PrometheusSource(
        prom, window=config.prometheus.window, timeout_s=config.prometheus.timeout_s,
        on_error=on_query_error,
    )
    holder_id = config.daemon.resolved_holder_id()
    policies = build_policies(config)
    loops = {}
    for pool in config.pools:
        policy = policies[pool.name]
        loops[pool.name] = PoolLoop(
            pool.name,
            ttl_ms=pool.budget_ttl_ms,
            source=source,
            policy=policy,
            store=BudgetStore(client, pool.name),
            election=LeaderElection(client, pool.name, holder_id, pool.leader_lease_ms),
            metrics=metrics,
            query_age_s=source.last_success_age_s,
            controller_state=lambda policy=policy: policy_state(policy),
            log=log.bind(pool=pool.name, holder_id=holder_id),
        )
    log.info(
        "daemon_configured",
        pools=[pool.name for pool in config.pools],
        holder_id=holder_id,
        redis=redact_url(config.redis.url),
        prometheus=config.prometheus.url,
        window=config.prometheus.window,
    )
    return Daemon(
        loops,
        {pool.name: pool.tick_s for pool in config.pools},
        metrics=metrics,
        notifier=notifier or Notifier(),
        log=log,
    )


def serve_metrics(listen: str, registry: CollectorRegistry) -> WSGIServer:
    """Serve `registry` at http://listen/metrics in a thread; the server (to shut down)."""
    host, _, port = listen.rpartition(":")
    server, _thread = start_http_server(int(port), addr=host.strip("[]") or "0.0.0.0",
                                        registry=registry)
    return server


def run(config: BorrowdConfig, stop: threading.Event, *, notifier: Notifier | None = None) -> None:
    """Run the daemon for `config` until `stop` is set; /metrics served meanwhile."""
    daemon = build_daemon(config, notifier=notifier)
    server = None
    if config.daemon.metrics_listen:
        server = serve_metrics(config.daemon.metrics_listen, daemon.metrics.registry)
    try:
        daemon.run_until(stop)
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
