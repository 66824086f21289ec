"""The proxy's OpenAI wire format as the real `openai` SDK reads it, in front of scripted
vLLM-like upstreams (tool calls, reasoning, logprobs, in-stream errors, 503/429 with
Retry-After), with a real redis-server and gate for batch admission."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from aiohttp import web
from borrowd.adapters.gate import AsyncGate
from borrowd.adapters.proxy.app import ProxyServer
from borrowd.adapters.proxy.app import serve as serve_proxy
from borrowd.adapters.proxy.config import parse_config
from borrowd.adapters.redis_conn import connect, connect_async
from borrowd.adapters.store import BudgetStore
from borrowd.models.budget import Budget, Mode, closed_budget

from tests.support.servers import ServerProcess, free_port

pytestmark = pytest.mark.integration

POOL = "wire"
MODEL = "m"
CHAT_KEY = "sk-chat"
BATCH_KEY = "sk-batch"
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def _chunk(delta: dict[str, Any], finish: str | None = None, **choice: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **choice}]}


SCRIPTS: dict[str, list[dict[str, Any]]] = {
    "tools": [
        _chunk({"role": "assistant", "reasoning_content": "I should "}),
        _chunk({"reasoning_content": "call it"},
               logprobs={"content": [{"token": "x", "logprob": -0.5, "bytes": None,
                                      "top_logprobs": []}]}),
        _chunk({"tool_calls": [{"index": 0, "id": "call_9", "type": "function",
                                "function": {"name": "weather", "arguments": '{"ci'}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]}),
        _chunk({}, "tool_calls"),
    ],
    "words": [_chunk({"role": "assistant", "content": ""})]
    + [_chunk({"content": f" w{i}"}) for i in range(5)] + [_chunk({}, "stop")],
}


async def _upstream(request: web.Request) -> web.StreamResponse:
    """A vLLM-like server: the last user message picks the script; `error` ends the stream
    with an error event; `slow` streams for seconds; `busy`/`limit` answer 503/429."""
    body = await request.json()
    cue = body["messages"][-1]["content"]
    if cue in ("busy", "limit"):
        status = 503 if cue == "busy" else 429
        return web.json_response({"error": {"message": "try later", "type": "busy",
                                            "param": None, "code": status}},
                                 status=status, headers={"Retry-After": "7"})
    options = body.get("stream_options") or {}
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    chunks = SCRIPTS.get(cue, SCRIPTS["words"])
    if cue == "slow":
        chunks = [_chunk({"content": f" s{i}"}) for i in range(400)]
    for index, chunk in enumerate(chunks, start=1):
        if options.get("continuous_usage_stats"):
            chunk = {**chunk, "usage": {"prompt_tokens": 3, "completion_tokens": index,
                                        "total_tokens": 3 + index}}
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if cue == "error" and index == 2:
            error = {"error": {"message": "engine failed", "type": "InternalServerError",
                               "param": None, "code": 500}}
            await response.write(b"data: " + json.dumps(error).encode() + b"\n\n")
            break
        if cue == "slow":
            await asyncio.sleep(0.01)
    else:
        if options.get("include_usage"):
            usage = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                     "model": MODEL, "choices": [],
                     "usage": {"prompt_tokens": 3, "completion_tokens": len(chunks),
                               "total_tokens": 3 + len(chunks)}}
            await response.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    return response


async def _always_busy(_request: web.Request) -> web.Response:
    return web.json_response({"error": {"message": "no capacity", "type": "busy", "param": None,
                                        "code": 503}}, status=503, headers={"Retry-After": "7"})


@contextlib.asynccontextmanager
async def _site(handler) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def _publish(redis_proc: ServerProcess, budget: Budget) -> None:
    client = connect(redis_proc.extra["url"])
    try:
        BudgetStore(client, POOL).publish(budget, epoch=1, ttl_ms=60_000, now_s=time.time())
    finally:
        client.close()


def _open_budget() -> Budget:
    return Budget(pool=POOL, mode=Mode.OPEN, reason="test", batch_tokens_per_s=1e6,
                  batch_burst_tokens=1_000_000, max_batch_seqs=8,
                  max_batch_kv_tokens=1_000_000, max_batch_output_tokens=4096)


@contextlib.asynccontextmanager
async def _proxy(redis_proc: ServerProcess, upstreams: list[str]) -> AsyncIterator[ProxyServer]:
    config = parse_config({
        "proxy": {"pool": POOL, "upstreams": upstreams},
        "admission": {"gate_timeout_s": 0.5},
        "tenants": {"chat": {"keys": [CHAT_KEY], "class": "interactive"},
                    "etl": {"keys": [BATCH_KEY], "class": "batch"}},
    })
    client = connect_async(redis_proc.extra["url"])
    proxy = ProxyServer(config, AsyncGate(client, POOL))
    port = free_port()
    runner = await serve_proxy(proxy, "127.0.0.1", port)
    proxy.url = f"http://127.0.0.1:{port}/v1"  # type: ignore[attr-defined]
    _publish(redis_proc, _open_budget())
    try:
        yield proxy
    finally:
        await runner.cleanup()
        await client.aclose()


def _sdk(proxy: ProxyServer, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=proxy.url, api_key=key,  # type: ignore[attr-defined]
                              max_retries=0, timeout=10.0)


async def _drain(stream: Any) -> None:
    """Read a stream to its end."""
    async for _ in stream:
        continue


def _said(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def _outcomes(proxy: ProxyServer, klass: str, outcome: str) -> float:
    value = proxy.registry.get_sample_value(
        "borrowd_proxy_requests_total", {"pool": POOL, "class": klass, "outcome": outcome})
    return value or 0.0


async def test_non_streaming_batch_keeps_tool_calls_reasoning_and_logprobs(
        redis_proc: ServerProcess) -> None:
    """A batch answer the proxy assembles from the stream parses in the SDK with its tool
    call, reasoning and logprobs, as vLLM's own non-streaming answer would."""
    async with (_site(_upstream) as upstream, _proxy(redis_proc, [upstream]) as proxy,
                _sdk(proxy, BATCH_KEY) as sdk):
        answer = await sdk.chat.completions.create(model=MODEL, messages=_said("tools"),
                                                   tools=TOOLS, logprobs=True)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None
    call = choice.message.tool_calls[0]
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == (
        "call_9", "weather", {"city": "Paris"})
    assert (choice.message.model_extra or {})["reasoning_content"] == "I should call it"
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [t.token for t in choice.logprobs.content] == ["x"]


async def test_in_stream_errors_are_errors(redis_proc: ServerProcess) -> None:
    """vLLM's error event mid-stream: a non-streaming batch client gets the error status (not
    200 with finish_reason null), a streaming one the SDK's APIError; both count as errors."""
    async with _site(_upstream) as upstream, _proxy(redis_proc, [upstream]) as proxy:
        async with _sdk(proxy, BATCH_KEY) as sdk:
            with pytest.raises(openai.InternalServerError) as whole:
                await sdk.chat.completions.create(model=MODEL, messages=_said("error"))
            stream = await sdk.chat.completions.create(model=MODEL, messages=_said("error"),
                                                       stream=True)
            with pytest.raises(openai.APIError, match="engine failed"):
                await _drain(stream)
        async with _sdk(proxy, CHAT_KEY) as sdk:
            stream = await sdk.chat.completions.create(model=MODEL, messages=_said("error"),
                                                       stream=True)
            with pytest.raises(openai.APIError, match="engine failed"):
                await _drain(stream)
        await asyncio.sleep(0.05)
        assert whole.value.status_code == 500
        assert _outcomes(proxy, "batch", "error") == 2
        assert _outcomes(proxy, "interactive", "error") == 1
        assert _outcomes(proxy, "batch", "success") == 0


@pytest.mark.parametrize("include_usage", [False, True], ids=["not-asked", "asked"])
async def test_batch_streams_carry_usage_only_when_asked(redis_proc: ServerProcess,
                                                         include_usage: bool) -> None:
    """The per-chunk usage the proxy asks vLLM for on a batch stream stays with the proxy;
    a client that asked for usage gets exactly one final usage chunk."""
    async with _site(_upstream) as upstream, _proxy(redis_proc, [upstream]) as proxy:
        async with _sdk(proxy, BATCH_KEY) as sdk:
            extra: dict[str, Any] = ({"stream_options": {"include_usage": True}}
                                     if include_usage else {})
            stream = await sdk.chat.completions.create(model=MODEL, messages=_said("words"),
                                                       stream=True, **extra)
            chunks = [chunk async for chunk in stream]
        await asyncio.sleep(0.05)
        assert _outcomes(proxy, "batch", "success") == 1
    with_usage = [c for c in chunks if c.usage is not None]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == " w0 w1 w2 w3 w4"
    if include_usage:
        assert len(with_usage) == 1 and with_usage[0] is chunks[-1]
        assert not chunks[-1].choices
    else:
        assert with_usage == []


async def test_503_goes_to_the_next_upstream_and_statuses_keep_retry_after(
        redis_proc: ServerProcess) -> None:
    """One upstream answering 503 ("try another instance"): every request is served by the
    other. With nothing else to try, the client gets the 503 (and a 429) itself, with the
    upstream's Retry-After."""
    async with _site(_always_busy) as busy, _site(_upstream) as good:
        async with _proxy(redis_proc, [busy, good]) as proxy, _sdk(proxy, CHAT_KEY) as sdk:
            for _ in range(6):
                answer = await sdk.chat.completions.create(model=MODEL, messages=_said("words"),
                                                           stream=True)
                assert [c async for c in answer]
        async with _proxy(redis_proc, [good]) as proxy, _sdk(proxy, CHAT_KEY) as sdk:
            for cue, error in (("busy", openai.InternalServerError),
                               ("limit", openai.RateLimitError)):
                with pytest.raises(error) as info:
                    await sdk.chat.completions.create(model=MODEL, messages=_said(cue))
                assert info.value.response.headers["retry-after"] == "7"
                assert info.value.status_code == (503 if cue == "busy" else 429)


async def test_a_revoked_stream_is_an_error_to_a_typed_client_unless_it_opted_in(
        redis_proc: ServerProcess) -> None:
    """By default the SDK sees a revoked batch stream end with an APIError (its strict
    models have no `preempted`); with `X-Borrowd-Resumable: 1` the stream ends with
    finish_reason preempted and the text so far."""
    async with _site(_upstream) as upstream, _proxy(redis_proc, [upstream]) as proxy:
        for opted_in in (False, True):
            _publish(redis_proc, _open_budget())
            headers = {"X-Borrowd-Resumable": "1"} if opted_in else {}
            async with _sdk(proxy, BATCH_KEY) as sdk:
                stream = await sdk.chat.completions.create(
                    model=MODEL, messages=_said("slow"), stream=True, extra_headers=headers)
                chunks = []
                with contextlib.ExitStack() as raises:
                    if not opted_in:
                        raises.enter_context(pytest.raises(openai.APIError, match="revoked"))
                    async for chunk in stream:
                        chunks.append(chunk)
                        if len(chunks) == 3:
                            _publish(redis_proc, closed_budget(POOL, Mode.CLOSED, "cut"))
            if opted_in:
                final = chunks[-1].choices[0]
                assert final.finish_reason == "preempted"
                assert (final.model_extra or {})["borrowd_text"].startswith(" s0 s1 s2")
