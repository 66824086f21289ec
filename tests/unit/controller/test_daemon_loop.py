"""The daemon loop with fakes: leadership, fencing, stop switch, metrics, logs, health."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
from apscheduler.events import EVENT_JOB_MAX_INSTANCES, EVENT_JOB_MISSED, JobEvent
from borrowd.controller.daemon import Daemon
from borrowd.controller.loop import PoolLoop
from borrowd.controller.loop_metrics import FOLLOWER, LEADER, DaemonMetrics
from borrowd.controller.sdnotify import Notifier
from borrowd.models.budget import Budget, Mode, closed_budget
from borrowd.models.errors import FencedError, StoreError
from borrowd.models.signals import Observation
from prometheus_client import generate_latest
from structlog.testing import capture_logs

OPEN = Budget(pool="chat", mode=Mode.OPEN, reason="quiet", batch_tokens_per_s=5000.0,
              batch_burst_tokens=10000, max_batch_seqs=4, max_batch_kv_tokens=50000,
              max_batch_output_tokens=512)


class FakeSource:
    """Returns one fixed observation per call and counts calls."""

    def __init__(self) -> None:
        self.calls = 0

    def observe(self, pool: str, now_s: float) -> Observation:
        self.calls += 1
        return Observation(now_s=now_s, age_s=0.5, ttft_p95_s=0.3, itl_p95_s=0.02)


@dataclass(frozen=True)
class FakeEvent:
    from_mode: Mode
    to_mode: Mode
    reason: str


@dataclass(frozen=True)
class FakeDecision:
    budget: Budget
    u_law: float
    events: tuple = ()


class FakePolicy:
    """Decides the budgets it is given, in order; records the `stopped` flag it saw."""

    tick_s = 1.0

    def __init__(self, budgets: list[Budget], events: list[tuple] | None = None) -> None:
        self.budgets = budgets
        self.events = events or []
        self.stopped: list[bool] = []

    def step(self, obs: Observation, now_s: float, *, stopped: bool = False,
             ceiling_tokens_per_s: float | None = None) -> FakeDecision:
        self.stopped.append(stopped)
        budget = self.budgets[min(len(self.stopped), len(self.budgets)) - 1]
        events = self.events[len(self.stopped) - 1] if len(self.stopped) <= len(self.events) else ()
        return FakeDecision(budget, budget.batch_tokens_per_s, tuple(events))


@dataclass
class FakeStore:
    """Stores published budgets with an envelope; can refuse (fenced) or fail (store down)."""

    published: list[Budget] = field(default_factory=list)
    fence_at_epoch: int | None = None
    down: bool = False
    stop: str | None = None

    def publish(self, budget: Budget, *, epoch: int, ttl_ms: int, now_s: float) -> Budget:
        if self.down:
            raise StoreError("ConnectionError: Redis is down")
        if self.fence_at_epoch is not None and epoch < self.fence_at_epoch:
            raise FencedError(budget.pool, epoch, self.fence_at_epoch)
        stored = budget.with_envelope(epoch=epoch, seq=len(self.published) + 1,
                                      issued_at_s=now_s, ttl_ms=ttl_ms)
        self.published.append(stored)
        return stored

    def stop_reason(self) -> str | None:
        if self.down:
            raise StoreError("ConnectionError: Redis is down")
        return self.stop

    def ceiling_tokens_per_s(self) -> float | None:
        if self.down:
            raise StoreError("ConnectionError: Redis is down")
        return None


@dataclass
class FakeElection:
    """Scripted election: `acquire` answers of try_acquire in order, `renew_ok` for renew."""

    acquire: list[int | None] = field(default_factory=lambda: [7])
    renew_ok: bool = True
    down: bool = False
    released: int = 0
    calls: list[str] = field(default_factory=list)

    def try_acquire(self) -> int | None:
        self.calls.append("acquire")
        if self.down:
            raise StoreError("ConnectionError: Redis is down")
        return self.acquire.pop(0) if len(self.acquire) > 1 else self.acquire[0]

    def renew(self) -> bool:
        self.calls.append("renew")
        if self.down:
            raise StoreError("ConnectionError: Redis is down")
        return self.renew_ok

    def release(self) -> None:
        self.released += 1


def make_loop(policy=None, store=None, election=None, metrics=None) -> PoolLoop:
    """A loop for pool `chat` over fakes (defaults: an open budget, an electable lease)."""
    return PoolLoop(
        "chat",
        ttl_ms=3000,
        source=FakeSource(),
        policy=policy or FakePolicy([OPEN]),
        store=store or FakeStore(),
        election=election or FakeElection(),
        metrics=metrics or DaemonMetrics(),
        query_age_s=lambda pool, now_s: 0.25,
        controller_state=lambda: {"u_applied_tokens_per_s": 5000.0},
    )


def sample(metrics: DaemonMetrics, metric: str, **labels: str) -> float:
    """Current value of one exported sample."""
    value = metrics.registry.get_sample_value(metric, labels)
    assert value is not None, (metric, labels)
    return value


def test_leader_publishes_with_its_epoch_and_lease() -> None:
    """The lease holder publishes the decided budget under its epoch with the pool's TTL."""
    store = FakeStore()
    loop = make_loop(store=store)
    report = loop.tick(100.0)
    assert report.role == LEADER and report.published
    assert [(b.epoch, b.ttl_ms, b.issued_at_s) for b in store.published] == [(7, 3000, 100.0)]
    assert report.budget.seq == 1


def test_follower_decides_but_never_publishes() -> None:
    """Without the lease the loop still observes and decides (warm state) but writes nothing."""
    store = FakeStore()
    policy = FakePolicy([OPEN])
    loop = make_loop(policy=policy, store=store, election=FakeElection(acquire=[None]))
    for now_s in (1.0, 2.0, 3.0):
        report = loop.tick(now_s)
    assert report.role == FOLLOWER and not report.published
    assert store.published == []
    assert len(policy.stopped) == 3


def test_leader_renews_instead_of_reacquiring() -> None:
    """Once leading, each tick renews the lease; try_acquire is only used to become leader."""
    election = FakeElection()
    loop = make_loop(election=election)
    loop.tick(1.0)
    loop.tick(2.0)
    loop.tick(3.0)
    assert election.calls == ["acquire", "renew", "renew"]


def test_lost_lease_makes_a_follower_and_is_logged() -> None:
    """A failed renewal with the lease now elsewhere: no publish, a leadership_lost event."""
    election = FakeElection(acquire=[7, None])
    store = FakeStore()
    loop = make_loop(store=store, election=election)
    loop.tick(1.0)
    election.renew_ok = False
    with capture_logs() as logs:
        report = loop.tick(2.0)
    assert report.role == FOLLOWER and len(store.published) == 1
    assert any(e["event"] == "leadership_lost" and e["epoch"] == 7 for e in logs)


def test_fenced_write_demotes_and_counts() -> None:
    """A write refused for an older epoch makes the loop a follower and counts the fence."""
    metrics = DaemonMetrics()
    store = FakeStore(fence_at_epoch=8)
    loop = make_loop(store=store, metrics=metrics, election=FakeElection(acquire=[7, None]))
    report = loop.tick(1.0)
    assert report.role == FOLLOWER and not report.published
    assert sample(metrics, "borrowd_errors_total", pool="chat", source="redis", kind="fenced") == 1
    assert loop.tick(2.0).role == FOLLOWER


def test_redis_down_is_counted_not_raised() -> None:
    """Redis failures in election or publish are counted; the tick still completes."""
    metrics = DaemonMetrics()
    election = FakeElection(down=True)
    loop = make_loop(metrics=metrics, election=election, store=FakeStore(down=True))
    report = loop.tick(1.0)
    assert report.role == FOLLOWER
    assert sample(metrics, "borrowd_errors_total", pool="chat", source="redis",
                  kind="election") == 1
    election.down = False
    report = loop.tick(2.0)
    assert report.role == LEADER and not report.published
    assert sample(metrics, "borrowd_errors_total", pool="chat", source="redis",
                  kind="publish") == 1


def test_stop_switch_reaches_the_policy() -> None:
    """While the operator's stop switch is set the policy is told `stopped`."""
    store = FakeStore(stop="maintenance")
    policy = FakePolicy([closed_budget("chat", Mode.STOPPED, "operator stop: maintenance")])
    report = make_loop(policy=policy, store=store).tick(1.0)
    assert policy.stopped == [True]
    assert report.stop_reason == "maintenance"
    assert store.published[0].mode == Mode.STOPPED


def test_metrics_carry_budget_mode_leader_and_state() -> None:
    """/metrics shows the budget, the one-hot mode, leadership, epoch, age and law state."""
    metrics = DaemonMetrics()
    make_loop(metrics=metrics).tick(1.0)
    assert sample(metrics, "borrowd_budget_tokens_per_s", pool="chat") == 5000.0
    assert sample(metrics, "borrowd_mode", pool="chat", mode="open") == 1.0
    assert sample(metrics, "borrowd_mode", pool="chat", mode="failsafe") == 0.0
    assert sample(metrics, "borrowd_leader", pool="chat") == 1.0
    assert sample(metrics, "borrowd_epoch", pool="chat") == 7.0
    assert sample(metrics, "borrowd_last_successful_query_age_seconds", pool="chat") == 0.25
    assert sample(metrics, "borrowd_observed", pool="chat", signal="ttft_p95_s") == 0.3
    assert math.isnan(sample(metrics, "borrowd_observed", pool="chat", signal="kv_usage_frac"))
    assert sample(metrics, "borrowd_controller_state", pool="chat",
                  name="u_applied_tokens_per_s") == 5000.0
    assert sample(metrics, "borrowd_tick_duration_seconds_count", pool="chat") == 1.0
    assert b'borrowd_budgets_published_total{pool="chat"} 1.0' in generate_latest(metrics.registry)


def test_every_tick_and_mode_change_is_logged() -> None:
    """Each tick logs its decision; each supervisor transition logs a mode_change."""
    policy = FakePolicy(
        [OPEN, closed_budget("chat", Mode.CLOSED, "ttft burning")],
        events=[[], [FakeEvent(Mode.OPEN, Mode.CLOSED, "ttft burning")]],
    )
    loop = make_loop(policy=policy)
    loop.tick(1.0)
    with capture_logs() as logs:
        loop.tick(2.0)
    ticks = [e for e in logs if e["event"] == "tick"]
    changes = [e for e in logs if e["event"] == "mode_change"]
    assert ticks[0]["mode"] == "closed" and ticks[0]["batch_tokens_per_s"] == 0.0
    assert ticks[0]["observed"]["ttft_p95_s"] == 0.3
    assert ticks[0]["observed"]["kv_usage_frac"] is None
    assert [(c["from_mode"], c["to_mode"], c["reason"]) for c in changes] == [
        ("open", "closed", "ttft burning")
    ]


def test_shutdown_releases_only_a_held_lease() -> None:
    """SIGTERM path: the leader releases its lease once; a follower releases nothing."""
    election = FakeElection()
    metrics = DaemonMetrics()
    leader = make_loop(election=election, metrics=metrics)
    leader.tick(1.0)
    leader.shutdown()
    leader.shutdown()
    assert election.released == 1
    assert sample(metrics, "borrowd_leader", pool="chat") == 0.0
    follower_election = FakeElection(acquire=[None])
    follower = make_loop(election=follower_election)
    follower.tick(1.0)
    follower.shutdown()
    assert follower_election.released == 0


class StepClock:
    """A clock the test sets."""

    def __init__(self, now_s: float) -> None:
        self.now = now_s

    def now_s(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("last_tick_s", "now_s", "healthy"),
    [(None, 102.0, True), (None, 104.0, False), (110.0, 112.5, True), (110.0, 113.5, False)],
    ids=["starting", "never-ticked", "recent-tick", "stalled"],
)
def test_watchdog_health_needs_a_tick_within_three_periods(
    last_tick_s: float | None, now_s: float, healthy: bool
) -> None:
    """The watchdog is only fed while every pool completed a tick within 3 ticks."""
    loop = make_loop()
    loop.last_tick_done_s = last_tick_s
    daemon = Daemon({"chat": loop}, {"chat": 1.0}, metrics=DaemonMetrics(),
                    clock=StepClock(100.0), notifier=Notifier({}))
    assert daemon.healthy(now_s) is healthy


@pytest.mark.parametrize(
    ("code", "kind", "event"),
    [(EVENT_JOB_MAX_INSTANCES, "overrun", "tick_overrun"),
     (EVENT_JOB_MISSED, "misfire", "tick_misfire")],
    ids=["overrun", "misfire"],
)
def test_scheduler_overruns_and_misfires_are_counted(code: int, kind: str, event: str) -> None:
    """A skipped (still running) or late tick is counted per pool and logged."""
    metrics = DaemonMetrics()
    daemon = Daemon({"chat": make_loop()}, {"chat": 1.0}, metrics=metrics,
                    clock=StepClock(0.0), notifier=Notifier({}))
    with capture_logs() as logs:
        daemon._on_event(JobEvent(code, "chat", None))
    assert sample(metrics, "borrowd_errors_total", pool="chat", source="scheduler",
                  kind=kind) == 1
    assert [e["event"] for e in logs] == [event]
