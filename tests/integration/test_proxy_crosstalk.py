"""Under concurrent load through the real proxy, every answer belongs to its own request.

The upstream echoes a tag from each request into its answer (whole JSON bodies, SSE streams
and `/v1/models`), and many clients share the proxy's keep-alive connections to it at once:
the cross-client mix-up this pins down handed one client another client's completion.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from borrowd.adapters.emulator.app import EmulatorConfig, EmulatorServer

from tests.integration.test_proxy_e2e import INTERACTIVE_KEY, MODEL, _config, _start
from tests.support.daemon_harness import borrowd_command, to_toml
from tests.support.servers import ServerProcess, free_port, start_process

pytestmark = pytest.mark.integration


async def _tagging_chat(request: web.Request) -> web.StreamResponse:
    """A chat completion whose text is the user's message (streamed when asked)."""
    body = await request.json()
    tag = body["messages"][-1]["content"]
    if not body.get("stream"):
        return web.json_response({
            "id": tag, "object": "chat.completion", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": tag}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for piece in (tag[: len(tag) // 2], tag[len(tag) // 2:]):
        chunk = {"id": tag, "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                 "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    return response


async def _models(_request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


async def _text_of(resp: aiohttp.ClientResponse, stream: bool) -> str:
    if not stream:
        return (await resp.json())["choices"][0]["message"]["content"]
    text = ""
    async for line in resp.content:
        if line.startswith(b"data: {"):
            for choice in json.loads(line[6:])["choices"]:
                text += choice["delta"].get("content") or ""
    return text


async def test_every_client_gets_its_own_answer_under_load(redis_proc: ServerProcess) -> None:
    """48 concurrent clients x 20 requests (whole bodies, streams, /v1/models) through the
    proxy: every answer carries its own request's tag, and none hangs."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _tagging_chat)
    app.router.add_get("/v1/models", _models)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    emulator = EmulatorServer(EmulatorConfig(kv_capacity_tokens=65_536, max_model_len=32_768))
    wrong: list[str] = []
    try:
        async with _start(redis_proc, _config(f"http://127.0.0.1:{port}"), emulator,
                          free_port()) as stack:

            async def client(index: int) -> None:
                for round_ in range(20):
                    kind = (index + round_) % 3
                    if kind == 2:
                        async with stack.session.get(
                                stack.url + "/v1/models",
                                headers={"Authorization": f"Bearer {INTERACTIVE_KEY}"}) as resp:
                            if (await resp.json())["data"][0]["id"] != MODEL:
                                wrong.append(f"models {index}/{round_}")
                        continue
                    tag = f"client-{index}-request-{round_}"
                    body = {"model": MODEL, "stream": kind == 1, "max_tokens": 4,
                            "messages": [{"role": "user", "content": tag}]}
                    async with await stack.post(INTERACTIVE_KEY, body) as resp:
                        got = await _text_of(resp, kind == 1)
                        if resp.status != 200 or got != tag:
                            wrong.append(f"{tag}: {resp.status} {got[:60]!r}")

            await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(48))), 90)
    finally:
        await runner.cleanup()
    assert wrong == []


def _chat_once(url: str, index: int, stream: bool) -> str:
    """One chat request to the proxy; "" when the answer is its own, else what was wrong."""
    body = json.dumps({"model": "emulated", "stream": stream, "max_tokens": 3,
                       "messages": [{"role": "user", "content": f"thread {index}"}]}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {INTERACTIVE_KEY}"})
    with urllib.request.urlopen(request, timeout=20) as resp:
        own_id = resp.headers["X-Request-Id"]
        raw = resp.read()
    if stream:
        ids = {json.loads(line[6:])["id"] for line in raw.split(b"\n")
               if line.startswith(b"data: {")}
        return "" if ids == {own_id} and raw.endswith(b"data: [DONE]\n\n") else (
            f"stream {own_id}: ids {sorted(ids)[:3]}")
    got = json.loads(raw)["id"]
    return "" if got == own_id else f"{own_id}: body of {got}"


def test_separate_processes_never_swap_answers(tmp_path: Path) -> None:
    """`borrowd proxy` in front of `borrowd emulate` as real processes, 8 client threads of
    chat (mostly non-streaming) for up to 2,400 requests: every answer is the request's own
    (the emulator names its answer by the proxy's X-Request-Id)."""
    cli = borrowd_command()
    servers: list[ServerProcess] = []
    try:
        emulator_port = free_port()
        servers.append(start_process("emulator", [
            cli, "emulate", "--listen", f"127.0.0.1:{emulator_port}", "--time-scale", "0.05",
            "--model-name", "emulated"], emulator_port, timeout_s=30))
        proxy_port = free_port()
        config = tmp_path / "proxy.toml"
        config.write_text(to_toml({
            "proxy": {"pool": "crosstalk", "listen_host": "127.0.0.1",
                      "listen_port": proxy_port,
                      "upstreams": [f"http://127.0.0.1:{emulator_port}"],
                      "redis_url": "redis://127.0.0.1:1/0"},
            "tenants": {"chat": {"keys": [INTERACTIVE_KEY], "class": "interactive"}}}))
        servers.append(start_process("proxy", [cli, "proxy", "--config", str(config)],
                                     proxy_port, timeout_s=30))
        url = f"http://127.0.0.1:{proxy_port}"
        deadline_s = time.monotonic() + 30.0

        def thread(index: int) -> list[str]:
            wrong = []
            for round_ in range(300):
                if time.monotonic() > deadline_s:
                    break
                try:
                    problem = _chat_once(url, index, stream=round_ % 5 == 0)
                except (OSError, http.client.HTTPException, ValueError) as exc:
                    problem = f"thread {index} request {round_}: {exc}"
                if problem:
                    wrong.append(problem)
            return wrong

        with ThreadPoolExecutor(8) as pool:
            wrong = [problem for found in pool.map(thread, range(8)) for problem in found]
    finally:
        for server in servers:
            server.stop()
    assert wrong == []
