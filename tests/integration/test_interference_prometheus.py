"""The daemon's Prometheus source reads batch attribution and KV capacity from real engines.

Two `borrowd emulate` processes (pool `chat`, KV caches of 32768 and 65536 tokens) are
scraped by a real Prometheus with the shipped rules. Interactive traffic alone attributes
nothing to batch; once long batch prompts run beside it, most interactive gaps above 50 ms and
most interactive queue wait fall in steps carrying batch tokens, and `PrometheusSource` reads
those shares into the fields the supervisor uses. A pool without engines reads them missing.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest
from borrowd.controller.prom_source import EMPTY, PrometheusSource, connect_prometheus
from borrowd.models.signals import Observation

from tests.support.daemon_harness import RULES
from tests.support.servers import ServerProcess, free_port, start_process, start_prometheus

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs prometheus"),
]

POOL = "chat"
MODEL = "emulated-llama-3-8b"
KV_TOKENS = (32_768, 65_536)
RUNNER = ("import argparse, sys; from borrowd.controller.cli import serve; "
          "p = argparse.ArgumentParser(); serve.register(p.add_subparsers()); "
          "a = p.parse_args(); sys.exit(a.func(a))")


def _emulator(engine: int, kv_tokens: int) -> ServerProcess:
    port = free_port()
    argv = [sys.executable, "-c", RUNNER, "emulate", "--listen", f"127.0.0.1:{port}",
            "--engine-index", str(engine), "--kv-capacity-tokens", str(kv_tokens),
            "--max-model-len", "32768"]
    server = start_process(f"emulate-{engine}", argv, port)
    server.extra["url"] = f"http://127.0.0.1:{port}"
    return server


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[list[ServerProcess], PrometheusSource, list]]:
    """Two emulated engines of pool chat, Prometheus scraping them every 0.5 s, a source."""
    engines = [_emulator(i, kv) for i, kv in enumerate(KV_TOKENS)]
    prometheus = start_prometheus(
        {"vllm": [e.extra["url"].removeprefix("http://") for e in engines]},
        scrape_interval_s=0.5, rule_files=[RULES], target_labels={"vllm": {"pool": POOL}},
    )
    errors: list = []
    source = PrometheusSource(connect_prometheus(prometheus.extra["url"], 2.0), window="15s",
                              timeout_s=2.0, on_error=lambda *e: errors.append(e))
    try:
        yield engines, source, errors
    finally:
        prometheus.stop()
        for engine in engines:
            engine.stop()


class Load:
    """Threads sending completions to one engine until stopped."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def start(self, count: int, prompt_tokens: int, max_tokens: int, priority: int) -> None:
        """`count` client threads, each sending one request after the other."""
        body = json.dumps({"model": MODEL, "prompt": "x", "borrowd_prompt_tokens": prompt_tokens,
                           "max_tokens": max_tokens, "priority": priority}).encode()

        def client() -> None:
            while not self.stop.is_set():
                request = urllib.request.Request(self.url + "/v1/completions", data=body,
                                                 headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=60) as resp:
                    resp.read()

        for _ in range(count):
            thread = threading.Thread(target=client, daemon=True)
            thread.start()
            self.threads.append(thread)

    def join(self) -> None:
        """Stop sending and wait for the requests in flight."""
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)


def _observe_until(source: PrometheusSource, pool: str, ok: Callable[[Observation], bool],
                   timeout_s: float, what: str) -> Observation:
    deadline = time.monotonic() + timeout_s
    obs = source.observe(pool, time.time())
    while not ok(obs):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}; last {obs}")
        time.sleep(0.5)
        obs = source.observe(pool, time.time())
    return obs


def test_shares_follow_batch_and_capacity_sums_the_engines(fleet) -> None:
    """Interactive alone: no share attributed to batch, and the capacity is both engines'.
    With long batch prompts beside it: most gaps above the SLO and most wait are batch's."""
    engines, source, errors = fleet
    load = Load(engines[0].extra["url"])
    load.start(3, prompt_tokens=300, max_tokens=40, priority=0)
    load.start(1, prompt_tokens=12_000, max_tokens=5, priority=0)  # prefill over two steps
    try:
        quiet = _observe_until(
            source, POOL,
            # Prometheus scrapes the two engines at different moments: until both are in, the
            # capacity is one engine's.
            lambda o: (o.interactive_wait_batch_frac == 0.0
                       and o.kv_capacity_tokens == sum(KV_TOKENS)),
            30.0, "interactive wait counted in clean steps, and both engines' KV capacity")
        assert quiet.kv_capacity_tokens == sum(KV_TOKENS)
        errors.clear()  # before the first scrapes the series were absent
        quiet = source.observe(POOL, time.time())
        assert not quiet.itl_over_slo_batch_frac > 0.0  # NaN (none above) or 0: not batch's
        assert [e for e in errors if e[1] in ("itl_over_slo_batch_frac",
                                              "interactive_wait_batch_frac")] == []
        load.start(2, prompt_tokens=30_000, max_tokens=20, priority=10)
        busy = _observe_until(
            source, POOL,
            lambda o: o.itl_over_slo_batch_frac > 0.5 and o.interactive_wait_batch_frac > 0.5,
            40.0, "most interactive gaps above 50 ms and most wait attributed to batch")
    finally:
        load.join()
    assert busy.itl_over_slo_batch_frac <= 1.0 and busy.interactive_wait_batch_frac <= 1.0


def test_a_pool_without_engines_reads_attribution_and_capacity_missing(fleet) -> None:
    """No engine of the pool exports the series: the fields are NaN and counted as empty."""
    _, source, errors = fleet
    errors.clear()
    obs = source.observe("other", time.time())
    wanted = {"itl_over_slo_batch_frac", "interactive_wait_batch_frac", "kv_capacity_tokens"}
    assert all(math.isnan(getattr(obs, name)) for name in wanted)
    assert {(field, kind) for _, field, kind, _ in errors if field in wanted} == {
        (name, EMPTY) for name in wanted}
