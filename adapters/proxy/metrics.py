"""The proxy's Prometheus metrics, per pool and class: what the daemon reads as its sensor.

Names and labels are a contract with the daemon (see the team brief); TTFT and ITL use
vLLM's bucket boundaries plus a bound at each of the pool's SLOs (`proxy.slo_ttft_s`,
`proxy.slo_itl_s`: the daemon reads the share of samples above the pool's SLO at exactly that
`le`), and say whether the upstream that served the request may take
batch (`batch_eligible`: "true" on every upstream unless `batch_upstreams` restricts batch),
so the daemon's rules read the interactive latency of the replicas batch can touch.
`InflightTracker` keeps the requests still waiting for a first token, so
`borrowd_proxy_oldest_wait_seconds` and `borrowd_proxy_late_waiters` (how many have waited
past each bound of the TTFT histogram, SLOs included, label `slo` spelt as its `le`: first
tokens already certain to be late, which the histogram cannot count until they come) are
computed at scrape time.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterator, Sequence

from borrowd.adapters.proxy.buckets import (
    ITL_BUCKETS_S,
    REQUEST_LATENCY_BUCKETS_S,
    TTFT_BUCKETS_S,
    with_slo_bounds,
)
from borrowd.adapters.proxy.config import RequestClass
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

OUTCOMES = ("success", "error", "rejected", "revoked", "truncated", "client_disconnect",
            "timeout")
CLASSES = tuple(c.value for c in RequestClass)


class InflightTracker:
    """Start times of in-flight requests per class that have no first token yet.

    Dicts keep insertion order, so the first entry is the oldest waiter.
    """

    def __init__(self) -> None:
        self._waiting: dict[str, dict[str, float]] = {c: {} for c in CLASSES}

    def waiting(self, request_class: str, request_id: str, started_s: float) -> None:
        """Mark `request_id` as waiting for its first token since `started_s`."""
        self._waiting[request_class][request_id] = started_s

    def settled(self, request_class: str, request_id: str) -> None:
        """`request_id` got its first token or ended."""
        self._waiting[request_class].pop(request_id, None)

    def oldest_wait_s(self, request_class: str, now_s: float) -> float:
        """Age of the oldest waiter of the class (0 when none)."""
        for started_s in self._waiting[request_class].values():
            return max(0.0, now_s - started_s)
        return 0.0

    def waits_s(self, request_class: str, now_s: float) -> list[float]:
        """How long each waiter of the class has waited, ascending."""
        return sorted(now_s - started_s for started_s in self._waiting[request_class].values())


class _WaitersCollector(Collector):
    """The oldest wait and the late waiters of each class, computed at scrape time."""

    def __init__(self, pool: str, tracker: InflightTracker, clock: Callable[[], float],
                 bounds_s: Sequence[float]) -> None:
        self._pool = pool
        self._tracker = tracker
        self._clock = clock
        self._bounds_s = tuple(bounds_s)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """Yield the oldest-wait gauge per class and the late waiters per class and TTFT
        SLO bound, computed at scrape time."""
        oldest = GaugeMetricFamily(
            "borrowd_proxy_oldest_wait_seconds",
            "Age of the oldest in-flight request still waiting for its first token (0 if none).",
            labels=["pool", "class"],
        )
        late = GaugeMetricFamily(
            "borrowd_proxy_late_waiters",
            "In-flight requests that have waited longer than `slo` seconds (each TTFT "
            "histogram bound) for their first token.",
            labels=["pool", "class", "slo"],
        )
        now_s = self._clock()
        for klass in CLASSES:
            oldest.add_metric([self._pool, klass], self._tracker.oldest_wait_s(klass, now_s))
            waits = self._tracker.waits_s(klass, now_s)
            for bound_s in self._bounds_s:
                late.add_metric([self._pool, klass, floatToGoString(bound_s)],
                                len(waits) - bisect.bisect_right(waits, bound_s))
        yield oldest
        yield late


class ProxyMetrics:
    """Every proxy metric, with label children bound once per class for the hot path; TTFT
    and ITL have a bound at each of `slo_ttft_s` / `slo_itl_s` (seconds) besides vLLM's."""

    def __init__(
        self,
        pool: str,
        registry: CollectorRegistry,
        clock: Callable[[], float] = time.monotonic,
        *,
        slo_ttft_s: Sequence[float] = (),
        slo_itl_s: Sequence[float] = (),
    ) -> None:
        self.registry = registry
        self.tracker = InflightTracker()
        ttft_bounds_s = with_slo_bounds(TTFT_BUCKETS_S, slo_ttft_s)
        ttft = Histogram("borrowd_proxy_ttft_seconds",
                         "Time from request arrival at the proxy to the first token.",
                         ["pool", "class", "batch_eligible"], registry=registry,
                         buckets=ttft_bounds_s)
        itl = Histogram("borrowd_proxy_itl_seconds",
                        "Gap between consecutive streamed token chunks.",
                        ["pool", "class", "batch_eligible"], registry=registry,
                        buckets=with_slo_bounds(ITL_BUCKETS_S, slo_itl_s))
        requests = Counter("borrowd_proxy_requests_total", "Requests by final outcome.",
                           ["pool", "class", "outcome"], registry=registry)
        tokens = Counter("borrowd_proxy_tokens_total", "Tokens by kind (prompt, output).",
                         ["pool", "class", "kind"], registry=registry)
        queue = Histogram("borrowd_proxy_queue_seconds",
                          "Time a request waited for admission.", ["pool", "class"],
                          registry=registry, buckets=REQUEST_LATENCY_BUCKETS_S)
        revocations = Counter("borrowd_proxy_revocations_total",
                              "Batch streams ended by a revocation.", ["pool"],
                              registry=registry)
        inflight = Gauge("borrowd_proxy_inflight", "Requests in flight.", ["pool", "class"],
                         registry=registry)
        registry.register(_WaitersCollector(pool, self.tracker, clock, ttft_bounds_s))

        # keyed by (class, whether the serving upstream may take batch)
        self.ttft = {(c, e): ttft.labels(pool, c, _flag(e)) for c in CLASSES
                     for e in (True, False)}
        self.itl = {(c, e): itl.labels(pool, c, _flag(e)) for c in CLASSES
                    for e in (True, False)}
        self.queue = {c: queue.labels(pool, c) for c in CLASSES}
        self.inflight = {c: inflight.labels(pool, c) for c in CLASSES}
        self.requests = {(c, o): requests.labels(pool, c, o) for c in CLASSES for o in OUTCOMES}
        self.prompt_tokens = {c: tokens.labels(pool, c, "prompt") for c in CLASSES}
        self.output_tokens = {c: tokens.labels(pool, c, "output") for c in CLASSES}
        self.revocations = revocations.labels(pool)

    def finished(self, request_class: str, outcome: str, prompt_tokens: int,
                 output_tokens: int) -> None:
        """Count one finished request and its tokens."""
        self.requests[(request_class, outcome)].inc()
        if prompt_tokens:
            self.prompt_tokens[request_class].inc(prompt_tokens)
        if output_tokens:
            self.output_tokens[request_class].inc(output_tokens)


def _flag(value: bool) -> str:
    """A boolean as a label value."""
    return "true" if value else "false"
