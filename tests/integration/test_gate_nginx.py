"""`borrowd gate` behind a real nginx with the shipped snippet (deploy/nginx/), with a real
redis-server it can lose, and a gate it can lose: stopped or frozen, interactive requests
pass untouched (they never consult the gate) and batch is refused quickly (fail closed)."""

from __future__ import annotations

import os
import shutil
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from borrowd.adapters.redis_conn import connect
from borrowd.adapters.store import BudgetStore
from borrowd.models.budget import Budget, Mode

from tests.support.servers import (
    ServerProcess,
    free_port,
    start_nginx,
    start_process,
    start_redis,
    wait_until,
)

pytestmark = pytest.mark.integration

POOL = "chat-8b"
LEASE_MS = 2000
TTL_MS = 1500
SECRET = "nginx-test-secret-0123456789"
SNIPPETS = Path(__file__).resolve().parents[2] / "deploy" / "nginx"
# The auth location's connect + read timeouts in the shipped snippet, plus slack.
GATE_WAIT_LIMIT_S = 1.2 + 0.5
# What the fake upstream answers: the path and the headers the router injected.
ECHO = "$uri priority=$http_x_borrowd_priority max_tokens=$http_x_borrowd_max_tokens"


def _nginx_blocks(workdir: Path, port: int, gate_port: int, upstream_port: int) -> str:
    """The shipped snippets with the test's ports and secret, around an echoing upstream."""
    http_conf = (SNIPPETS / "borrowd-http.conf").read_text()
    locations = (SNIPPETS / "borrowd-locations.conf").read_text()
    assert "127.0.0.1:8089" in http_conf and "change-me-to-the-gate-secret" in locations
    (workdir / "borrowd-http.conf").write_text(
        http_conf.replace("127.0.0.1:8089", f"127.0.0.1:{gate_port}"))
    (workdir / "borrowd-locations.conf").write_text(
        locations.replace("change-me-to-the-gate-secret", SECRET))
    return f"""
    include {workdir}/borrowd-http.conf;
    upstream vllm {{ server 127.0.0.1:{upstream_port}; }}
    server {{
        listen 127.0.0.1:{upstream_port};
        location / {{
            return 200 "{ECHO}\\n";
        }}
    }}
    server {{
        listen 127.0.0.1:{port};
        include {workdir}/borrowd-locations.conf;
    }}
"""


@dataclass
class Stack:
    """redis-server, `borrowd gate` and nginx, wired together."""

    redis: ServerProcess
    gate: ServerProcess
    nginx: ServerProcess

    def request(self, headers: dict[str, str], body: bytes = b"{}"
                ) -> tuple[int, dict[str, str], str]:
        """POST through nginx; (status, headers, body)."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.nginx.port}/v1/completions",
                                     data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, dict(resp.headers), resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, dict(err.headers), err.read().decode()


def _publish(url: str, ttl_ms: int = TTL_MS, **overrides) -> Budget:
    fields = dict(pool=POOL, mode=Mode.OPEN, reason="law", batch_tokens_per_s=5000.0,
                  batch_burst_tokens=20_000, max_batch_seqs=2, max_batch_kv_tokens=10_000,
                  max_batch_output_tokens=256)
    fields.update(overrides)
    client = connect(url)
    try:
        return BudgetStore(client, POOL).publish(Budget(**fields), epoch=1, ttl_ms=ttl_ms,
                                                 now_s=time.time())
    finally:
        client.close()


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as resp:
            return resp.status == 200
    except OSError:
        return False


@pytest.fixture
def stack() -> Iterator[Stack]:
    """The three servers on free ports, stopped by PID afterwards (a Redis a test restarted
    included)."""
    borrowd = shutil.which("borrowd")
    assert borrowd, "the borrowd console script is not installed (pip install -e .)"
    redis_proc = start_redis()
    gate_port = free_port()
    started: list[ServerProcess] = [redis_proc]
    try:
        gate = start_process(
            "borrowd-gate",
            [borrowd, "gate", "--listen", f"127.0.0.1:{gate_port}", "--pool", POOL,
             "--redis", redis_proc.extra["url"], "--lease-ms", str(LEASE_MS),
             "--decision-timeout-s", "0.3"],
            gate_port, ready=lambda: _healthy(gate_port),
            env={**os.environ, "BORROWD_GATE_SECRET": SECRET})
        started.append(gate)
        port = free_port()
        nginx = start_nginx(_nginx_blocks(gate.workdir, port, gate_port, free_port()), port)
        started.append(nginx)
        stack = Stack(redis_proc, gate, nginx)
        yield stack
        # A test that restarts Redis leaves the new server on the stack: stop that one too.
        started.append(stack.redis)
    finally:
        for server in reversed(started):
            server.stop()


def _batch(max_tokens: int = 1000, claimed_prompt: int = 0) -> dict[str, str]:
    return {"Authorization": "Bearer batch-key", "X-Prompt-Tokens": str(claimed_prompt),
            "X-Max-Tokens": str(max_tokens)}


CHAT = {"Authorization": "Bearer chat-key", "X-Max-Tokens": "512", "X-Borrowd-Priority": "-5"}


def test_nginx_admits_injects_and_denies_with_retry_after(stack: Stack) -> None:
    """Admitted batch reaches the upstream with priority and clamped max tokens; a full pool
    gives the client 429 + Retry-After; a client cannot promote itself to interactive nor
    choose its priority; interactive goes straight to the upstream."""
    _publish(stack.redis.extra["url"], ttl_ms=60_000)
    status, _, body = stack.request(_batch())
    assert (status, body.strip()) == (200, "/v1/completions priority=10 max_tokens=256")
    assert stack.request(_batch())[0] == 200
    status, headers, body = stack.request(_batch())
    assert status == 429
    assert headers["Retry-After"] == "1"
    assert headers["X-Borrowd-Reason"] == "seq_cap"
    spoof = {**_batch(), "X-Borrowd-Class": "interactive", "X-Borrowd-Priority": "0"}
    assert stack.request(spoof)[0] == 429
    status, _, body = stack.request(CHAT)
    assert (status, body.strip()) == (200, "/v1/completions priority=0 max_tokens=")


def test_redis_loss_fails_closed_then_recovers(stack: Stack) -> None:
    """Redis killed: batch is denied at once (429, reason redis_unavailable) while chat passes;
    Redis back with a fresh record: batch is admitted again."""
    _publish(stack.redis.extra["url"])
    assert stack.request(_batch())[0] == 200
    port = stack.redis.port
    stack.redis.kill()
    start = time.monotonic()
    status, headers, _ = stack.request(_batch())
    assert time.monotonic() - start < LEASE_MS / 1000
    assert (status, headers["X-Borrowd-Reason"]) == (429, "redis_unavailable")
    assert stack.request(CHAT)[0] == 200
    stack.redis = start_redis(port=port)
    assert stack.request(_batch())[2].strip() == "batch denied: no_budget"
    _publish(stack.redis.extra["url"])
    wait_until(lambda: stack.request(_batch())[0] == 200, 5.0, "batch admitted again")


def test_frozen_redis_never_hangs_the_router(stack: Stack) -> None:
    """Redis frozen (SIGSTOP: connections open, no replies): batch is denied within the
    decision timeout, chat passes; thawed (SIGCONT): batch is admitted again."""
    _publish(stack.redis.extra["url"], ttl_ms=60_000)
    assert stack.request(_batch())[0] == 200
    os.kill(stack.redis.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        status, headers, _ = stack.request(_batch())
        assert time.monotonic() - start < 1.5
        assert (status, headers["X-Borrowd-Reason"]) == (429, "redis_unavailable")
        assert stack.request(CHAT)[0] == 200
    finally:
        os.kill(stack.redis.pid, signal.SIGCONT)
    wait_until(lambda: stack.request(_batch())[0] == 200, 5.0, "batch admitted again")


def _timed(stack: Stack, headers: dict[str, str]) -> tuple[int, dict[str, str], float]:
    start = time.monotonic()
    status, reply_headers, _ = stack.request(headers)
    return status, reply_headers, time.monotonic() - start


@pytest.mark.parametrize("fault", ["stopped", "frozen"])
def test_a_lost_gate_never_touches_interactive_and_closes_batch_fast(stack: Stack,
                                                                      fault: str) -> None:
    """The gate stopped (connection refused) or frozen (SIGSTOP: accepted, never answered):
    interactive requests are served as fast as before, batch gets 503 + Retry-After within
    the auth location's timeouts; the gate back, batch is admitted again."""
    _publish(stack.redis.extra["url"], ttl_ms=60_000, max_batch_seqs=64)
    assert stack.request(_batch())[0] == 200
    if fault == "stopped":
        stack.gate.stop()
    else:
        os.kill(stack.gate.pid, signal.SIGSTOP)
    try:
        for _ in range(5):
            status, _, took_s = _timed(stack, CHAT)
            assert status == 200 and took_s < 0.2, (status, took_s)
        status, headers, took_s = _timed(stack, _batch())
        assert (status, headers["X-Borrowd-Reason"], headers["Retry-After"]) == (
            503, "gate_unavailable", "1")
        assert took_s < GATE_WAIT_LIMIT_S, took_s
        status, _, took_s = _timed(stack, CHAT)
        assert status == 200 and took_s < 0.2, (status, took_s)
    finally:
        if fault == "frozen":
            os.kill(stack.gate.pid, signal.SIGCONT)
    if fault == "frozen":
        wait_until(lambda: stack.request(_batch())[0] == 200, 5.0, "batch admitted again")


def test_the_prompt_is_charged_by_body_bytes_not_by_the_clients_claim(stack: Stack) -> None:
    """A 30 kB prompt claimed as 0 tokens is charged its bytes: too large for a 20k burst."""
    _publish(stack.redis.extra["url"], ttl_ms=60_000)
    prompt = b'{"prompt": "' + b"x" * 30_000 + b'"}'
    status, headers, _ = stack.request(_batch(max_tokens=10, claimed_prompt=0), prompt)
    assert (status, headers["X-Borrowd-Reason"]) == (429, "too_large")
    assert stack.request(_batch(max_tokens=10), b'{"prompt": "hi"}')[0] == 200


def test_a_router_without_the_gate_secret_gets_no_batch(stack: Stack) -> None:
    """A caller that does not present the gate's secret is refused (401), not admitted."""
    _publish(stack.redis.extra["url"], ttl_ms=60_000)
    request = urllib.request.Request(
        f"http://127.0.0.1:{stack.gate.port}/auth", method="GET",
        headers={"X-Borrowd-Request-Id": "x", "X-Borrowd-Prompt-Tokens": "1",
                 "X-Borrowd-Max-Tokens": "1"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=5)
    assert refused.value.code == 401
