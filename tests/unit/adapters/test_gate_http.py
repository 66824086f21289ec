"""The HTTP gate: header contract, admit/deny statuses, fail-closed on Redis errors."""

from __future__ import annotations

import re
import time

import pytest
from aiohttp.test_utils import TestClient, TestServer
from borrowd.adapters.gate_http import (
    Forbidden,
    GateCaller,
    GateService,
    GateServiceConfig,
    gate_config,
    load_gate_config,
    make_app,
)
from borrowd.adapters.redis_conn import connect, connect_async
from borrowd.adapters.store import BudgetStore
from borrowd.models.budget import Budget, Mode
from borrowd.models.errors import ConfigError

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


async def _client(url: str, callers: tuple[GateCaller, ...] = ()) -> TestClient:
    config = GateServiceConfig(pools=(POOL,), redis_url=url, lease_ms=10_000,
                               batch_priority=3, decision_timeout_s=0.5, callers=callers)
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
        (_batch(request_id="x" * 201), "X-Borrowd-Request-Id"),
    ],
    ids=["missing-request-id", "non-integer-prompt", "zero-max-tokens", "unknown-class",
         "overlong-request-id"],
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


SECRET_A = "secret-of-router-a-0123"
SECRET_B = "secret-of-router-b-4567"
CALLERS = (GateCaller("a", SECRET_A), GateCaller("b", SECRET_B))


def _as(secret: str, headers: dict | None = None) -> dict:
    return {"X-Borrowd-Gate-Secret": secret, **(headers or {})}


@pytest.mark.parametrize("secret", [None, "", "wrong-secret-000000000", SECRET_A + "x"],
                         ids=["missing", "empty", "wrong", "longer"])
async def test_callers_must_present_their_secret(redis_url, secret) -> None:
    """With callers configured, every endpoint but /healthz answers 401 without the secret."""
    _publish(redis_url)
    client = await _client(redis_url, CALLERS)
    headers = {} if secret is None else {"X-Borrowd-Gate-Secret": secret}
    try:
        for method, path, extra in (("GET", "/admit", _batch()), ("GET", "/auth", _batch()),
                                    ("POST", "/release", {"X-Borrowd-Request-Id": "r1"}),
                                    ("POST", "/renew", {"X-Borrowd-Request-Id": "r1"})):
            response = await client.request(method, path, headers={**headers, **extra})
            assert response.status == 401, path
            assert response.headers["X-Borrowd-Reason"] == "unauthenticated"
        assert (await client.get("/healthz")).status == 200
        assert (await client.get("/admit", headers=_as(SECRET_B, _batch()))).status == 200
    finally:
        await client.close()


async def test_a_lease_is_released_and_renewed_only_by_its_caller(redis_url) -> None:
    """Caller b naming caller a's request id frees nothing and renews nothing."""
    _publish(redis_url)
    client = await _client(redis_url, CALLERS)
    try:
        assert (await client.get("/admit", headers=_as(SECRET_A, _batch("r1")))).status == 200
        other = {"X-Borrowd-Request-Id": "r1", "X-Borrowd-Output-Tokens": "0"}
        stolen = await client.post("/release", headers=_as(SECRET_B, other))
        assert await stolen.json() == {"released": False, "refunded_tokens": 0}
        assert (await client.post("/renew", headers=_as(SECRET_B, other))).status == 404
        assert (await client.get("/admit", headers=_as(SECRET_B, _batch("r2")))).status == 429
        assert (await client.post("/renew", headers=_as(SECRET_A, other))).status == 200
        own = await client.post("/release", headers=_as(SECRET_A, other))
        assert (await own.json())["released"] is True
    finally:
        await client.close()


async def test_only_configured_pools_are_served(redis_url) -> None:
    """A pool not configured is refused with 403 and leaves no state behind."""
    _publish(redis_url)
    client = await _client(redis_url)
    try:
        for index in range(50):
            response = await client.get(
                "/admit", headers={**_batch(), "X-Borrowd-Pool": f"pool-{index}"})
            assert response.status == 403
            assert response.headers["X-Borrowd-Reason"] == "pool_not_served"
        assert (await client.get("/admit", headers=_batch())).status == 200
    finally:
        await client.close()
    service = GateService(connect_async(redis_url), GateServiceConfig(pools=(POOL,)))
    for index in range(50):
        with pytest.raises(Forbidden):
            service.gate(f"pool-{index}")
    assert list(service._gates) == [POOL]
    await service.client.aclose()


async def test_a_live_id_cannot_be_readmitted_bigger(redis_url) -> None:
    """Retrying an admitted id with a 150x larger prompt is denied, not admitted free."""
    _publish(redis_url)
    client = await _client(redis_url)
    try:
        assert (await client.get("/admit", headers=_batch("r1", prompt="20"))).status == 200
        again = await client.get("/admit", headers=_batch("r1", prompt="3000"))
        assert (again.status, again.headers["X-Borrowd-Reason"]) == (429, "duplicate_mismatch")
        same = await client.get("/admit", headers=_batch("r1", prompt="20"))
        assert (same.status, same.headers["X-Borrowd-Reason"]) == (200, "duplicate")
    finally:
        await client.close()


@pytest.mark.parametrize(
    ("table", "needle"),
    [({"pools": ["p"], "decision_timeout_s": float("nan")}, "gate.decision_timeout_s"),
     ({"pools": ["p"], "lease_ms": 0}, "gate.lease_ms: 0"),
     ({"pools": ["p"], "batch_priority": 0}, "gate.batch_priority: 0"),
     ({"pools": []}, "pools"),
     ({"pools": ["p"], "listen": ":8089"}, "gate.listen: bad value ':8089'"),
     ({"pools": ["p"], "listen": "0.0.0.0:8089"}, "not a loopback address"),
     ({"pools": ["p"], "callers": [{"name": "n", "secret": "short"}]}, "shorter than"),
     ({"pools": ["p"], "bogus": 1}, "gate.bogus: unknown key")],
    ids=["nan-timeout", "zero-lease", "batch-not-after-interactive", "no-pools",
         "implicit-all-interfaces", "public-without-secret", "short-secret", "unknown-key"],
)
def test_gate_config_errors_name_the_key(table, needle) -> None:
    """The gate's config goes through the one loader: one line naming key and value."""
    with pytest.raises(ConfigError, match=re.escape(needle)):
        gate_config({"gate": table}, {})


def test_gate_config_file_and_secret_from_environment(tmp_path) -> None:
    """A [gate] file loads; without callers, BORROWD_GATE_SECRET is the one caller's."""
    path = tmp_path / "gate.toml"
    path.write_text('[gate]\npools = ["chat", "code"]\nlisten = "0.0.0.0:8089"\n')
    config = load_gate_config(path, {"BORROWD_GATE_SECRET": "s" * 20})
    assert (config.default_pool, config.pools) == ("chat", ("chat", "code"))
    assert [c.name for c in config.callers] == ["router"]
    with pytest.raises(ConfigError, match=str(path)):
        load_gate_config(path, {})
