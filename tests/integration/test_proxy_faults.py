"""Faults around the proxy with real servers: Redis killed or restarted empty under admitted
batch streams (lease_lost), SIGTERM to a real proxy process (batch ends resumably), batch
prompts charged by the proxy's count, and connections kept for interactive work."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from borrowd.adapters.emulator.app import EmulatorConfig, EmulatorServer
from borrowd.adapters.emulator.app import serve as serve_emulator
from borrowd.adapters.gate import AsyncGate
from borrowd.adapters.proxy.app import ProxyServer
from borrowd.adapters.proxy.app import serve as serve_proxy
from borrowd.adapters.proxy.config import parse_config
from borrowd.adapters.redis_conn import connect, connect_async
from borrowd.adapters.store import BudgetStore
from borrowd.models.budget import Budget, Mode

from tests.support.daemon_harness import borrowd_command
from tests.support.servers import ServerProcess, free_port, start_process, start_redis

pytestmark = pytest.mark.integration

POOL = "faults"
MODEL = "emulated-llama-3-8b"
CHAT_KEY = "sk-chat"
BATCH_KEY = "sk-batch"
RESUMABLE = {"X-Borrowd-Resumable": "1"}


def _publish(redis_url: str, **overrides: Any) -> None:
    fields: dict[str, Any] = dict(pool=POOL, mode=Mode.OPEN, reason="test",
                                  batch_tokens_per_s=1e6, batch_burst_tokens=1_000_000,
                                  max_batch_seqs=8, max_batch_kv_tokens=1_000_000,
                                  max_batch_output_tokens=4096)
    fields.update(overrides)
    client = connect(redis_url)
    try:
        BudgetStore(client, POOL).publish(Budget(**fields), epoch=1, ttl_ms=60_000,
                                          now_s=time.time())
    finally:
        client.close()


def _config(upstream: str, *, lease_ms: int = 10_000, **proxy: Any) -> dict[str, Any]:
    return {
        "proxy": {"pool": POOL, "upstreams": [upstream], **proxy},
        "admission": {"gate_timeout_s": 0.3, "lease_ms": lease_ms},
        "tenants": {"chat": {"keys": [CHAT_KEY], "class": "interactive"},
                    "etl": {"keys": [BATCH_KEY], "class": "batch"}},
    }


@contextlib.asynccontextmanager
async def _stack(redis_url: str, config: dict[str, Any]) -> AsyncIterator[str]:
    """An in-process emulator and proxy (config's upstream is replaced); yields the URL."""
    emulator_port = free_port()
    config["proxy"]["upstreams"] = [f"http://127.0.0.1:{emulator_port}"]
    emulator = EmulatorServer(EmulatorConfig(kv_capacity_tokens=200_000, max_model_len=32_768))
    emulator_runner = await serve_emulator(emulator, "127.0.0.1", emulator_port)
    client = connect_async(redis_url, connect_timeout_s=0.3)
    proxy = ProxyServer(parse_config(config), AsyncGate(
        client, POOL, lease_ms=config["admission"]["lease_ms"]))
    port = free_port()
    runner = await serve_proxy(proxy, "127.0.0.1", port, shutdown_timeout_s=1.0)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
        await emulator_runner.cleanup()
        with contextlib.suppress(Exception):
            await client.aclose()


def _chat(max_tokens: int, stream: bool, content: str = "go", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "stream": stream, **extra}


def _headers(key: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **(extra or {})}


async def _events(resp: aiohttp.ClientResponse, limit: int | None = None) -> list[dict]:
    """`data:` payloads of an SSE response (stops after `limit` events)."""
    events: list[dict] = []
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data: "):
            continue
        payload = line[6:]
        events.append({"done": True} if payload == b"[DONE]" else json.loads(payload))
        if limit is not None and len(events) >= limit:
            break
    return events


@pytest.mark.parametrize("restart", [False, True], ids=["redis-killed", "restarted-empty"])
async def test_batch_never_outlives_its_lease(restart: bool) -> None:
    """Redis killed (renewals fail) or restarted empty (the lease is gone): an admitted batch
    stream ends resumably with reason lease_lost before its lease runs out, not whenever it
    ends; and an empty Redis admits nothing new."""
    redis = start_redis()
    try:
        url = redis.extra["url"]
        _publish(url)
        async with _stack(url, _config("", lease_ms=900)) as proxy_url, \
                aiohttp.ClientSession() as session:
            async with session.post(proxy_url + "/v1/chat/completions",
                                    json=_chat(3000, True),
                                    headers=_headers(BATCH_KEY, RESUMABLE)) as resp:
                assert resp.status == 200
                head = await _events(resp, limit=3)
                redis.kill()
                cut_s = time.monotonic()
                if restart:
                    redis = start_redis(port=redis.port)
                rest = await asyncio.wait_for(_events(resp), 10.0)
                ended_after_s = time.monotonic() - cut_s
            if restart:
                async with session.post(proxy_url + "/v1/chat/completions",
                                        json=_chat(4, False),
                                        headers=_headers(BATCH_KEY)) as denied:
                    assert denied.status in (429, 503)
    finally:
        redis.stop()
    final = rest[-2]["choices"][0]
    assert final["finish_reason"] == "preempted"
    assert final["borrowd_reason"] == "lease_lost"
    assert final["borrowd_text"].startswith("".join(
        c["choices"][0]["delta"].get("content", "") for c in head))
    assert ended_after_s < 0.9 + 0.4  # within the lease, plus loop and restart jitter
    assert rest[-2]["usage"]["completion_tokens"] < 3000


async def test_batch_is_charged_its_counted_prompt(redis_proc: ServerProcess) -> None:
    """A 10,000-byte prompt claimed as 0 tokens is charged as counted: refused by a 5,000-token
    KV cap; a list prompt (50 sequences) is refused for batch, naming the field."""
    url = redis_proc.extra["url"]
    _publish(url, max_batch_kv_tokens=5_000)
    async with _stack(url, _config("")) as proxy_url, aiohttp.ClientSession() as session:
        post = proxy_url + "/v1/chat/completions"
        async with session.post(post, json=_chat(8, False, "x" * 10_000,
                                                 borrowd_prompt_tokens=0),
                                headers=_headers(BATCH_KEY)) as resp:
            assert resp.status == 429
        async with session.post(post, json=_chat(8, False), headers=_headers(BATCH_KEY)) as ok:
            assert ok.status == 200
        async with session.post(proxy_url + "/v1/completions", json={
                "model": MODEL, "prompt": ["a"] * 50, "max_tokens": 4},
                headers=_headers(BATCH_KEY)) as many:
            assert many.status == 400
            assert (await many.json())["error"]["param"] == "prompt"


async def test_release_trues_the_charge_up_to_the_engines_usage(redis_proc: ServerProcess
                                                               ) -> None:
    """The proxy charges its own (byte) count of a prompt at admission; once the engine has
    reported its prompt and output tokens, the release leaves the bucket charged exactly
    those."""
    url = redis_proc.extra["url"]
    burst = 100_000
    _publish(url, batch_tokens_per_s=0.001, batch_burst_tokens=burst)
    async with _stack(url, _config("")) as proxy_url, aiohttp.ClientSession() as session:
        # Charged 4 + 4 ("user") + 100 bytes = 108; the emulator reports the claimed 20.
        async with session.post(proxy_url + "/v1/chat/completions",
                                json=_chat(200, False, "x" * 100, borrowd_prompt_tokens=20),
                                headers=_headers(BATCH_KEY)) as resp:
            assert resp.status == 200
            usage = (await resp.json())["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (20, 200)
        client = connect_async(url)
        gate = AsyncGate(client, POOL)
        try:
            for _ in range(50):
                inflight = await gate.inflight()
                if inflight.seqs == 0:
                    break
                await asyncio.sleep(0.05)
        finally:
            await client.aclose()
    assert inflight.seqs == 0 and inflight.bucket_tokens is not None
    assert abs(burst - inflight.bucket_tokens - (20 + 200)) < 1.0


async def test_connections_are_kept_for_interactive(redis_proc: ServerProcess) -> None:
    """Past max_connections minus the interactive reserve, batch gets 503 + Retry-After
    while interactive is still served."""
    url = redis_proc.extra["url"]
    _publish(url)
    config = _config("", max_connections=6, interactive_reserved_connections=4)
    async with _stack(url, config) as proxy_url, aiohttp.ClientSession() as session:
        port = int(proxy_url.rsplit(":", 1)[1])
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        await asyncio.sleep(0.05)
        post = proxy_url + "/v1/chat/completions"
        async with session.post(post, json=_chat(2, False), headers=_headers(BATCH_KEY)) as b:
            assert b.status == 503
            assert b.headers["Retry-After"] == "1"
        async with session.post(post, json=_chat(2, False), headers=_headers(CHAT_KEY)) as i:
            assert i.status == 200
        for _reader, writer in idle:
            writer.close()


async def _batch_in_flight(session: aiohttp.ClientSession, port: int, count: int) -> None:
    """Wait until the proxy's metrics show `count` batch requests in flight."""
    needle = f'borrowd_proxy_inflight{{class="batch",pool="{POOL}"}} {float(count)}'
    deadline_s = time.monotonic() + 10.0
    while time.monotonic() < deadline_s:
        async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
            if needle in await resp.text():
                return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not {count} batch requests in flight within 10 s")


async def test_sigterm_ends_batch_resumably(redis_proc: ServerProcess, tmp_path: Path) -> None:
    """SIGTERM to a real `borrowd proxy`: an opted-in batch stream ends with preempted
    (reason shutdown) and its text, an opted-in non-streaming one with a preempted body, a
    default one with 503 + its partial text; the process exits 0."""
    cli = borrowd_command()
    url = redis_proc.extra["url"]
    _publish(url)
    emulator_port, proxy_port = free_port(), free_port()
    emulator = start_process("emulator", [cli, "emulate", "--listen",
                                          f"127.0.0.1:{emulator_port}"], emulator_port)
    config = tmp_path / "proxy.toml"
    config.write_text(
        f'[proxy]\nlisten_port = {proxy_port}\npool = "{POOL}"\n'
        f'upstreams = ["http://127.0.0.1:{emulator_port}"]\nredis_url = "{url}"\n'
        f'[tenants.etl]\nkeys = ["{BATCH_KEY}"]\nclass = "batch"\n')
    proxy = start_process("proxy", [cli, "proxy", "--config", str(config)], proxy_port)
    post = f"http://127.0.0.1:{proxy_port}/v1/chat/completions"
    try:
        async with aiohttp.ClientSession() as session:
            whole_resumable = asyncio.create_task(session.post(
                post, json=_chat(3000, False), headers=_headers(BATCH_KEY, RESUMABLE)))
            whole_default = asyncio.create_task(session.post(
                post, json=_chat(3000, False), headers=_headers(BATCH_KEY)))
            async with session.post(post, json=_chat(3000, True),
                                    headers=_headers(BATCH_KEY, RESUMABLE)) as resp:
                head = await _events(resp, limit=5)
                await _batch_in_flight(session, proxy_port, 3)
                await asyncio.sleep(0.2)  # the non-streaming two have generated some text
                proxy.proc.send_signal(signal.SIGTERM)
                rest = await asyncio.wait_for(_events(resp), 10.0)
            async with await whole_resumable as answer:
                resumable_body = await answer.json()
                assert answer.status == 200
            async with await whole_default as answer:
                default_body = await answer.json()
                assert answer.status == 503
        assert await asyncio.to_thread(proxy.proc.wait, 10) == 0
    finally:
        proxy.stop()
        emulator.stop()
    final = rest[-2]["choices"][0]
    assert (final["finish_reason"], final["borrowd_reason"]) == ("preempted", "shutdown")
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in head + rest[:-2])
    assert final["borrowd_text"] == text and text
    choice = resumable_body["choices"][0]
    assert choice["finish_reason"] == "preempted"
    assert choice["message"]["content"]
    partial = default_body["error"]["borrowd_partial"]
    assert partial["usage"]["completion_tokens"] > 0


async def test_idle_connections_cannot_starve_interactive_at_a_low_fd_limit(
        redis_proc: ServerProcess, tmp_path: Path) -> None:
    """A real `borrowd proxy` under a 256 open-file limit, held by 300 idle connections:
    the next interactive request is still served (idle connections make room)."""
    cli = borrowd_command()
    emulator_port, proxy_port = free_port(), free_port()
    emulator = start_process("emulator", [cli, "emulate", "--listen",
                                          f"127.0.0.1:{emulator_port}"], emulator_port)
    config = tmp_path / "proxy.toml"
    config.write_text(
        f'[proxy]\nlisten_port = {proxy_port}\npool = "{POOL}"\n'
        f'upstreams = ["http://127.0.0.1:{emulator_port}"]\n'
        f'redis_url = "{redis_proc.extra["url"]}"\n'
        f'[tenants.chat]\nkeys = ["{CHAT_KEY}"]\nclass = "interactive"\n')

    proxy = start_process("proxy", ["sh", "-c", 'ulimit -n 256 && exec "$0" "$@"', cli,
                                    "proxy", "--config", str(config)], proxy_port)
    idle = []
    try:
        for _ in range(300):
            idle.append(await asyncio.open_connection("127.0.0.1", proxy_port))
        await asyncio.sleep(0.2)
        async with aiohttp.ClientSession() as session, session.post(
                f"http://127.0.0.1:{proxy_port}/v1/chat/completions", json=_chat(4, False),
                headers=_headers(CHAT_KEY), timeout=aiohttp.ClientTimeout(total=10)) as resp:
            assert resp.status == 200
    finally:
        for _reader, writer in idle:
            writer.close()
        proxy.stop()
        emulator.stop()
