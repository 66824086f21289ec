"""The rollout ceiling as the law's upper limit (anti-windup): the daemon loop reads it from
the store each tick and the policy applies it before the law is told what was applied."""

from __future__ import annotations

from dataclasses import replace

from borrowd.controller.loop import PoolLoop
from borrowd.controller.loop_metrics import DaemonMetrics
from borrowd.controller.policy import ControllerConfig, ControllerPolicy, build_policy
from borrowd.models.budget import Budget
from borrowd.models.errors import StoreError
from borrowd.models.rollout import apply_ceiling
from borrowd.models.signals import Observation

CEILING = 10_000.0


def healthy(now_s: float, carried_tokens_per_s: float, **over: float) -> Observation:
    """Every signal well inside its SLO, with the batch rate the last budget carried."""
    base = dict(age_s=0.5, ttft_p95_s=0.2, itl_p95_s=0.01, success_rate=1.0, kv_usage_frac=0.3,
                interactive_queue_depth=0.0, interactive_oldest_wait_s=0.05,
                interactive_tokens_per_s=1000.0, interactive_requests=20.0,
                batch_tokens_per_s=carried_tokens_per_s, itl_over_slo_frac=0.0,
                ttft_over_slo_frac=0.0, window_s=5.0, itl_samples=1000.0, ttft_samples=100.0)
    base.update(over)
    return Observation(now_s=now_s, **base)


def run(policy: ControllerPolicy, ticks: range, ceiling_in_law: float | None,
        ceiling_at_publish: float | None, **over: float) -> list[Budget]:
    """Tick `policy` on healthy signals (overridden by `over`); the published budgets."""
    published: list[Budget] = []
    carried = policy.u_applied
    for t in ticks:
        decision = policy.step(healthy(float(t), carried, **over), float(t),
                               ceiling_tokens_per_s=ceiling_in_law)
        budget = apply_ceiling(decision.budget, ceiling_at_publish)
        carried = budget.batch_tokens_per_s
        published.append(budget)
    return published


def test_law_state_stays_at_the_ceiling() -> None:
    """Below a ceiling the law would pass, the applied budget and the law's state sit at the
    ceiling; without it the same law climbs to u_max."""
    capped = build_policy(ControllerConfig(), "p", None)
    budgets = run(capped, range(200), CEILING, CEILING)
    assert max(b.batch_tokens_per_s for b in budgets) == CEILING
    assert capped.u_applied == CEILING and budgets[-1].batch_tokens_per_s == CEILING
    assert "rollout ceiling 10000" in budgets[-1].reason
    free = build_policy(ControllerConfig(), "p", None)
    run(free, range(200), None, None)
    assert free.u_applied == ControllerConfig().u_max_tokens_per_s


def test_budget_follows_a_raised_ceiling_at_once() -> None:
    """Raising the ceiling: the budget rises above the old one on the next tick or the one
    after, and keeps climbing."""
    policy = build_policy(ControllerConfig(), "p", None)
    run(policy, range(200), CEILING, CEILING)
    after = run(policy, range(200, 210), 2 * CEILING, 2 * CEILING)
    assert max(b.batch_tokens_per_s for b in after[:2]) > CEILING
    rates = [b.batch_tokens_per_s for b in after]
    assert rates == sorted(rates) and rates[-1] > rates[0]


def test_a_burn_under_the_ceiling_cuts_without_an_unwind() -> None:
    """A mild ITL burn (under the supervisor's cut) lowers the budget within 3 ticks when the
    law saw the ceiling; a law wound up above a ceiling applied only at publish takes 3 times
    as long to bring the published budget down."""

    def ticks_to_cut(ceiling_in_law: float | None) -> int:
        policy = build_policy(ControllerConfig(), "p", None)
        run(policy, range(200), ceiling_in_law, CEILING)
        burning = run(policy, range(200, 240), ceiling_in_law, CEILING, itl_over_slo_frac=0.06)
        return next(i for i, b in enumerate(burning) if b.batch_tokens_per_s < CEILING)

    in_law = ticks_to_cut(CEILING)
    at_publish_only = ticks_to_cut(None)
    assert in_law <= 3
    assert at_publish_only >= 3 * in_law


class Policy:
    """Records the ceiling each tick handed it; decides the budget of a real policy."""

    tick_s = 1.0

    def __init__(self) -> None:
        self.inner = build_policy(ControllerConfig(), "chat", None)
        self.ceilings: list[float | None] = []

    def step(self, obs: Observation, now_s: float, *, stopped: bool = False,
             ceiling_tokens_per_s: float | None = None):
        self.ceilings.append(ceiling_tokens_per_s)
        return self.inner.step(obs, now_s, stopped=stopped,
                               ceiling_tokens_per_s=ceiling_tokens_per_s)


class Store:
    """A store whose ceiling is set by the test and whose reads can fail."""

    def __init__(self) -> None:
        self.ceiling: float | None = None
        self.down = False

    def publish(self, budget: Budget, *, epoch: int, ttl_ms: int, now_s: float) -> Budget:
        return budget.with_envelope(epoch=epoch, seq=1, issued_at_s=now_s, ttl_ms=ttl_ms)

    def stop_reason(self) -> str | None:
        return None

    def ceiling_tokens_per_s(self) -> float | None:
        if self.down:
            raise StoreError("ConnectionError: Redis is down")
        return self.ceiling


class Election:
    def try_acquire(self) -> int | None:
        return 1

    def renew(self) -> bool:
        return True

    def release(self) -> None:
        return None


class Source:
    def observe(self, pool: str, now_s: float) -> Observation:
        return replace(healthy(now_s, 0.0), batch_tokens_per_s=float("nan"))


def test_the_daemon_loop_hands_the_stored_ceiling_to_the_policy() -> None:
    """Each tick passes the store's ceiling (unset: None); a failed read keeps the last one
    read and is counted as a store error."""
    policy, store = Policy(), Store()
    metrics = DaemonMetrics()
    loop = PoolLoop("chat", ttl_ms=5000, source=Source(), policy=policy, store=store,
                    election=Election(), metrics=metrics, query_age_s=lambda _p, _t: 0.0)
    loop.tick(0.0)
    store.ceiling = 5000.0
    loop.tick(1.0)
    store.down = True
    loop.tick(2.0)
    assert policy.ceilings == [None, 5000.0, 5000.0]
    assert metrics.errors.labels("chat", "redis", "ceiling")._value.get() == 1.0
