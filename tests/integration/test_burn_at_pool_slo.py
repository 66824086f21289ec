"""The daemon's Prometheus source reads the SLO burn at each pool's own SLO, from a real
Prometheus scraping real exporters.

Pool `chat` has SLOs of 7.5 ms (ITL, below vLLM's smallest ITL bound, 10 ms) and 0.3 s
(TTFT, between vLLM's 0.25 and 0.5): its proxy and engine are configured with those bounds.
Known samples are fed once: 80 of 1000 interactive gaps at 9 ms (above 7.5 ms, below every
vLLM bound but none), 5 of 50 first tokens at 0.4 s, and on the engine 30 of the 40 gaps above
7.5 ms in steps carrying batch tokens. The source reads 8%, 10% and 75%, with the sample
counts, over both windows; the default-SLO recording rule (50 ms) reads 0 for the same gaps.
Pool `old` (a proxy without the bounds) and pool `mixed` (one proxy with, one without) read
no share, the samples still counted, and a `missing_bound` error naming the metric.
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

import pytest
from borrowd.adapters.interference import InterferenceMetrics
from borrowd.adapters.proxy.metrics import ProxyMetrics
from borrowd.controller.prom_source import (
    MISSING_BOUND,
    PrometheusSource,
    bound_queries,
    connect_prometheus,
    range_parts,
    read_bound,
)
from borrowd.models.signals import Slo
from prometheus_client import CollectorRegistry, start_http_server

from tests.support.daemon_harness import RULES
from tests.support.servers import ServerProcess, free_port, start_prometheus

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs prometheus"),
]

SLO = Slo(ttft_p95_s=0.3, itl_p95_s=0.0075)
SCRAPE_S = 0.5
BURN_FIELDS = ("itl_over_slo_frac", "ttft_over_slo_frac", "itl_over_slo_batch_frac")


@dataclass
class Exporter:
    """One registry served on a loopback port."""

    registry: CollectorRegistry
    target: str
    server: WSGIServer


def _serve(registry: CollectorRegistry) -> Exporter:
    port = free_port()
    server, _thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    return Exporter(registry, f"127.0.0.1:{port}", server)


def _proxy(pool: str, with_bounds: bool) -> tuple[ProxyMetrics, Exporter]:
    registry = CollectorRegistry()
    slos = {"slo_ttft_s": (SLO.ttft_p95_s,), "slo_itl_s": (SLO.itl_p95_s,)} if with_bounds else {}
    metrics = ProxyMetrics(pool, registry, **slos)
    return metrics, _serve(registry)


def _feed_proxy(metrics: ProxyMetrics) -> None:
    """1000 interactive gaps, 80 of them at 9 ms; 50 first tokens, 5 of them at 0.4 s."""
    itl, ttft = metrics.itl[("interactive", True)], metrics.ttft[("interactive", True)]
    for index in range(1000):
        itl.observe(0.009 if index % 25 < 2 else 0.005)
    for index in range(50):
        ttft.observe(0.4 if index % 10 == 0 else 0.2)


def _feed_engine(metrics: InterferenceMetrics) -> None:
    """Gaps above 7.5 ms: 30 in steps carrying batch, 10 in clean steps (none above 50 ms)."""
    metrics.step(carried_batch=True, itl_gaps_s=[0.009] * 30 + [0.005] * 50,
                 interactive_waiting=0, step_s=0.01)
    metrics.step(carried_batch=False, itl_gaps_s=[0.009] * 10 + [0.005] * 200,
                 interactive_waiting=0, step_s=0.01)


@pytest.fixture(scope="module")
def fed() -> Iterator[tuple[ServerProcess, dict[str, PrometheusSource], list]]:
    """The exporters scraped every 0.5 s with the shipped rules, fed once after their first
    scrapes; a source per window, each pool at SLO."""
    chat, chat_exporter = _proxy("chat", True)
    old, old_exporter = _proxy("old", False)
    mixed_new, mixed_new_exporter = _proxy("mixed", True)
    mixed_old, mixed_old_exporter = _proxy("mixed", False)
    engine_registry = CollectorRegistry()
    engine = InterferenceMetrics(engine_registry, "m", "0", slo_itl_s=(SLO.itl_p95_s,))
    engine_exporter = _serve(engine_registry)
    exporters = [chat_exporter, old_exporter, mixed_new_exporter, mixed_old_exporter,
                 engine_exporter]
    prometheus = start_prometheus(
        {"proxy": [e.target for e in exporters[:4]], "engine": [engine_exporter.target]},
        scrape_interval_s=SCRAPE_S, rule_files=[RULES], target_labels={"engine": {"pool": "chat"}},
    )
    errors: list = []
    client = connect_prometheus(prometheus.extra["url"], 5.0)
    slos = {pool: SLO for pool in ("chat", "old", "mixed")}
    sources = {window: PrometheusSource(client, window=window, timeout_s=5.0, slos=slos,
                                        on_error=lambda *e: errors.append(e))
               for window in ("15s", "1m")}
    try:
        _wait_for_series(client, len(exporters))
        time.sleep(4 * SCRAPE_S)  # a few samples of the empty histograms before the feed
        for metrics in (chat, old, mixed_new, mixed_old):
            _feed_proxy(metrics)
        _feed_engine(engine)
        time.sleep(6 * SCRAPE_S)  # the last samples in the window are after the feed
        yield prometheus, sources, errors
    finally:
        prometheus.stop()
        for exporter in exporters:
            exporter.server.shutdown()


def _wait_for_series(client, targets: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if len(client.custom_query("up == 1")) == targets:
            return
        time.sleep(SCRAPE_S)
    raise AssertionError(f"not every one of {targets} exporters scraped within {timeout_s} s")


@pytest.mark.parametrize("window", ["15s", "1m"])
def test_burn_is_read_at_the_pools_own_slo(fed, window: str) -> None:
    """At 7.5 ms / 0.3 s the source reads the shares fed (8%, 10%, batch 75%) with their
    sample counts (the window's increase, extrapolated by Prometheus at most 15%)."""
    _, sources, errors = fed
    errors.clear()
    obs = sources[window].observe("chat", time.time())
    assert [e for e in errors if e[1] in BURN_FIELDS] == []
    assert obs.itl_over_slo_frac == pytest.approx(0.08, rel=1e-6)
    assert obs.ttft_over_slo_frac == pytest.approx(0.10, rel=1e-6)
    assert obs.itl_over_slo_batch_frac == pytest.approx(0.75, rel=1e-6)
    assert 1000.0 <= obs.itl_samples <= 1150.0
    assert 50.0 <= obs.ttft_samples <= 57.5


def test_the_burn_history_reads_the_same_shares_over_a_range(fed) -> None:
    """`borrowd identify --prometheus` reads the burn history with the daemon's own bound
    queries over a range (`range_parts`, then `read_bound`): its last sample reads the
    shares fed, as the instant read does."""
    prometheus, _, _ = fed
    client = connect_prometheus(prometheus.extra["url"], 5.0)
    now = time.time()
    expected = {"itl_over_slo_frac": 0.08, "ttft_over_slo_frac": 0.10,
                "itl_over_slo_batch_frac": 0.75}
    for query in bound_queries("chat", "1m", SLO):
        by_time = range_parts(client, query.expr, start_s=now - 3, end_s=now, step_s=1)
        reading = read_bound(query, by_time[max(by_time)], 60.0)
        assert reading.share == pytest.approx(expected[query.field], rel=1e-6), query.field


def test_the_default_slo_rule_misses_those_gaps(fed) -> None:
    """The recording rule at the default 50 ms reads no gap above it for the same samples:
    read there, a 7.5 ms pool would look safe."""
    prometheus, _, _ = fed
    client = connect_prometheus(prometheus.extra["url"], 5.0)
    rule = ('pool_class:borrowd_proxy_itl_seconds:over_slo_ratio_rate15s'
            '{pool="chat",class="interactive"}')
    assert float(client.custom_query(rule)[0]["value"][1]) == 0.0


@pytest.mark.parametrize(("pool", "lacking"), [("old", "1 of 1"), ("mixed", "1 of 2")])
def test_a_histogram_without_the_bound_reads_no_share(fed, pool: str, lacking: str) -> None:
    """A proxy without the SLO bounds (alone or beside one with them): the ITL and TTFT
    shares are NaN (the pool controls on p95), the samples are still counted, and each is a
    `missing_bound` error naming the metric, the bound and how many series lack it."""
    _, sources, errors = fed
    errors.clear()
    obs = sources["15s"].observe(pool, time.time())
    assert math.isnan(obs.itl_over_slo_frac) and math.isnan(obs.ttft_over_slo_frac)
    per_proxy = {"old": 1, "mixed": 2}[pool]
    assert 1000.0 * per_proxy <= obs.itl_samples <= 1150.0 * per_proxy
    missing = {field: detail for p, field, kind, detail in errors
               if p == pool and kind == MISSING_BOUND}
    assert set(missing) == {"itl_over_slo_frac", "ttft_over_slo_frac"}
    assert "borrowd_proxy_itl_seconds" in missing["itl_over_slo_frac"]
    assert f"{lacking} series have no bucket le=0.0075" in missing["itl_over_slo_frac"]
    assert "le=0.3" in missing["ttft_over_slo_frac"]
