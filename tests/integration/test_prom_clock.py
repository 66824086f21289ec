"""Staleness and values on Prometheus's clock: a daemon whose clock is off reads the truth.

A real Prometheus scrapes a fake fleet with borrowd's recording rules; the source is asked
for an observation with the daemon's clock 20 s ahead and 4 s behind.
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Iterator

import pytest
from borrowd.controller.prom_source import PrometheusSource, connect_prometheus

from tests.support.daemon_harness import RULES
from tests.support.fleet_metrics import FakeFleetMetrics
from tests.support.servers import ServerProcess, start_prometheus, wait_until

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed"),
]
POOL = "chat"


@pytest.fixture
def fleet_and_prometheus() -> Iterator[tuple[FakeFleetMetrics, ServerProcess]]:
    """The fake fleet and a Prometheus scraping it every 0.5 s with the rules."""
    fleet = FakeFleetMetrics(POOL).start()
    try:
        prometheus = start_prometheus(
            {"proxy": [fleet.proxy_target], "vllm": [fleet.vllm_target]},
            scrape_interval_s=0.5, rule_files=[RULES], target_labels={"vllm": {"pool": POOL}},
        )
        try:
            yield fleet, prometheus
        finally:
            prometheus.stop()
    finally:
        fleet.stop()


def test_a_daemon_with_a_wrong_clock_reads_current_data_and_its_true_age(
    fleet_and_prometheus: tuple[FakeFleetMetrics, ServerProcess],
) -> None:
    """Daemon 20 s ahead: the data is not called 20 s old (no false failsafe). Daemon 4 s
    behind: the KV usage read is the current one, not the one of 4 s ago."""
    fleet, prometheus = fleet_and_prometheus
    fleet.levels.kv_usage_frac = 0.3
    source = PrometheusSource(connect_prometheus(prometheus.extra["url"], 1.0), window="15s",
                              timeout_s=1.0)
    wait_until(lambda: source.observe(POOL, time.time()).kv_usage_frac == pytest.approx(0.3),
               30.0, "the fleet's KV usage in Prometheus")
    time.sleep(5.0)  # Prometheus holds 5 s of KV usage 0.3
    fleet.levels.kv_usage_frac = 0.9
    wait_until(lambda: source.observe(POOL, time.time()).kv_usage_frac == pytest.approx(0.9),
               10.0, "the new KV usage in Prometheus")

    ahead = source.observe(POOL, time.time() + 20.0)
    assert math.isfinite(ahead.age_s) and ahead.age_s < 3.0, ahead.age_s

    behind = source.observe(POOL, time.time() - 4.0)
    assert behind.kv_usage_frac == pytest.approx(0.9)
    assert behind.age_s < 3.0
