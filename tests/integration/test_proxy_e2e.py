"""The proxy end to end over real HTTP: proxy + emulator + a real redis-server and the gate.

Both servers run as in-process aiohttp apps on free loopback ports; the budget is
published with the real budget store, so admission and revocation go through the gate's
Lua scripts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp import web
from borrowd.adapters.emulator.app import EmulatorConfig, EmulatorServer
from borrowd.adapters.emulator.app import serve as serve_emulator
from borrowd.adapters.gate import AsyncGate
from borrowd.adapters.proxy.app import ProxyServer
from borrowd.adapters.proxy.app import serve as serve_proxy
from borrowd.adapters.proxy.buckets import ITL_BUCKETS_S, TTFT_BUCKETS_S
from borrowd.adapters.proxy.config import parse_config
from borrowd.adapters.redis_conn import connect, connect_async
from borrowd.adapters.store import BudgetStore
from borrowd.models.budget import Budget, Mode, closed_budget

from tests.support.servers import ServerProcess, free_port

pytestmark = pytest.mark.integration

POOL = "e2e"
MODEL = "emulated-llama-3-8b"
INTERACTIVE_KEY = "sk-chat"
BATCH_KEY = "sk-etl"
BATCH_PRIORITY = 10


@dataclass
class Stack:
    """The running servers and their handles."""

    proxy: ProxyServer
    emulator: EmulatorServer
    redis: ServerProcess
    url: str
    session: aiohttp.ClientSession

    def publish(self, **overrides) -> Budget:
        """Publish an open budget (overridable fields) through the real budget store."""
        fields = dict(pool=POOL, mode=Mode.OPEN, reason="test", batch_tokens_per_s=1e6,
                      batch_burst_tokens=1_000_000, max_batch_seqs=8,
                      max_batch_kv_tokens=1_000_000, max_batch_output_tokens=4096)
        fields.update(overrides)
        return self._publish(Budget(**fields))

    def close_budget(self) -> Budget:
        """Publish a closed budget (revokes every in-flight batch request)."""
        return self._publish(closed_budget(POOL, Mode.CLOSED, "test cut"))

    def _publish(self, budget: Budget) -> Budget:
        client = connect(self.redis.extra["url"])
        try:
            return BudgetStore(client, POOL).publish(budget, epoch=1, ttl_ms=60_000,
                                                     now_s=time.time())
        finally:
            client.close()

    async def post(self, key: str | None, body: dict | bytes, *, path: str = "/v1/chat/completions",
                   headers: dict[str, str] | None = None) -> aiohttp.ClientResponse:
        """POST to the proxy with `key` as the bearer key."""
        all_headers = {"Content-Type": "application/json", **(headers or {})}
        if key is not None:
            all_headers["Authorization"] = f"Bearer {key}"
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return await self.session.post(self.url + path, data=data, headers=all_headers)

    async def metrics(self) -> str:
        """The proxy's /metrics text."""
        async with self.session.get(self.url + "/metrics") as resp:
            return await resp.text()


def _config(upstream: str, **proxy_overrides) -> dict:
    return {
        "proxy": {"pool": POOL, "upstreams": [upstream], "batch_priority": BATCH_PRIORITY,
                  "interactive_priority": 0, "max_body_bytes": 64 * 1024, **proxy_overrides},
        "admission": {"gate_timeout_s": 0.3, "queue_max_wait_s": 5.0},
        "tenants": {"chat": {"keys": [INTERACTIVE_KEY], "class": "interactive"},
                    "etl": {"keys": [BATCH_KEY], "class": "batch"}},
    }


@contextlib.asynccontextmanager
async def _start(redis_proc: ServerProcess, config: dict, emulator: EmulatorServer,
                 emulator_port: int) -> AsyncIterator[Stack]:
    emulator_runner = await serve_emulator(emulator, "127.0.0.1", emulator_port)
    client = connect_async(redis_proc.extra["url"], connect_timeout_s=0.5)
    gate = AsyncGate(client, POOL, lease_ms=config["admission"].get("lease_ms", 10_000),
                     batch_priority=BATCH_PRIORITY)
    proxy = ProxyServer(parse_config(config), gate)
    port = free_port()
    proxy_runner = await serve_proxy(proxy, "127.0.0.1", port)
    session = aiohttp.ClientSession()
    try:
        yield Stack(proxy, emulator, redis_proc, f"http://127.0.0.1:{port}", session)
    finally:
        await session.close()
        await proxy_runner.cleanup()
        await emulator_runner.cleanup()
        await client.aclose()


@pytest.fixture
async def stack(redis_proc: ServerProcess) -> AsyncIterator[Stack]:
    """Proxy -> emulator (real-time H100 profile, small KV) with a real gate."""
    emulator_port = free_port()
    emulator = EmulatorServer(EmulatorConfig(kv_capacity_tokens=65_536, max_model_len=32_768))
    async with _start(redis_proc, _config(f"http://127.0.0.1:{emulator_port}"), emulator,
                      emulator_port) as item:
        yield item


def _chat(max_tokens: int | None = 8, stream: bool = False, **extra) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "say something"}],
            "stream": stream, **extra}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


async def _events(resp: aiohttp.ClientResponse, limit: int | None = None) -> list[dict]:
    """Parsed `data:` payloads of an SSE response (stops after `limit` token chunks)."""
    events: list[dict] = []
    tokens = 0
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            events.append({"done": True})
            break
        event = json.loads(payload)
        events.append(event)
        if any((c.get("delta") or {}).get("content") for c in event.get("choices", [])):
            tokens += 1
            if limit is not None and tokens >= limit:
                break
    return events


def _text(events: list[dict]) -> str:
    return "".join((c.get("delta") or {}).get("content") or ""
                   for e in events for c in e.get("choices", []))


async def _until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def _priority_of(stack: Stack, resp: aiohttp.ClientResponse) -> int:
    return stack.emulator.runtime.priorities_seen[resp.headers["X-Request-Id"]]


# -- class mapping, spoofing, priority ---------------------------------------------------


@pytest.mark.parametrize(
    ("key", "headers", "body_extra", "want_class", "want_priority"),
    [
        (INTERACTIVE_KEY, {}, {}, "interactive", 0),
        (BATCH_KEY, {}, {}, "batch", BATCH_PRIORITY),
        (BATCH_KEY, {"X-Borrowd-Class": "interactive"}, {"priority": -100}, "batch",
         BATCH_PRIORITY),
        (INTERACTIVE_KEY, {"X-Borrowd-Class": "batch"}, {}, "batch", BATCH_PRIORITY),
        (INTERACTIVE_KEY, {}, {"priority": 50}, "interactive", 0),
    ],
    ids=["interactive-key", "batch-key", "batch-spoofs-interactive", "interactive-demotes",
         "client-priority-overwritten"],
)
async def test_class_comes_from_the_key_and_priority_is_injected(
    stack: Stack, key: str, headers: dict, body_extra: dict, want_class: str, want_priority: int
) -> None:
    """The tenant's class decides the priority the engine sees; clients cannot promote."""
    stack.publish()
    async with await stack.post(key, _chat(**body_extra), headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["X-Borrowd-Class"] == want_class
        assert _priority_of(stack, resp) == want_priority
        body = await resp.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 8


async def test_streams_pass_through_with_usage_only_when_asked(stack: Stack) -> None:
    """An interactive stream arrives token by token; the usage chunk only if requested."""
    async with await stack.post(INTERACTIVE_KEY, _chat(5, stream=True)) as resp:
        assert resp.status == 200
        plain = await _events(resp)
    async with await stack.post(INTERACTIVE_KEY, _chat(
            5, stream=True, stream_options={"include_usage": True})) as resp:
        with_usage = await _events(resp)
    assert _text(plain) == " the quick brown fox jumps"
    assert plain[-1] == {"done": True}
    assert not any("usage" in e for e in plain)
    assert with_usage[-2]["usage"]["completion_tokens"] == 5


# -- caps and admission ------------------------------------------------------------------


async def test_batch_max_tokens_clamped_to_output_cap(stack: Stack) -> None:
    """A batch request asking for more than the budget's output cap gets the cap."""
    stack.publish(max_batch_output_tokens=6)
    async with await stack.post(BATCH_KEY, _chat(50)) as resp:
        assert resp.status == 200
        body = await resp.json()
    assert body["usage"]["completion_tokens"] == 6
    assert body["choices"][0]["message"]["content"] == " the quick brown fox jumps over"
    assert 'outcome="truncated"' in await stack.metrics()


async def test_denied_batch_gets_429_while_interactive_passes(stack: Stack) -> None:
    """Without a budget record batch is refused with Retry-After; interactive is served."""
    async with await stack.post(BATCH_KEY, _chat()) as resp:
        assert resp.status == 429
        assert int(resp.headers["Retry-After"]) >= 1
        error = (await resp.json())["error"]
    assert "not admitted" in error["message"]
    async with await stack.post(INTERACTIVE_KEY, _chat()) as resp:
        assert resp.status == 200
    text = await stack.metrics()
    assert 'borrowd_proxy_requests_total{class="batch",outcome="rejected",pool="e2e"} 1.0' in text


async def test_queue_mode_waits_for_a_budget(redis_proc: ServerProcess) -> None:
    """In queue mode a denied batch request waits and is served once a budget appears."""
    emulator_port = free_port()
    config = _config(f"http://127.0.0.1:{emulator_port}")
    config["admission"].update(mode="queue", queue_poll_min_s=0.05)
    emulator = EmulatorServer(EmulatorConfig(kv_capacity_tokens=65_536, max_model_len=32_768))
    async with _start(redis_proc, config, emulator, emulator_port) as stack:
        pending = asyncio.create_task(stack.post(BATCH_KEY, _chat(),
                                                 headers={"X-Borrowd-Max-Wait-S": "5"}))
        await asyncio.sleep(0.4)
        assert not pending.done()
        stack.publish()
        async with await pending as resp:
            assert resp.status == 200
        text = await stack.metrics()
        assert 'borrowd_proxy_queue_seconds_count{class="batch",pool="e2e"} 1.0' in text


async def test_client_leaving_the_queue_is_counted(redis_proc: ServerProcess) -> None:
    """A batch client that hangs up while queued leaves the queue and counts as a disconnect."""
    emulator_port = free_port()
    config = _config(f"http://127.0.0.1:{emulator_port}")
    config["admission"].update(mode="queue", queue_poll_min_s=0.05)
    emulator = EmulatorServer(EmulatorConfig(kv_capacity_tokens=65_536, max_model_len=32_768))
    async with _start(redis_proc, config, emulator, emulator_port) as stack:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(stack.post(BATCH_KEY, _chat()), 0.3)
        await _until(lambda: stack.proxy.admitter.queued == 0, 2.0, "the queue to empty")
        await _until(lambda: stack.proxy.registry.get_sample_value(
            "borrowd_proxy_requests_total",
            {"pool": POOL, "class": "batch", "outcome": "client_disconnect"}) == 1.0,
            2.0, "the disconnect to be counted")


async def test_redis_down_fails_batch_closed_and_interactive_open(stack: Stack) -> None:
    """With Redis gone, batch gets 503 with the reason; interactive is served as before."""
    stack.publish()
    stack.redis.kill()
    started = time.monotonic()
    async with await stack.post(BATCH_KEY, _chat()) as resp:
        assert resp.status == 503
        assert "budget store unreachable" in (await resp.json())["error"]["message"]
    assert time.monotonic() - started < 2.0
    started = time.monotonic()
    async with await stack.post(INTERACTIVE_KEY, _chat(4)) as resp:
        assert resp.status == 200
    assert time.monotonic() - started < 1.0


# -- revocation --------------------------------------------------------------------------


RESUMABLE = {"X-Borrowd-Resumable": "1"}


async def test_revoked_stream_ends_with_a_resumable_chunk(stack: Stack) -> None:
    """A budget cut ends an opted-in batch stream with finish_reason preempted, its text and
    usage."""
    stack.publish()
    async with await stack.post(BATCH_KEY, _chat(3000, stream=True),
                                headers=RESUMABLE) as resp:
        assert resp.status == 200
        request_id = resp.headers["X-Request-Id"]
        head = await _events(resp, limit=5)
        assert request_id in stack.emulator.runtime.tracked
        stack.close_budget()
        rest = await _events(resp)
    events = head + rest
    final = events[-2]
    choice = final["choices"][0]
    assert events[-1] == {"done": True}
    assert choice["finish_reason"] == "preempted"
    assert choice["borrowd_text"] == _text(events)
    assert final["usage"]["completion_tokens"] == len(_text(events).split())
    assert final["usage"]["completion_tokens"] < 3000
    await _until(lambda: request_id not in stack.emulator.runtime.tracked, 2.0,
                 "the emulator to abort the revoked request")
    assert stack.emulator.runtime.engine.kv_usage_frac() == 0.0
    text = await stack.metrics()
    assert 'borrowd_proxy_revocations_total{pool="e2e"} 1.0' in text
    assert 'borrowd_proxy_requests_total{class="batch",outcome="revoked",pool="e2e"} 1.0' in text


async def test_revoked_stream_ends_with_an_error_event_by_default(stack: Stack) -> None:
    """Without the opt-in, a revoked batch stream ends with an SSE error event (503), which
    typed clients understand, not an unknown finish reason."""
    stack.publish()
    async with await stack.post(BATCH_KEY, _chat(3000, stream=True)) as resp:
        await _events(resp, limit=5)
        stack.close_budget()
        rest = await _events(resp)
    assert rest[-1] == {"done": True}
    assert rest[-2]["error"]["code"] == 503
    assert "revoked" in rest[-2]["error"]["message"]
    assert all(c.get("finish_reason") != "preempted" for e in rest for c in e.get("choices", []))


async def test_revoked_non_streaming_request_gets_503_with_its_partial_text(stack: Stack
                                                                          ) -> None:
    """Without the opt-in, a revoked non-streaming batch request gets 503 + Retry-After with
    the text so far in the error body."""
    stack.publish()
    pending = asyncio.create_task(stack.post(BATCH_KEY, _chat(3000)))
    await _until(lambda: any(t.first_token_s > 0 for t in
                             stack.emulator.runtime.tracked.values()), 5.0, "a first token")
    await asyncio.sleep(0.1)
    stack.close_budget()
    async with await pending as resp:
        assert resp.status == 503
        assert resp.headers["Retry-After"] == "1"
        error = (await resp.json())["error"]
    partial = error["borrowd_partial"]
    assert 0 < partial["usage"]["completion_tokens"] < 3000
    assert len(partial["texts"][0].split()) == partial["usage"]["completion_tokens"]


async def test_revoked_non_streaming_request_returns_partial_json(stack: Stack) -> None:
    """A revoked opted-in non-streaming batch request gets a JSON body, finish_reason
    preempted."""
    stack.publish()
    pending = asyncio.create_task(stack.post(BATCH_KEY, _chat(3000), headers=RESUMABLE))
    await _until(lambda: any(t.first_token_s > 0 for t in
                             stack.emulator.runtime.tracked.values()), 5.0, "a first token")
    await asyncio.sleep(0.1)
    stack.close_budget()
    async with await pending as resp:
        assert resp.status == 200
        body = await resp.json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "preempted"
    assert 0 < body["usage"]["completion_tokens"] < 3000
    assert len(choice["message"]["content"].split()) == body["usage"]["completion_tokens"]


async def test_release_returns_the_reservation(stack: Stack) -> None:
    """After a batch request completes, its sequence seat is free again in the gate."""
    stack.publish(max_batch_seqs=1)
    for _ in range(3):
        async with await stack.post(BATCH_KEY, _chat(4)) as resp:
            assert resp.status == 200
        await _until(lambda: not stack.proxy._pending, 2.0, "the release")
    assert (await stack.proxy.gate.inflight()).seqs == 0


async def test_leases_of_long_streams_are_renewed(redis_proc: ServerProcess) -> None:
    """A batch stream longer than its admission lease keeps its seat: the proxy renews it."""
    emulator_port = free_port()
    config = _config(f"http://127.0.0.1:{emulator_port}")
    config["admission"]["lease_ms"] = 400
    emulator = EmulatorServer(EmulatorConfig(kv_capacity_tokens=65_536, max_model_len=32_768))
    async with _start(redis_proc, config, emulator, emulator_port) as stack:
        stack.publish(max_batch_seqs=1)
        async with await stack.post(BATCH_KEY, _chat(3000, stream=True)) as resp:
            await _events(resp, limit=3)
            await asyncio.sleep(1.2)
            assert (await stack.proxy.gate.inflight()).seqs == 1
            async with await stack.post(BATCH_KEY, _chat(2)) as second:
                assert second.status == 429


async def test_upstream_failure_mid_stream_is_reported(redis_proc: ServerProcess) -> None:
    """An upstream that dies mid-stream is an error event for batch (even opted in to
    resumable endings: it was not preempted) and interactive alike."""

    async def dying(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for word in (" a", " b"):
            chunk = {"id": "x", "model": MODEL, "created": 1,
                     "choices": [{"index": 0, "delta": {"content": word},
                                  "finish_reason": None}]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        assert request.transport is not None
        request.transport.close()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", dying)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    emulator = EmulatorServer(EmulatorConfig(kv_capacity_tokens=65_536, max_model_len=32_768))
    try:
        async with _start(redis_proc, _config(f"http://127.0.0.1:{port}"), emulator,
                          free_port()) as stack:
            stack.publish()
            async with await stack.post(BATCH_KEY, _chat(50, stream=True),
                                        headers=RESUMABLE) as resp:
                batch = await _events(resp)
            async with await stack.post(INTERACTIVE_KEY, _chat(50, stream=True)) as resp:
                interactive = await _events(resp)
    finally:
        await runner.cleanup()
    assert _text(batch) == " a b"
    assert "upstream failed mid-stream" in batch[-2]["error"]["message"]
    assert batch[-1] == {"done": True}
    assert "upstream failed mid-stream" in interactive[-2]["error"]["message"]
    assert interactive[-1] == {"done": True}


# -- disconnects -------------------------------------------------------------------------


async def test_client_disconnect_aborts_upstream_and_frees_kv(stack: Stack) -> None:
    """A client that hangs up mid-stream makes the emulator abort and free the KV."""
    resp = await stack.post(INTERACTIVE_KEY, _chat(3000, stream=True))
    request_id = resp.headers["X-Request-Id"]
    await _events(resp, limit=3)
    assert stack.emulator.runtime.engine.kv_usage_frac() > 0
    resp.close()
    await _until(lambda: request_id not in stack.emulator.runtime.tracked, 2.0,
                 "the emulator to abort the request")
    await _until(lambda: stack.emulator.runtime.engine.kv_usage_frac() == 0.0, 2.0, "KV freed")
    await _until(lambda: _client_disconnects(stack) == 1.0, 2.0, "the disconnect to be counted")


def _client_disconnects(stack: Stack) -> float | None:
    return stack.proxy.registry.get_sample_value(
        "borrowd_proxy_requests_total",
        {"pool": POOL, "class": "interactive", "outcome": "client_disconnect"})


# -- metrics -----------------------------------------------------------------------------


async def test_metrics_have_the_contract_names_and_vllm_buckets(stack: Stack) -> None:
    """/metrics carries every contract series per class, with vLLM's TTFT and ITL buckets."""
    stack.publish()
    async with await stack.post(INTERACTIVE_KEY, _chat(4, stream=True)) as resp:
        await _events(resp)
    async with await stack.post(BATCH_KEY, _chat(4, stream=True)) as resp:
        await _events(resp)
    text = await stack.metrics()
    for klass in ("interactive", "batch"):
        labels = f'class="{klass}",pool="e2e"'
        served = f'batch_eligible="true",{labels}'  # the one upstream may take batch
        assert f"borrowd_proxy_ttft_seconds_count{{{served}}} 1.0" in text
        assert f"borrowd_proxy_itl_seconds_count{{{served}}} 3.0" in text
        assert f'borrowd_proxy_requests_total{{class="{klass}",outcome="success",pool="e2e"}} 1.0' \
            in text
        assert f'borrowd_proxy_tokens_total{{class="{klass}",kind="output",pool="e2e"}} 4.0' in text
        assert f"borrowd_proxy_inflight{{{labels}}} 0.0" in text
        assert f"borrowd_proxy_oldest_wait_seconds{{{labels}}} 0.0" in text
    ttft_les = [f'le="{b}"' for b in TTFT_BUCKETS_S]
    itl_les = [f'le="{b}"' for b in ITL_BUCKETS_S]
    ttft_lines = [line for line in text.splitlines()
                  if line.startswith('borrowd_proxy_ttft_seconds_bucket{batch_eligible="true",'
                                     'class="batch"')]
    itl_lines = [line for line in text.splitlines()
                 if line.startswith('borrowd_proxy_itl_seconds_bucket{batch_eligible="true",'
                                    'class="batch"')]
    assert [le for le in ttft_les if any(le in line for line in ttft_lines)] == ttft_les
    assert [le for le in itl_les if any(le in line for line in itl_lines)] == itl_les
    assert 'borrowd_proxy_revocations_total{pool="e2e"} 0.0' in text
    assert "borrowd_proxy_queue_seconds_bucket" in text


async def test_oldest_wait_reports_a_request_waiting_for_its_first_token(stack: Stack) -> None:
    """While a request waits for its first token the oldest-wait gauge is its age."""
    pending = asyncio.create_task(stack.post(INTERACTIVE_KEY, {
        **_chat(2), "borrowd_prompt_tokens": 30_000}))
    await _until(lambda: stack.proxy.metrics.tracker.oldest_wait_s("interactive",
                                                                   time.monotonic()) > 0.05,
                 5.0, "a waiting request")
    value = stack.proxy.registry.get_sample_value(
        "borrowd_proxy_oldest_wait_seconds", {"pool": POOL, "class": "interactive"})
    assert value is not None and value > 0.05
    async with await pending as resp:
        assert resp.status == 200


# -- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "body", "path", "status", "field"),
    [
        (INTERACTIVE_KEY, b"{not json", "/v1/chat/completions", 400, "body"),
        (INTERACTIVE_KEY, b"[1, 2]", "/v1/chat/completions", 400, "body"),
        (INTERACTIVE_KEY, {"messages": [{"role": "user", "content": "x"}]},
         "/v1/chat/completions", 400, "model"),
        (INTERACTIVE_KEY, {"model": MODEL}, "/v1/chat/completions", 400, "messages"),
        (INTERACTIVE_KEY, {"model": MODEL, "messages": [{"content": "x"}]},
         "/v1/chat/completions", 400, "messages[0].role"),
        (INTERACTIVE_KEY, {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                           "max_tokens": -3}, "/v1/chat/completions", 400, "max_tokens"),
        (INTERACTIVE_KEY, {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                           "stream": "yes"}, "/v1/chat/completions", 400, "stream"),
        (INTERACTIVE_KEY, {"model": MODEL, "prompt": 7}, "/v1/completions", 400, "prompt"),
        (INTERACTIVE_KEY, b"x" * (64 * 1024 + 1), "/v1/completions", 413, "body"),
        (None, {"model": MODEL, "prompt": "hi"}, "/v1/completions", 401, None),
        ("sk-unknown", {"model": MODEL, "prompt": "hi"}, "/v1/completions", 401, None),
    ],
    ids=["malformed-json", "not-an-object", "no-model", "no-messages", "no-role",
         "negative-max-tokens", "stream-not-bool", "bad-prompt", "too-large", "no-key",
         "unknown-key"],
)
async def test_bad_input_is_refused_with_the_field_named(
    stack: Stack, key: str | None, body, path: str, status: int, field: str | None
) -> None:
    """Every malformed request gets its status and an OpenAI error naming the field."""
    async with await stack.post(key, body, path=path) as resp:
        assert resp.status == status
        error = (await resp.json())["error"]
    assert error["param"] == field
    if field is not None:
        assert field in error["message"]
    assert not stack.emulator.runtime.priorities_seen


async def test_upstream_errors_are_relayed_or_reported(stack: Stack) -> None:
    """An upstream 4xx is relayed as is; /v1/models is served through the proxy."""
    async with await stack.post(INTERACTIVE_KEY, {**_chat(), "model": "other"}) as resp:
        assert resp.status == 404
        assert "does not exist" in (await resp.json())["error"]["message"]
    async with stack.session.get(stack.url + "/v1/models",
                                 headers={"Authorization": f"Bearer {INTERACTIVE_KEY}"}) as resp:
        assert resp.status == 200
        assert (await resp.json())["data"][0]["id"] == MODEL


async def test_unreachable_or_failing_upstream_is_reported(redis_proc: ServerProcess) -> None:
    """No upstream listening is a 502; one answering 500 keeps its status; neither body
    shows the upstream's address."""
    dead_port = free_port()

    async def broken(_request: web.Request) -> web.Response:
        return web.Response(status=500, text="engine dead")

    broken_app = web.Application()
    broken_app.router.add_post("/v1/chat/completions", broken)
    runner = web.AppRunner(broken_app)
    await runner.setup()
    broken_port = free_port()
    await web.TCPSite(runner, "127.0.0.1", broken_port).start()
    try:
        for upstream, status, needle in (
                (f"http://127.0.0.1:{dead_port}", 502, "no upstream reachable"),
                (f"http://127.0.0.1:{broken_port}", 500, "answered 500")):
            client = connect_async(redis_proc.extra["url"])
            proxy = ProxyServer(parse_config(_config(upstream)), AsyncGate(client, POOL))
            port = free_port()
            proxy_runner = await serve_proxy(proxy, "127.0.0.1", port)
            try:
                async with aiohttp.ClientSession() as session, session.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions", json=_chat(),
                    headers={"Authorization": f"Bearer {INTERACTIVE_KEY}"},
                ) as resp:
                    assert resp.status == status
                    text = await resp.text()
                    assert needle in json.loads(text)["error"]["message"]
                    assert "127.0.0.1" not in text
            finally:
                await proxy_runner.cleanup()
                await client.aclose()
    finally:
        await runner.cleanup()
