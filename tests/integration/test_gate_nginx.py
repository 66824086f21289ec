"""`borrowd gate` behind a real nginx (`auth_request`) with a real redis-server it can lose."""

from __future__ import annotations

import os
import shutil
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from adapters.redis_conn import connect
from adapters.store import BudgetStore
from models.budget import Budget, Mode
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


def _nginx_blocks(port: int, gate_port: int, upstream_port: int) -> str:
    return f"""
    map $http_authorization $borrowd_class {{
        "Bearer chat-key" interactive;
        default batch;
    }}
    server {{
        listen 127.0.0.1:{upstream_port};
        location / {{
            return 200 "priority=$http_x_borrowd_priority max_tokens=$http_x_borrowd_max_tokens\\n";
        }}
    }}
    server {{
        listen 127.0.0.1:{port};
        location = /_borrowd_auth {{
            internal;
            proxy_pass http://127.0.0.1:{gate_port}/auth;
            proxy_pass_request_body off;
            proxy_set_header Content-Length "";
            proxy_set_header X-Borrowd-Class $borrowd_class;
            proxy_set_header X-Borrowd-Request-Id $http_x_request_id;
            proxy_set_header X-Borrowd-Prompt-Tokens $http_x_prompt_tokens;
            proxy_set_header X-Borrowd-Max-Tokens $http_x_max_tokens;
        }}
        location @borrowd_denied {{
            add_header Retry-After $borrowd_retry_after always;
            add_header X-Borrowd-Reason $borrowd_reason always;
            return 429 "batch denied: $borrowd_reason\\n";
        }}
        location /v1/ {{
            auth_request /_borrowd_auth;
            auth_request_set $borrowd_priority $upstream_http_x_borrowd_priority;
            auth_request_set $borrowd_max_tokens $upstream_http_x_borrowd_max_tokens;
            auth_request_set $borrowd_retry_after $upstream_http_retry_after;
            auth_request_set $borrowd_reason $upstream_http_x_borrowd_reason;
            error_page 403 = @borrowd_denied;
            proxy_set_header X-Borrowd-Priority $borrowd_priority;
            proxy_set_header X-Borrowd-Max-Tokens $borrowd_max_tokens;
            proxy_pass http://127.0.0.1:{upstream_port};
        }}
    }}
"""


@dataclass
class Stack:
    """redis-server, `borrowd gate` and nginx, wired together."""

    redis: ServerProcess
    gate: ServerProcess
    nginx: ServerProcess

    def request(self, headers: dict[str, str]) -> tuple[int, dict[str, str], str]:
        """POST through nginx; (status, headers, body)."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.nginx.port}/v1/completions",
                                     data=b"{}", headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return resp.status, dict(resp.headers), resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, dict(err.headers), err.read().decode()

    def release(self, request_id: str, output_tokens: int) -> bytes:
        """POST /release to the gate."""
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.gate.port}/release", method="POST", data=b"",
            headers={"X-Borrowd-Request-Id": request_id,
                     "X-Borrowd-Output-Tokens": str(output_tokens)})
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.read()


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
    """The three servers on free ports, stopped by PID afterwards."""
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
            gate_port, ready=lambda: _healthy(gate_port))
        started.append(gate)
        port = free_port()
        nginx = start_nginx(_nginx_blocks(port, gate_port, free_port()), port)
        started.append(nginx)
        yield Stack(redis_proc, gate, nginx)
    finally:
        for server in reversed(started):
            server.stop()


def _batch(request_id: str, prompt: int = 100, max_tokens: int = 1000) -> dict[str, str]:
    return {"Authorization": "Bearer batch-key", "X-Request-Id": request_id,
            "X-Prompt-Tokens": str(prompt), "X-Max-Tokens": str(max_tokens)}


CHAT = {"Authorization": "Bearer chat-key", "X-Max-Tokens": "512"}


def test_nginx_admits_injects_and_denies_with_retry_after(stack: Stack) -> None:
    """Admitted batch reaches the upstream with priority and clamped max tokens; a full pool
    gives the client 429 + Retry-After; a client cannot promote itself to interactive."""
    _publish(stack.redis.extra["url"], ttl_ms=60_000)
    status, _, body = stack.request(_batch("b1"))
    assert (status, body.strip()) == (200, "priority=10 max_tokens=256")
    assert stack.request(_batch("b2"))[0] == 200
    status, headers, body = stack.request(_batch("b3"))
    assert status == 429
    assert headers["Retry-After"] == "1"
    assert headers["X-Borrowd-Reason"] == "seq_cap"
    spoof = {**_batch("b4"), "X-Borrowd-Class": "interactive"}
    assert stack.request(spoof)[0] == 429
    status, _, body = stack.request(CHAT)
    assert (status, body.strip()) == (200, "priority=0 max_tokens=512")
    assert b'"released": true' in stack.release("b1", 10)
    assert stack.request(_batch("b3"))[0] == 200


def test_redis_loss_fails_closed_then_recovers(stack: Stack) -> None:
    """Redis killed: batch is denied at once (429, reason redis_unavailable) while chat passes;
    Redis back with a fresh record: batch is admitted again."""
    _publish(stack.redis.extra["url"])
    assert stack.request(_batch("before"))[0] == 200
    port = stack.redis.port
    stack.redis.kill()
    start = time.monotonic()
    status, headers, _ = stack.request(_batch("during"))
    assert time.monotonic() - start < LEASE_MS / 1000
    assert (status, headers["X-Borrowd-Reason"]) == (429, "redis_unavailable")
    assert stack.request(CHAT)[0] == 200
    stack.redis = start_redis(port=port)
    assert stack.request(_batch("after-restart"))[2].strip() == "batch denied: no_budget"
    _publish(stack.redis.extra["url"])
    wait_until(lambda: stack.request(_batch("after"))[0] == 200, 5.0, "batch admitted again")


def test_frozen_redis_never_hangs_the_router(stack: Stack) -> None:
    """Redis frozen (SIGSTOP: connections open, no replies): batch is denied within the
    decision timeout, chat passes; thawed (SIGCONT): batch is admitted again."""
    _publish(stack.redis.extra["url"], ttl_ms=60_000)
    assert stack.request(_batch("before"))[0] == 200
    os.kill(stack.redis.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        status, headers, _ = stack.request(_batch("frozen"))
        assert time.monotonic() - start < 1.5
        assert (status, headers["X-Borrowd-Reason"]) == (429, "redis_unavailable")
        assert stack.request(CHAT)[0] == 200
    finally:
        os.kill(stack.redis.pid, signal.SIGCONT)
    wait_until(lambda: stack.request(_batch("thawed"))[0] == 200, 5.0, "batch admitted again")
