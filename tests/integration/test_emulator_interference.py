"""The emulator's interference series and KV capacity over real HTTP.

Interactive streams alone count every gap as `batch_step="false"`; next to a long batch
request their gaps land in steps carrying batch tokens. `vllm:cache_config_info` gives the
engine's KV capacity as vLLM's labels do.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest
from borrowd.adapters.emulator.app import EmulatorConfig, EmulatorServer, serve
from borrowd.adapters.interference import ITL_METRIC, WAIT_METRIC
from prometheus_client.parser import text_string_to_metric_families

from tests.support.servers import free_port

pytestmark = pytest.mark.integration

MODEL = "emulated-llama-3-8b"
KV_TOKENS = 65_536


@contextlib.asynccontextmanager
async def _emulator() -> AsyncIterator[tuple[str, aiohttp.ClientSession]]:
    server = EmulatorServer(EmulatorConfig(kv_capacity_tokens=KV_TOKENS, max_model_len=40_000,
                                           time_scale=0.5))
    port = free_port()
    runner = await serve(server, "127.0.0.1", port)
    session = aiohttp.ClientSession()
    try:
        yield f"http://127.0.0.1:{port}", session
    finally:
        await session.close()
        await runner.cleanup()


async def _complete(session: aiohttp.ClientSession, url: str, prompt_tokens: int,
                    max_tokens: int, priority: int = 0) -> None:
    body = {"model": MODEL, "prompt": "x", "borrowd_prompt_tokens": prompt_tokens,
            "max_tokens": max_tokens, "priority": priority}
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        assert (await resp.json())["usage"]["completion_tokens"] == max_tokens


async def _samples(session: aiohttp.ClientSession, url: str) -> dict[tuple, float]:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, s.labels.get("batch_step"), s.labels.get("le"))] = s.value
    return out


def _gaps(samples: dict[tuple, float], batch_step: str) -> float:
    return samples[(ITL_METRIC + "_count", batch_step, None)]


async def test_interactive_alone_counts_no_gap_as_batch() -> None:
    """Two interactive requests alone: all their gaps are in steps without batch tokens."""
    async with _emulator() as (url, session):
        await asyncio.gather(*(_complete(session, url, 200, 20) for _ in range(2)))
        samples = await _samples(session, url)
    assert _gaps(samples, "false") == 2 * 19
    assert _gaps(samples, "true") == 0
    assert samples[(WAIT_METRIC + "_total", "true", None)] == 0


async def test_gaps_next_to_batch_are_counted_as_batch() -> None:
    """A decode running beside a long batch prompt and its decode ends its gaps in steps
    carrying batch tokens, and an interactive prompt queued behind batch prefill waits in
    them; the gaps there are longer than the clean ones."""
    async with _emulator() as (url, session):
        await _complete(session, url, 200, 10)
        clean = await _samples(session, url)
        batch = asyncio.create_task(_complete(session, url, 30_000, 60, priority=10))
        await asyncio.sleep(0.05)
        await asyncio.gather(_complete(session, url, 200, 20),
                             _complete(session, url, 9_000, 5))
        await batch
        samples = await _samples(session, url)
    assert _gaps(clean, "false") == 9
    assert _gaps(samples, "true") >= 15
    assert samples[(WAIT_METRIC + "_total", "true", None)] > 0
    mean_batch = samples[(ITL_METRIC + "_sum", "true", None)] / _gaps(samples, "true")
    mean_clean = clean[(ITL_METRIC + "_sum", "false", None)] / _gaps(clean, "false")
    assert mean_batch > mean_clean


async def test_cache_config_info_gives_the_kv_capacity() -> None:
    """`vllm:cache_config_info` carries block_size, num_gpu_blocks and the capacity."""
    async with _emulator() as (url, session), session.get(url + "/metrics") as resp:
        text = await resp.text()
    info = [s for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "vllm:cache_config_info"]
    assert len(info) == 1 and info[0].value == 1
    assert info[0].labels == {"block_size": "16", "num_gpu_blocks": str(KV_TOKENS // 16),
                              "kv_cache_size_tokens": str(KV_TOKENS), "engine": "0"}
