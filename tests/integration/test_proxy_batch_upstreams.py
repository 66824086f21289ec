"""Batch on a subset of the upstreams, through real processes: three `borrowd emulate`
engines, the `borrowd proxy` process with `batch_upstreams` naming one of them, a real
redis-server holding an open budget, and requests from the real openai SDK. Batch reaches
only the eligible engine; interactive reaches all three (each engine's own vLLM metrics say
what it served), and the proxy labels interactive latency by whether the serving upstream
may take batch."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from borrowd.adapters.redis_conn import connect
from borrowd.adapters.store import BudgetStore
from borrowd.models.budget import Budget, Mode

from tests.support.daemon_harness import borrowd_command, to_toml
from tests.support.servers import ServerProcess, free_port, start_process, start_redis

pytestmark = pytest.mark.integration

POOL = "subset"
INTERACTIVE_KEY = "sk-chat"
BATCH_KEY = "sk-etl"
BATCH_PROMPT_WORDS = 3000  # the emulator counts a prompt's whitespace words as its tokens
INTERACTIVE_PROMPT = "hello there"


@dataclass
class Pool:
    """The running processes: engines (the first one eligible for batch) and the proxy."""

    engines: list[ServerProcess]
    proxy_url: str
    servers: list[ServerProcess]


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[Pool]:
    """Redis, three emulated engines, and the proxy with batch on engine 0 only."""
    cli = borrowd_command()
    servers: list[ServerProcess] = []
    try:
        redis_proc = start_redis()
        servers.append(redis_proc)
        engines = []
        for index in range(3):
            port = free_port()
            engines.append(start_process(f"emulator-{index}", [
                cli, "emulate", "--listen", f"127.0.0.1:{port}", "--engine-index", str(index),
                "--time-scale", "0.05",
            ], port, timeout_s=30))
        servers += engines
        urls = [f"http://127.0.0.1:{e.port}" for e in engines]
        proxy_port = free_port()
        config = tmp_path / "proxy.toml"
        config.write_text(to_toml({
            "proxy": {"pool": POOL, "listen_host": "127.0.0.1", "listen_port": proxy_port,
                      "upstreams": urls, "batch_upstreams": [urls[0]],
                      "redis_url": redis_proc.extra["url"]},
            "admission": {"mode": "queue", "queue_max_wait_s": 20.0},
            "tenants": {"chat": {"keys": [INTERACTIVE_KEY], "class": "interactive"},
                        "etl": {"keys": [BATCH_KEY], "class": "batch"}},
        }))
        servers.append(start_process("proxy", [cli, "proxy", "--config", str(config)],
                                     proxy_port, timeout_s=30))
        client = connect(redis_proc.extra["url"])
        BudgetStore(client, POOL).publish(
            Budget(pool=POOL, mode=Mode.OPEN, reason="test", batch_tokens_per_s=1e7,
                   batch_burst_tokens=10_000_000, max_batch_seqs=64,
                   max_batch_kv_tokens=100_000_000, max_batch_output_tokens=64),
            epoch=1, ttl_ms=600_000, now_s=time.time())
        client.close()
        yield Pool(engines, f"http://127.0.0.1:{proxy_port}", servers)
    finally:
        for server in reversed(servers):
            server.kill()


def proxy_first_tokens(proxy_url: str) -> dict[str, float]:
    """Interactive first tokens the proxy measured, by the `batch_eligible` label."""
    with urllib.request.urlopen(f"{proxy_url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = re.findall(r'^borrowd_proxy_ttft_seconds_count\{batch_eligible="(\w+)",'
                       r'class="interactive",pool="subset"\} (\S+)$', text, re.M)
    return {flag: float(value) for flag, value in found}


def served(engine: ServerProcess) -> tuple[float, float]:
    """(requests, prompt tokens) the engine served, from its own vLLM metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{engine.port}/metrics", timeout=10) as resp:
        text = resp.read().decode()

    def total(name: str) -> float:
        return sum(float(m) for m in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    return total("vllm:request_prompt_tokens_count"), total("vllm:request_prompt_tokens_sum")


def test_batch_reaches_only_the_eligible_upstream(pool: Pool) -> None:
    """30 batch and 30 interactive requests at once: every batch prompt lands on engine 0;
    engines 1 and 2 serve interactive requests and nothing else."""
    def ask(key: str, prompt: str) -> str:
        client = openai.OpenAI(base_url=pool.proxy_url + "/v1", api_key=key, max_retries=0,
                               timeout=60.0)
        messages = [{"role": "user", "content": prompt}]
        if key == BATCH_KEY:
            answer = client.chat.completions.create(
                model="emulated-llama-3-8b", max_tokens=8, messages=messages)
            return answer.choices[0].finish_reason or ""
        # Interactive streams, so the proxy measures its first token and gaps.
        stream = client.chat.completions.create(
            model="emulated-llama-3-8b", max_tokens=8, messages=messages,
            stream=True)
        endings = [c.choices[0].finish_reason for c in stream if c.choices]
        return next((e for e in endings if e), "")

    batch_prompt = " ".join(["word"] * BATCH_PROMPT_WORDS)
    jobs = [(BATCH_KEY, batch_prompt)] * 30 + [(INTERACTIVE_KEY, INTERACTIVE_PROMPT)] * 30
    with ThreadPoolExecutor(max_workers=12) as workers:
        endings = list(workers.map(lambda job: ask(*job), jobs))
    assert endings == ["length"] * 60
    counts = [served(engine) for engine in pool.engines]
    assert sum(n for n, _ in counts) == 60
    assert counts[0][1] >= 30 * BATCH_PROMPT_WORDS
    for requests, tokens in counts[1:]:
        assert requests > 0, "interactive requests use every upstream"
        assert tokens < requests * 50, "no batch prompt on a non-eligible upstream"
    first_tokens = proxy_first_tokens(pool.proxy_url)
    assert first_tokens["false"] == sum(n for n, _ in counts[1:])
    assert first_tokens["true"] == 30 - first_tokens["false"]
