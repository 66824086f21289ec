"""A pool whose proxy and engine series follow phases the test sets, for report tests.

Serves `borrowd_proxy_*` (labels pool, class) and `vllm:*` (labels model_name, engine; give
the scrape a target label `pool`) on free loopback ports, fed in a thread every
`feed_period_s` at the current `Phase`: interactive and batch request rates and tokens,
interactive TTFT and ITL, revocations, KV usage and running requests.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from borrowd.adapters.proxy.buckets import ITL_BUCKETS_S, TTFT_BUCKETS_S
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from tests.support.servers import free_port


@dataclass(frozen=True)
class Phase:
    """What the pool does per second while the phase lasts."""

    interactive_per_s: float
    batch_per_s: float
    ttft_s: float
    itl_s: float
    kv_usage_frac: float
    revocations_per_s: float = 0.0
    interactive_tokens: int = 100
    batch_tokens: int = 1000


class PhasedPool:
    """The series `borrowd report` reads, at the phase the test sets (`phase` attribute)."""

    def __init__(self, pool: str, phase: Phase, feed_period_s: float = 0.1) -> None:
        self.pool = pool
        self.phase = phase
        self.feed_period_s = feed_period_s
        self.proxy_registry = CollectorRegistry()
        self.vllm_registry = CollectorRegistry()
        r, v = self.proxy_registry, self.vllm_registry
        self.ttft = Histogram("borrowd_proxy_ttft_seconds", "TTFT", ["pool", "class"],
                              buckets=TTFT_BUCKETS_S, registry=r)
        self.itl = Histogram("borrowd_proxy_itl_seconds", "ITL", ["pool", "class"],
                             buckets=ITL_BUCKETS_S, registry=r)
        self.requests = Counter("borrowd_proxy_requests", "requests",
                                ["pool", "class", "outcome"], registry=r)
        self.tokens = Counter("borrowd_proxy_tokens", "tokens", ["pool", "class", "kind"],
                              registry=r)
        self.revocations = Counter("borrowd_proxy_revocations", "revocations", ["pool"],
                                   registry=r)
        self.kv = Gauge("vllm:kv_cache_usage_perc", "KV", ["model_name", "engine"], registry=v)
        self.running = Gauge("vllm:num_requests_running", "running", ["model_name", "engine"],
                             registry=v)
        self.preemptions = Counter("vllm:num_preemptions", "preemptions",
                                   ["model_name", "engine"], registry=v)
        self.proxy_port, self.vllm_port = free_port(), free_port()
        self._servers: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._feed, name="phased-pool", daemon=True)
        self._carry = {"interactive": 0.0, "batch": 0.0, "revocations": 0.0}

    @property
    def proxy_target(self) -> str:
        """host:port of the proxy series."""
        return f"127.0.0.1:{self.proxy_port}"

    @property
    def vllm_target(self) -> str:
        """host:port of the engine series."""
        return f"127.0.0.1:{self.vllm_port}"

    def start(self) -> PhasedPool:
        """Serve both endpoints and start feeding."""
        for port, registry in ((self.proxy_port, self.proxy_registry),
                               (self.vllm_port, self.vllm_registry)):
            server, _ = start_http_server(port, addr="127.0.0.1", registry=registry)
            self._servers.append(server)
        for klass in ("interactive", "batch"):
            for outcome in ("success", "error", "revoked"):
                self.requests.labels(self.pool, klass, outcome).inc(0)
            for kind in ("prompt", "output"):
                self.tokens.labels(self.pool, klass, kind).inc(0)
        self.revocations.labels(self.pool).inc(0)
        self.preemptions.labels("m", "0").inc(0)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop feeding and serving."""
        self._stop.set()
        self._thread.join(timeout=5)
        for server in self._servers:
            server.shutdown()
            server.server_close()

    def _due(self, name: str, per_s: float) -> int:
        self._carry[name] += per_s * self.feed_period_s
        whole = int(self._carry[name])
        self._carry[name] -= whole
        return whole

    def _feed(self) -> None:
        pool = self.pool
        while not self._stop.wait(self.feed_period_s):
            phase = self.phase
            for _ in range(self._due("interactive", phase.interactive_per_s)):
                self.ttft.labels(pool, "interactive").observe(phase.ttft_s)
                for _ in range(9):
                    self.itl.labels(pool, "interactive").observe(phase.itl_s)
                self.requests.labels(pool, "interactive", "success").inc()
                self.tokens.labels(pool, "interactive", "prompt").inc(
                    phase.interactive_tokens - 10)
                self.tokens.labels(pool, "interactive", "output").inc(10)
            for _ in range(self._due("batch", phase.batch_per_s)):
                self.requests.labels(pool, "batch", "success").inc()
                self.tokens.labels(pool, "batch", "prompt").inc(phase.batch_tokens - 100)
                self.tokens.labels(pool, "batch", "output").inc(100)
            revoked = self._due("revocations", phase.revocations_per_s)
            if revoked:
                self.revocations.labels(pool).inc(revoked)
                self.requests.labels(pool, "batch", "revoked").inc(revoked)
            self.kv.labels("m", "0").set(phase.kv_usage_frac)
            busy = phase.interactive_per_s + phase.batch_per_s > 0
            self.running.labels("m", "0").set(3 if busy else 0)
