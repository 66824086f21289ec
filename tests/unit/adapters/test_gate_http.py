"""The HTTP gate: header contract, admit/deny statuses, fail-closed on Redis errors."""

from __future__ import annotations

import time

import pytest
from aiohttp.test_utils import TestClient, TestServer

from adapters.gate_http import GateServiceConfig, make_app
from adapters.redis_conn import connect
from adapters.store import BudgetStore
from models.budget import Budget, Mode
from tests.support.servers import free_port

POOL = "p1"


def _batch(request_id: str = "r1", prompt: str = "100", max_tokens: str = "2000") -> dict:
    return {"X-Borrowd-Request-Id": request_id, "X-Borrowd-Prompt-Tokens": prompt,
            "X-Borrowd-Max-Tokens": max_tokens}


def _publish(url: str, **overrides) -> None:
    fields = dict(pool=POOL, mode=Mode.OPEN, reason="law", batch_tokens_per_s=1000.0,
                  batch_burst_tokens=4000, max_batch_seqs=1, max_batch_kv_tokens=3000,
                  max_batch_output_tokens=500)
    fields.update(overrides)
    client = connect(url)
    BudgetStore(client, POOL).publish(Budget(**fields), epoch=1, ttl_ms=30_000, now_s=time.time())
    client.close()


async def _client(url: str) -> TestClient:
    config = GateServiceConfig(redis_url=url, default_pool=POOL, lease_ms=10_000,
                               batch_priority=3, decision_timeout_s=0.5)
    client = TestClient(TestServer(make_app(config)))
    await client.start_server()
    return client


async def test_admit_then_deny_then_release(redis_url) -> None:
    """2xx admit with priority and clamped max tokens; 429 + Retry-After; release frees."""
    _publish(redis_url)
    client = await _client(redis_url)
    try:
        admitted = await client.get("/admit", headers=_batch("r1"))
        assert admitted.status == 200
        assert admitted.headers["X-Borrowd-Priority"] == "3"
        assert admitted.headers["X-Borrowd-Max-Tokens"] == "500"
        assert admitted.headers["X-Borrowd-Lease-Ms"] == "10000"
        denied = await client.get("/admit", headers=_batch("r2"))
        assert denied.status == 429
        assert denied.headers["X-Borrowd-Reason"] == "seq_cap"
        assert int(denied.headers["Retry-After"]) >= 1
        released = await client.post("/release", headers={"X-Borrowd-Request-Id": "r1",
                                                           "X-Borrowd-Output-Tokens": "120"})
        assert await released.json() == {"released": True, "refunded_tokens": 380}
        assert (await client.get("/admit", headers=_batch("r2"))).status == 200
        renewed = await client.post("/renew", headers={"X-Borrowd-Request-Id": "gone"})
        assert renewed.status == 404
    finally:
        await client.close()


async def test_auth_endpoint_denies_with_403(redis_url) -> None:
    """/auth gives nginx a 403 (the only denial auth_request forwards) with the same headers."""
    client = await _client(redis_url)
    try:
        denied = await client.get("/auth", headers=_batch())
        assert denied.status == 403
        assert denied.headers["X-Borrowd-Reason"] == "no_budget"
        assert denied.headers["Retry-After"] == "1"
    finally:
        await client.close()


@pytest.mark.parametrize(
    ("headers", "named"),
    [
        ({"X-Borrowd-Prompt-Tokens": "1", "X-Borrowd-Max-Tokens": "1"}, "X-Borrowd-Request-Id"),
        (_batch(prompt="many"), "X-Borrowd-Prompt-Tokens"),
        (_batch(max_tokens="0"), "X-Borrowd-Max-Tokens"),
        ({**_batch(), "X-Borrowd-Class": "vip"}, "X-Borrowd-Class"),
        ({**_batch(), "X-Borrowd-Pool": "a{b}"}, "X-Borrowd-Pool"),
    ],
    ids=["missing-request-id", "non-integer-prompt", "zero-max-tokens", "unknown-class",
         "bad-pool"],
)
async def test_bad_header_is_named(redis_url, headers, named) -> None:
    """A missing or malformed header gives 400 whose body names the header."""
    client = await _client(redis_url)
    try:
        response = await client.get("/admit", headers=headers)
        assert response.status == 400
        assert named in await response.text()
    finally:
        await client.close()


async def test_redis_down_fails_closed_for_batch_open_for_interactive() -> None:
    """With no Redis, batch gets 503 quickly and interactive is admitted without Redis."""
    client = await _client(f"redis://127.0.0.1:{free_port()}/0")
    try:
        start = time.monotonic()
        batch = await client.get("/admit", headers=_batch())
        assert time.monotonic() - start < 2.0
        assert batch.status == 503
        assert batch.headers["X-Borrowd-Reason"] == "redis_unavailable"
        assert "Retry-After" in batch.headers
        chat = await client.get("/admit", headers={"X-Borrowd-Class": "interactive",
                                                   "X-Borrowd-Max-Tokens": "4096"})
        assert chat.status == 200
        assert chat.headers["X-Borrowd-Priority"] == "0"
        assert chat.headers["X-Borrowd-Max-Tokens"] == "4096"
        health = await client.get("/healthz")
        assert (health.status, (await health.json())["redis"]) == (200, "down")
    finally:
        await client.close()


@pytest.mark.parametrize(
    ("max_tokens", "echoed"),
    [("4096", "4096"), (None, None), ("lots", None)],
    ids=["given", "absent", "malformed"],
)
async def test_interactive_always_admitted(max_tokens, echoed) -> None:
    """Interactive is admitted with no Redis at all, even with a missing or bad max tokens;
    a max tokens header is echoed only when one was given."""
    client = await _client(f"redis://127.0.0.1:{free_port()}/0")
    headers = {"X-Borrowd-Class": "interactive"}
    if max_tokens is not None:
        headers["X-Borrowd-Max-Tokens"] = max_tokens
    try:
        response = await client.get("/auth", headers=headers)
        assert response.status == 200
        assert response.headers.get("X-Borrowd-Max-Tokens") == echoed
        assert response.headers["X-Borrowd-Priority"] == "0"
    finally:
        await client.close()
