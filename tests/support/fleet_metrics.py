"""A fake fleet's metrics for daemon tests: the proxy's and vLLM's series, levels set by the test.

Serves `borrowd_proxy_*` (labels pool, class) and `vllm:*` (labels model_name, engine) from
two prometheus_client registries on free loopback ports, and feeds the histograms in a thread
at the interactive latency the test sets, so a real Prometheus scrapes a fleet whose state
the test controls exactly.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from tests.support.servers import free_port

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)


@dataclass
class FleetLevels:
    """What the fake fleet reports: interactive latencies, KV usage, queue, oldest wait."""

    ttft_s: float = 0.1
    itl_s: float = 0.02
    kv_usage_frac: float = 0.3
    waiting: int = 0
    oldest_wait_s: float = 0.0
    requests_per_s: float = 20.0


class FakeFleetMetrics:
    """The series the daemon's recording rules read, for one pool, at test-set levels."""

    def __init__(self, pool: str = "chat", feed_period_s: float = 0.1) -> None:
        self.pool = pool
        self.levels = FleetLevels()
        self.feed_period_s = feed_period_s
        self.registry = CollectorRegistry()
        self.vllm_registry = CollectorRegistry()
        r = self.registry
        v = self.vllm_registry
        self.ttft = Histogram("borrowd_proxy_ttft_seconds", "TTFT", ["pool", "class"],
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("borrowd_proxy_itl_seconds", "ITL", ["pool", "class"],
                             buckets=ITL_BUCKETS, registry=r)
        self.requests = Counter("borrowd_proxy_requests", "requests",
                                ["pool", "class", "outcome"], registry=r)
        self.tokens = Counter("borrowd_proxy_tokens", "tokens", ["pool", "class", "kind"],
                              registry=r)
        self.inflight = Gauge("borrowd_proxy_inflight", "in flight", ["pool", "class"],
                              registry=r)
        self.oldest = Gauge("borrowd_proxy_oldest_wait_seconds", "oldest wait",
                            ["pool", "class"], registry=r)
        self.kv = Gauge("vllm:kv_cache_usage_perc", "KV usage", ["model_name", "engine"],
                        registry=v)
        self.waiting = Gauge("vllm:num_requests_waiting", "waiting", ["model_name", "engine"],
                             registry=v)
        self.preemptions = Counter("vllm:num_preemptions", "preemptions",
                                   ["model_name", "engine"], registry=v)
        # One engine of an 8B model on an 80 GB GPU, sized as vLLM reports it (the batch KV
        # cap is a share of this capacity).
        Gauge("vllm:cache_config_info", "cache config", ["block_size", "num_gpu_blocks",
              "engine"], registry=v).labels("16", "24750", "0").set(1)
        self.port = free_port()
        self.vllm_port = free_port()
        self._servers: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._feed, name="fake-fleet", daemon=True)

    @property
    def proxy_target(self) -> str:
        """host:port of the proxy's series, for a Prometheus scrape config."""
        return f"127.0.0.1:{self.port}"

    @property
    def vllm_target(self) -> str:
        """host:port of the engines' series (scrape with target label `pool`)."""
        return f"127.0.0.1:{self.vllm_port}"

    def start(self) -> FakeFleetMetrics:
        """Serve both /metrics endpoints and start feeding."""
        for port, registry in ((self.port, self.registry), (self.vllm_port, self.vllm_registry)):
            server, _ = start_http_server(port, addr="127.0.0.1", registry=registry)
            self._servers.append(server)
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

    def _feed(self) -> None:
        pool = self.pool
        while not self._stop.wait(self.feed_period_s):
            levels = self.levels
            count = max(1, round(levels.requests_per_s * self.feed_period_s))
            for _ in range(count):
                self.ttft.labels(pool, "interactive").observe(levels.ttft_s)
                for _ in range(10):
                    self.itl.labels(pool, "interactive").observe(levels.itl_s)
                self.requests.labels(pool, "interactive", "success").inc()
                self.tokens.labels(pool, "interactive", "prompt").inc(500)
                self.tokens.labels(pool, "interactive", "output").inc(10)
            self.inflight.labels(pool, "interactive").set(count)
            self.inflight.labels(pool, "batch").set(0)
            self.oldest.labels(pool, "interactive").set(levels.oldest_wait_s)
            for engine in ("0", "1"):
                self.kv.labels("m", engine).set(levels.kv_usage_frac)
                self.waiting.labels("m", engine).set(levels.waiting)
