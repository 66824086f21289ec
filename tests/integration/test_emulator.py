"""The emulator over real HTTP: step-timed streaming, priority, disconnect aborts, metrics.

The emulator runs as an in-process aiohttp app on a free loopback port; the `borrowd
emulate` command is started once as a real process.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import sys
import time
import urllib.request
from collections.abc import AsyncIterator

import aiohttp
import pytest
from borrowd.adapters.emulator.app import EmulatorConfig, EmulatorServer, serve
from borrowd.adapters.proxy.buckets import ITL_BUCKETS_S, REQUEST_LATENCY_BUCKETS_S, TTFT_BUCKETS_S
from borrowd.models.sim.profiles import get_profile

from tests.support.servers import free_port, start_process

pytestmark = pytest.mark.integration

MODEL = "emulated-llama-3-8b"


class Emulator:
    """A running in-process emulator and a client session to it."""

    def __init__(self, server: EmulatorServer, url: str, session: aiohttp.ClientSession) -> None:
        self.server = server
        self.url = url
        self.session = session

    async def post(self, body: dict, path: str = "/v1/completions",
                   headers: dict[str, str] | None = None) -> aiohttp.ClientResponse:
        """POST a JSON body."""
        return await self.session.post(self.url + path, json=body, headers=headers or {})

    async def metrics(self) -> str:
        """The /metrics text."""
        async with self.session.get(self.url + "/metrics") as resp:
            return await resp.text()


@contextlib.asynccontextmanager
async def _running(config: EmulatorConfig) -> AsyncIterator[Emulator]:
    server = EmulatorServer(config)
    port = free_port()
    runner = await serve(server, "127.0.0.1", port)
    session = aiohttp.ClientSession()
    try:
        yield Emulator(server, f"http://127.0.0.1:{port}", session)
    finally:
        await session.close()
        await runner.cleanup()


@pytest.fixture
async def emulator() -> AsyncIterator[Emulator]:
    """An emulator in real time (H100 profile) with a small KV cache."""
    async with _running(EmulatorConfig(kv_capacity_tokens=32_768, max_model_len=16_384)) as emu:
        yield emu


def _completion(max_tokens: int, stream: bool = True, **extra) -> dict:
    return {"model": MODEL, "prompt": "hello world", "max_tokens": max_tokens,
            "stream": stream, **extra}


async def _token_times(resp: aiohttp.ClientResponse) -> tuple[list[float], list[dict]]:
    times: list[float] = []
    chunks: list[dict] = []
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        chunks.append(chunk)
        if any(c.get("text") for c in chunk["choices"]):
            times.append(time.monotonic())
    return times, chunks


async def _until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


async def test_tokens_stream_at_the_simulated_step_times(emulator: Emulator) -> None:
    """One lone decode's tokens arrive one step apart, as the profile says."""
    async with await emulator.post(_completion(40)) as resp:
        times, chunks = await _token_times(resp)
    step_s = get_profile("h100-llama3-8b").step_s(1, 0, 0)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(times) == 40
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert step_s * 0.9 < sorted(gaps)[len(gaps) // 2] < step_s * 1.5


async def test_time_scale_speeds_the_clock(emulator: Emulator) -> None:
    """time_scale 0.2 runs the same request about five times faster."""
    async with _running(EmulatorConfig(kv_capacity_tokens=32_768, max_model_len=16_384,
                                       time_scale=0.2)) as fast:
        started = time.monotonic()
        async with await fast.post(_completion(100, stream=False)) as resp:
            assert (await resp.json())["usage"]["completion_tokens"] == 100
        fast_s = time.monotonic() - started
    started = time.monotonic()
    async with await emulator.post(_completion(100, stream=False)) as resp:
        await resp.read()
    assert fast_s < (time.monotonic() - started) * 0.5


async def test_priority_orders_admission() -> None:
    """With one sequence slot, the waiting request with the lower priority value runs first."""
    async with _running(EmulatorConfig(kv_capacity_tokens=32_768, max_model_len=16_384,
                                       max_num_seqs=1)) as emu:
        blocker = asyncio.create_task(emu.post(_completion(30, stream=False)))
        await _until(lambda: emu.server.runtime.engine.num_running() == 1, 2.0, "the blocker")
        batch = asyncio.create_task(emu.post(_completion(5, stream=False, priority=10),
                                             headers={"X-Request-Id": "batch-1"}))
        await _until(lambda: "batch-1" in emu.server.runtime.tracked, 2.0, "batch queued")
        chat = asyncio.create_task(emu.post(_completion(5, stream=False, priority=0),
                                            headers={"X-Request-Id": "chat-1"}))
        finished: list[str] = []
        chat.add_done_callback(lambda _t: finished.append("chat"))
        batch.add_done_callback(lambda _t: finished.append("batch"))
        for task in (blocker, chat, batch):
            (await task).close()
        assert finished == ["chat", "batch"]
        seen = emu.server.runtime.priorities_seen
        assert (seen["chat-1"], seen["batch-1"]) == (0, 10)


async def test_disconnect_aborts_and_frees_kv(emulator: Emulator) -> None:
    """A client that hangs up mid-stream frees its KV blocks and counts as an abort."""
    resp = await emulator.post(_completion(5000), headers={"X-Request-Id": "gone"})
    async for raw in resp.content:
        if raw.startswith(b"data: {"):
            break
    engine = emulator.server.runtime.engine
    assert engine.kv_usage_frac() > 0
    resp.close()
    await _until(lambda: "gone" not in emulator.server.runtime.tracked, 2.0, "the abort")
    assert engine.kv_usage_frac() == 0.0
    assert engine.num_running() == 0
    assert 'vllm:request_success_total{engine="0",finished_reason="abort",' \
           f'model_name="{MODEL}"}} 1.0' in await emulator.metrics()


async def test_usage_options_follow_vllm(emulator: Emulator) -> None:
    """include_usage adds a final usage chunk; continuous_usage_stats puts usage in each."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    async with await emulator.post(_completion(3, stream_options=opts,
                                               borrowd_prompt_tokens=77)) as resp:
        _times, chunks = await _token_times(resp)
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3, 3]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["prompt_tokens"] == 77
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "stream": True}
    async with await emulator.post(chat, path="/v1/chat/completions") as resp:
        lines = [raw async for raw in resp.content if raw.startswith(b"data: {")]
    first = json.loads(lines[0][6:])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(b'"usage"' not in line for line in lines)


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        ({"model": "other", "prompt": "x"}, 404, "model"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "priority": "high"}, 400, "priority"),
        ({"model": MODEL, "prompt": "x", "n": 2}, 400, "n"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 20_000}, 400, None),
    ],
    ids=["unknown-model", "zero-max-tokens", "bad-priority", "n-above-1", "too-long"],
)
async def test_bad_requests_are_refused_like_vllm(emulator: Emulator, body: dict, status: int,
                                                  field: str | None) -> None:
    """Malformed or impossible requests are refused with vLLM's status codes."""
    async with await emulator.post(body) as resp:
        assert resp.status == status
        error = (await resp.json())["error"]
    assert error["param"] == field
    if body.get("max_tokens") == 20_000:
        assert "maximum context length" in error["message"]


async def test_metrics_use_vllm_names_labels_and_buckets(emulator: Emulator) -> None:
    """/metrics has vLLM's series with model_name and engine labels and vLLM's buckets."""
    async with await emulator.post(_completion(4, stream=False, borrowd_prompt_tokens=10)) as r:
        await r.read()
    text = await emulator.metrics()
    labels = f'engine="0",model_name="{MODEL}"'
    for line in (
        f"vllm:num_requests_running{{{labels}}} 0.0",
        f"vllm:num_requests_waiting{{{labels}}} 0.0",
        f"vllm:kv_cache_usage_perc{{{labels}}} 0.0",
        f"vllm:num_preemptions_total{{{labels}}} 0.0",
        f"vllm:prompt_tokens_total{{{labels}}} 10.0",
        f"vllm:generation_tokens_total{{{labels}}} 4.0",
        f'vllm:request_success_total{{engine="0",finished_reason="length",'
        f'model_name="{MODEL}"}} 1.0',
        f"vllm:time_to_first_token_seconds_count{{{labels}}} 1.0",
        f"vllm:inter_token_latency_seconds_count{{{labels}}} 3.0",
    ):
        assert line in text
    for name, buckets in (("vllm:time_to_first_token_seconds", TTFT_BUCKETS_S),
                          ("vllm:inter_token_latency_seconds", ITL_BUCKETS_S),
                          ("vllm:e2e_request_latency_seconds", REQUEST_LATENCY_BUCKETS_S),
                          ("vllm:request_queue_time_seconds", REQUEST_LATENCY_BUCKETS_S),
                          ("vllm:request_prefill_time_seconds", REQUEST_LATENCY_BUCKETS_S),
                          ("vllm:request_decode_time_seconds", REQUEST_LATENCY_BUCKETS_S)):
        found = [line.split('le="')[1].split('"')[0] for line in text.splitlines()
                 if line.startswith(name + "_bucket")]
        assert found == [str(b) for b in buckets] + ["+Inf"], name


async def test_preemptions_are_counted_under_kv_pressure() -> None:
    """When KV runs out the engine preempts and vllm:num_preemptions_total rises."""
    async with _running(EmulatorConfig(kv_capacity_tokens=1024, max_model_len=1024,
                                       time_scale=0.05)) as emu:
        bodies = [_completion(400, stream=False, borrowd_prompt_tokens=200, priority=p)
                  for p in (0, 1, 2, 3)]
        responses = await asyncio.gather(*(emu.post(b) for b in bodies))
        for resp in responses:
            assert resp.status == 200
            assert (await resp.json())["usage"]["completion_tokens"] == 400
        assert emu.server.runtime.engine.num_preemptions > 0
        value = float(next(line for line in (await emu.metrics()).splitlines()
                           if line.startswith("vllm:num_preemptions_total")).split()[-1])
        assert value == emu.server.runtime.engine.num_preemptions


def test_borrowd_emulate_command_serves() -> None:
    """`borrowd emulate` starts as a process, serves a completion and stops on SIGTERM."""
    port = free_port()
    runner = ("import argparse, sys; from borrowd.controller.cli import serve; "
              "p = argparse.ArgumentParser(); serve.register(p.add_subparsers()); "
              "a = p.parse_args(); sys.exit(a.func(a))")
    server = start_process("emulate", [sys.executable, "-c", runner, "emulate", "--listen",
                                       f"127.0.0.1:{port}", "--time-scale", "0.1"], port)
    try:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps(_completion(3, stream=False)).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["choices"][0]["text"] == " the quick brown"
    finally:
        server.stop()
    assert server.proc.returncode == 0
