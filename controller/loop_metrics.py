"""The daemon loop's own Prometheus metrics (`borrowd_*`), in a registry of their own.

`controller.loop.PoolLoop` records each tick here; the CLI edge serves the registry at
`/metrics`.
"""

from __future__ import annotations

from dataclasses import fields

from borrowd.models.signals import Observation
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LEADER = "leader"
FOLLOWER = "follower"

# Observation fields exported as `borrowd_observed{signal=...}`.
OBSERVED_SIGNALS = tuple(
    f.name for f in fields(Observation) if f.name not in ("now_s",)
)


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
