"""No secret reaches a log: the daemon, the gate and the proxy run for real with passwords in
their Redis URL (`?password=`, Sentinel's `sentinel_password`) and basic auth in the
Prometheus URL, against a redis-server that requires the password."""

from __future__ import annotations

import contextlib
import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.support.daemon_harness import (
    REAL_PROMETHEUS_AND_REDIS,
    RULES,
    borrowd_command,
    events,
    start_daemon,
    to_toml,
)
from tests.support.servers import (
    ServerProcess,
    free_port,
    start_process,
    start_prometheus,
    start_redis,
    wait_until,
)

pytestmark = REAL_PROMETHEUS_AND_REDIS
SECRET = "hunter2-s3cret"
POOL = "chat"


@pytest.fixture
def secured_redis() -> Iterator[ServerProcess]:
    """A redis-server that requires SECRET."""
    server = start_redis(extra_args=["--requirepass", SECRET])
    try:
        yield server
    finally:
        server.stop()


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("BORROWD_")}


def test_daemon_logs_no_password(secured_redis: ServerProcess) -> None:
    """The daemon, with `?password=` in its Redis URL and basic auth in its Prometheus URL,
    leads and publishes, and no log line carries the password."""
    prometheus = start_prometheus({}, rule_files=[RULES])
    daemon = None
    try:
        redis_url = f"redis://127.0.0.1:{secured_redis.port}/0?password={SECRET}"
        prom_host = prometheus.extra["url"].removeprefix("http://")
        daemon = start_daemon({
            "redis": {"url": redis_url},
            "prometheus": {"url": f"http://watch:{SECRET}@{prom_host}", "timeout_s": 0.3},
            "pools": [{"name": POOL, "controller": {"tick_s": 0.5}}],
        }, holder_id="a")
        wait_until(lambda: events(daemon, "tick"), 20.0, "the daemon's first tick")
        client = redis.Redis(port=secured_redis.port, password=SECRET, decode_responses=True)
        wait_until(lambda: client.exists(f"borrowd:{{{POOL}}}:budget"), 10.0, "a record")
        client.close()
        log = daemon.log()
        assert SECRET not in log
        assert "password=***" in log and "watch:***@" in log
    finally:
        if daemon is not None:
            daemon.stop()
        prometheus.stop()


def _admit(url: str) -> int:
    headers = {"X-Borrowd-Request-Id": "r1", "X-Borrowd-Prompt-Tokens": "10",
               "X-Borrowd-Max-Tokens": "10"}
    try:
        request = urllib.request.Request(url, method="POST", headers=headers)
        with urllib.request.urlopen(request, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_gate_with_sentinel_passwords_logs_none(tmp_path: Path) -> None:
    """The gate, given a Sentinel URL with both passwords and no Sentinel to reach, denies
    batch (503) and logs why without either password."""
    port = free_port()
    url = (f"redis+sentinel://borrowd:{SECRET}@127.0.0.1:{free_port()}/mymaster/0"
           f"?sentinel_password={SECRET}")
    gate = start_process("gate", [borrowd_command(), "gate", "--pool", POOL, "--listen",
                                  f"127.0.0.1:{port}", "--redis", url], port, env=_env())
    try:
        assert _admit(f"http://127.0.0.1:{port}/admit") == 503
        wait_until(lambda: "gate_redis_unavailable" in gate.log(), 5.0, "the denial's log")
    finally:
        gate.stop()
    log = gate.log()
    assert SECRET not in log
    assert "sentinel_password=***" in log


def test_proxy_logs_no_password(secured_redis: ServerProcess, tmp_path: Path) -> None:
    """The proxy, with `?password=` in its Redis URL, names its budget store without it."""
    port = free_port()
    config = {
        "proxy": {"listen_port": port, "pool": POOL, "upstreams": ["http://127.0.0.1:1"],
                  "redis_url": f"redis://127.0.0.1:{secured_redis.port}/0?password={SECRET}"},
        "tenants": {"etl": {"keys": ["sk-etl"], "class": "batch"}},
    }
    path = tmp_path / "proxy.toml"
    path.write_text(to_toml(config))
    proxy = start_process("proxy", [borrowd_command(), "proxy", "--config", str(path)], port,
                          env=_env())
    try:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions", method="POST",
            headers={"Authorization": "Bearer sk-etl", "Content-Type": "application/json"},
            data=json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                             "max_tokens": 4}).encode())
        with contextlib.suppress(urllib.error.HTTPError):
            urllib.request.urlopen(request, timeout=5).close()
    finally:
        proxy.stop()
    log = proxy.log()
    assert "budget store" in log
    assert SECRET not in log
