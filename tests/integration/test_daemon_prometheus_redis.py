"""`borrowd run` against a real Prometheus and a real redis-server, fed by a fake fleet.

The fleet's latencies are set by the test (tests/support/fleet_metrics.py), so each phase is
deterministic: quiet -> the budget opens; TTFT over the SLO -> it closes within a few ticks;
Prometheus gone -> failsafe; SIGTERM -> the lease is released; SIGKILL -> batch admissions
stop within one budget lease; a standby daemon takes over with a newer epoch.
"""

from __future__ import annotations

import itertools
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from borrowd.adapters.gate import Gate
from borrowd.adapters.store import BudgetStore, PoolKeys, holder_of
from borrowd.models.budget import Budget, Mode

from tests.support.daemon_harness import (
    REAL_PROMETHEUS_AND_REDIS,
    RULES,
    events,
    metric_value,
    start_daemon,
)
from tests.support.fleet_metrics import FakeFleetMetrics
from tests.support.servers import ServerProcess, start_prometheus, start_redis

pytestmark = REAL_PROMETHEUS_AND_REDIS
POOL = "chat"
TICK_S = 0.5
TTL_MS = 1500
_ids = itertools.count()


def daemon_config(prometheus_url: str, redis_url: str) -> dict:
    """A fast-ticking config: opens after 2 quiet seconds, ramps in about a second."""
    return {
        "redis": {"url": redis_url},
        "prometheus": {"url": prometheus_url, "timeout_s": 0.3, "window": "15s"},
        "pools": [{
            "name": POOL,
            "leader_lease_ms": TTL_MS,
            "budget_ttl_ms": TTL_MS,
            "controller": {
                "tick_s": TICK_S,
                "u_max_tokens_per_s": 40000.0,
                "supervisor": {"quiet_s": 2.0, "ramp_slew_tokens_per_s2": 20000.0,
                               "ramp_cap_tokens_per_s": 20000.0, "max_age_s": 3.0},
            },
        }],
    }


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str) -> object:
    """Poll `predicate` every 50 ms until truthy; its value, or AssertionError naming `what`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s} s: {what}")


@pytest.fixture
def stack() -> Iterator[dict]:
    """redis-server, the fake fleet, and Prometheus scraping it every 0.5 s with the rules."""
    fleet = FakeFleetMetrics(POOL).start()
    redis_proc = start_redis()
    prometheus = start_prometheus(
        {"proxy": [fleet.proxy_target], "vllm": [fleet.vllm_target]}, scrape_interval_s=0.5,
        rule_files=[RULES], target_labels={"vllm": {"pool": POOL}},
    )
    client = redis.Redis.from_url(redis_proc.extra["url"], decode_responses=True)
    started: list[ServerProcess] = []
    try:
        yield {"fleet": fleet, "redis": redis_proc, "prometheus": prometheus, "client": client,
               "store": BudgetStore(client, POOL), "started": started}
    finally:
        for server in started:
            server.kill()
        prometheus.stop()
        redis_proc.stop()
        fleet.stop()


def launch(stack: dict, holder_id: str, env: dict[str, str] | None = None) -> ServerProcess:
    """Start one daemon on the stack (stopped by the fixture)."""
    config = daemon_config(stack["prometheus"].extra["url"], stack["redis"].extra["url"])
    server = start_daemon(config, holder_id=holder_id, env=env, name=f"daemon-{holder_id}")
    stack["started"].append(server)
    return server


def record(stack: dict) -> Budget | None:
    """The pool's usable budget record now."""
    return stack["store"].read(time.time())


def admits(gate: Gate) -> bool:
    """True when a small batch request is admitted now (released at once)."""
    request_id = f"probe-{next(_ids)}"
    admission = gate.admit(request_id, prompt_tokens=100, max_output_tokens=10)
    if admission.admitted:
        gate.release(request_id, output_tokens=0)
    return admission.admitted


def test_budget_follows_latency_and_fails_safe(stack: dict, tmp_path: Path) -> None:
    """Quiet opens; TTFT over the SLO closes within a few ticks; no Prometheus: failsafe;
    SIGTERM releases the lease; systemd hears READY=1 and WATCHDOG=1."""
    notify_path = tmp_path / "notify.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(notify_path))
    listener.settimeout(10)
    daemon = launch(stack, "solo", env={"NOTIFY_SOCKET": str(notify_path),
                                        "WATCHDOG_USEC": "2000000"})
    try:
        assert listener.recv(4096).startswith(b"READY=1")
        assert wait_for(lambda: listener.recv(4096) == b"WATCHDOG=1", 5, "a WATCHDOG=1")

        opened = wait_for(
            lambda: (b := record(stack)) and b.admits_batch and b, 30, "the budget to open"
        )
        assert opened.mode in (Mode.RAMP, Mode.OPEN) and opened.batch_tokens_per_s > 0
        assert opened.epoch >= 1 and opened.ttl_ms == TTL_MS

        stack["fleet"].levels.ttft_s = 2.5  # interactive TTFT 2.5x its 1 s SLO
        burst_s = time.time()
        closed = wait_for(
            lambda: (b := record(stack)) and b.mode == Mode.CLOSED and b, 10, "a cut"
        )
        assert closed.batch_tokens_per_s == 0 and not closed.admits_batch
        assert "TTFT" in closed.reason
        assert closed.issued_at_s - burst_s < 6.0
        assert metric_value(daemon, 'borrowd_mode{mode="closed",pool="chat"}') == 1.0

        stack["prometheus"].kill()
        failsafe = wait_for(
            lambda: (b := record(stack)) and b.mode == Mode.FAILSAFE and b, 10, "failsafe"
        )
        assert failsafe.batch_tokens_per_s == 0 and "missing or stale" in failsafe.reason
        assert (metric_value(
            daemon, 'borrowd_errors_total{kind="transport",pool="chat",source="prometheus"}'
        ) or 0) >= 1

        daemon.stop()  # SIGTERM
        assert daemon.proc.returncode == 0, daemon.log()[-2000:]
        assert not stack["client"].exists(PoolKeys(POOL).leader)
        assert [e["event"] for e in events(daemon, "leader_released")] == ["leader_released"]
        modes = [(e["from_mode"], e["to_mode"]) for e in events(daemon, "mode_change")]
        assert ("open", "closed") in modes or ("ramp", "closed") in modes
        assert ("closed", "failsafe") in modes
    finally:
        listener.close()


def test_killed_leader_stops_batch_and_standby_takes_over(stack: dict) -> None:
    """SIGKILL of the leader: its last record lapses within one lease and the warm standby
    leads with a newer epoch (batch keeps its budget); with no daemon left, new batch work
    is refused within one lease."""
    gate = Gate(stack["client"], POOL)
    daemons = {"a": launch(stack, "a"), "b": launch(stack, "b")}
    wait_for(lambda: (b := record(stack)) and b.admits_batch, 30, "the budget to open")
    holder = holder_of(stack["client"].get(PoolKeys(POOL).leader))
    leader, standby = daemons[holder], daemons["b" if holder == "a" else "a"]
    wait_for(lambda: metric_value(standby, 'borrowd_mode{mode="open",pool="chat"}') == 1.0
             and metric_value(standby, 'borrowd_budget_tokens_per_s{pool="chat"}') > 0, 15,
             "the standby's own decision to be open with a budget too (warm)")
    assert metric_value(standby, 'borrowd_leader{pool="chat"}') == 0.0
    assert admits(gate)
    old = record(stack)
    assert old is not None

    leader.kill(signal.SIGKILL)
    killed_s = time.time()
    last = stack["store"].read_record(killed_s).budget or old
    assert last.expires_at_s() <= killed_s + TTL_MS / 1000 + 0.05
    taken = wait_for(
        lambda: (b := record(stack)) and b.epoch > old.epoch and b, TTL_MS / 1000 + 3,
        "the standby to publish under a newer epoch",
    )
    takeover_s = time.time() - killed_s
    assert takeover_s <= TTL_MS / 1000 + 3 * TICK_S
    assert holder_of(stack["client"].get(PoolKeys(POOL).leader)) != holder
    # The standby's first record admits: its ramp hands over only to a law above 0.
    assert taken.admits_batch, taken
    assert metric_value(standby, 'borrowd_leader{pool="chat"}') == 1.0

    standby.kill(signal.SIGKILL)
    killed_s = time.time()
    # The record lapses on its own lease (a small budget can also refuse earlier, from an
    # empty bucket, so the lease is what is timed).
    wait_for(lambda: record(stack) is None, TTL_MS / 1000 + 1.0, "the last record to lapse")
    assert time.time() - killed_s <= TTL_MS / 1000 + 0.2
    assert not admits(gate)
