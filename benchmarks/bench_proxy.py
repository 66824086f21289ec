"""Added latency and CPU cost of the borrowd proxy against direct calls to the emulator.

Starts a redis-server, `borrowd emulate` and `borrowd proxy` as processes on free loopback
ports, then, for each concurrency level, runs the same streaming chat load twice: straight
to the emulator, then through the proxy (interactive key). Each of C concurrent streams
sends requests back to back. The emulator stamps each chunk with when the request arrived
and when the chunk was written (its `borrowd_timing` extension), so the latency outside the
engine is measured per request and per chunk, free of the engine's step-time noise; the
proxy's added latency is the proxied minus the direct percentile of that overhead. Also
printed: end-to-end TTFT p50/p99 both ways and the proxy process's CPU per streamed chunk
and per 1k tokens (psutil, user + system seconds).

    python3 benchmarks/bench_proxy.py [--streams 1,50,200] [--duration-s 15]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.servers import (
    ServerProcess,
    free_port,
    start_process,
    start_redis,
)

MODEL = "emulated-llama-3-8b"
KEY = "sk-bench"
PROMPT_TOKENS = 16  # short prompts: TTFT is the proxy's and the step's, not a long prefill
RUN_SERVE = (
    "import argparse, sys; from controller.cli import serve; "
    "p = argparse.ArgumentParser(); serve.register(p.add_subparsers()); "
    "a = p.parse_args(); sys.exit(a.func(a))"
)


@dataclass
class LoadResult:
    """Client-side measurements of one load run (seconds)."""

    ttft_s: list[float] = field(default_factory=list)
    ttft_overhead_s: list[float] = field(default_factory=list)
    chunk_delivery_s: list[float] = field(default_factory=list)
    chunks: int = 0
    requests: int = 0
    errors: int = 0


def _number_after(line: bytes, start: int) -> float:
    """The JSON number starting at `start` (cheaper than parsing the chunk)."""
    end = start
    while line[end] not in b",}":
        end += 1
    return float(line[start:end])


async def _one_stream(session: aiohttp.ClientSession, url: str, headers: dict[str, str],
                      body: bytes, result: LoadResult) -> None:
    clock = time.monotonic
    sent_s = clock()
    first = True
    async with session.post(url, data=body, headers=headers) as resp:
        if resp.status != 200:
            result.errors += 1
            await resp.read()
            return
        async for line in resp.content:
            emitted_at = line.find(b'"borrowd_emitted_s":')
            if emitted_at < 0:
                continue
            received_s = clock()
            delivery_s = received_s - _number_after(line, emitted_at + 20)
            result.chunk_delivery_s.append(delivery_s)
            if first:
                first = False
                arrived_s = _number_after(line, line.find(b'"borrowd_arrived_s":') + 20)
                result.ttft_s.append(received_s - sent_s)
                result.ttft_overhead_s.append(arrived_s - sent_s + delivery_s)
            result.chunks += 1
    result.requests += 1


async def run_load(base_url: str, key: str | None, streams: int, duration_s: float,
                   max_tokens: int) -> LoadResult:
    """`streams` concurrent clients, each sending streaming chat requests back to back.

    Each request asks for a length drawn uniformly from [max_tokens / 2, 3 * max_tokens / 2]
    (seeded per client, so the direct and the proxied run replay the same sequence): equal
    lengths would finish every stream in the same engine step and make all of them arrive
    again at once, a lockstep that real traffic does not have.
    """
    url = base_url + "/v1/chat/completions"
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    low, high = max(1, max_tokens // 2), max(1, max_tokens * 3 // 2)
    bodies = [json.dumps({"model": MODEL, "stream": True, "max_tokens": n,
                          "borrowd_prompt_tokens": PROMPT_TOKENS, "borrowd_timing": True,
                          "messages": [{"role": "user", "content": "benchmark " * 50}]}).encode()
              for n in range(low, high + 1)]
    result = LoadResult()
    deadline = time.monotonic() + duration_s
    connector = aiohttp.TCPConnector(limit=0)

    async def client(index: int) -> None:
        rng = random.Random(index)
        await asyncio.sleep(index * 0.003)
        while time.monotonic() < deadline:
            await _one_stream(session, url, headers, rng.choice(bodies), result)

    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(i) for i in range(streams)))
    return result


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def _start_servers(workdir: Path, time_scale: float) -> tuple[list[ServerProcess], int, int]:
    redis = start_redis()
    emulator_port = free_port()
    emulator = start_process("emulator", [
        sys.executable, "-c", RUN_SERVE, "emulate", "--listen", f"127.0.0.1:{emulator_port}",
        "--time-scale", str(time_scale), "--max-num-seqs", "512",
    ], emulator_port, workdir=workdir)
    proxy_port = free_port()
    config = workdir / "proxy.toml"
    config.write_text(
        f'[proxy]\nlisten_port = {proxy_port}\npool = "bench"\n'
        f'upstreams = ["http://127.0.0.1:{emulator_port}"]\n'
        f'redis_url = "{redis.extra["url"]}"\n'
        f'[tenants.bench]\nkeys = ["{KEY}"]\nclass = "interactive"\n'
    )
    proxy = start_process("proxy", [sys.executable, "-c", RUN_SERVE, "proxy", "--config",
                                    str(config)], proxy_port, workdir=workdir)
    return [proxy, emulator, redis], emulator_port, proxy_port


def main() -> int:
    """Run the benchmark and print its table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="1,50,200", help="comma-separated concurrencies")
    parser.add_argument("--duration-s", type=float, default=12.0, help="seconds per load run")
    parser.add_argument("--max-tokens", type=int, default=16,
                        help="mean output tokens per request (uniform over [T/2, 3T/2])")
    parser.add_argument("--time-scale", type=float, default=8.0,
                        help="emulator wall seconds per simulated second (slower steps keep the "
                             "chunk rate within what one shared CPU core serves)")
    args = parser.parse_args()
    levels = [int(s) for s in args.streams.split(",")]

    workdir = Path(tempfile.mkdtemp(prefix="borrowd-bench-proxy-"))
    servers, emulator_port, proxy_port = _start_servers(workdir, args.time_scale)
    proxy_pid = servers[0].pid
    rows = []
    try:
        for streams in levels:
            direct = uvloop.run(run_load(f"http://127.0.0.1:{emulator_port}", None, streams,
                                          args.duration_s, args.max_tokens))
            cpu_before = _cpu_s(proxy_pid)
            proxied = uvloop.run(run_load(f"http://127.0.0.1:{proxy_port}", KEY, streams,
                                           args.duration_s, args.max_tokens))
            cpu_s = _cpu_s(proxy_pid) - cpu_before
            rows.append((streams, direct, proxied, cpu_s))
    finally:
        for server in servers:
            server.stop()

    print(f"borrowd proxy vs direct to the emulator: {args.duration_s:g} s per run, "
          f"{args.max_tokens // 2}-{args.max_tokens * 3 // 2} tokens per request, "
          f"emulator time scale {args.time_scale:g}, "
          f"{psutil.cpu_count()} CPUs, load average {psutil.getloadavg()[0]:.1f}")
    print(f"{'streams':>7} {'reqs d/p':>10} {'TTFT p50 ms d/p':>16} {'TTFT p99 ms d/p':>16} "
          f"{'+TTFT p50 ms':>12} {'+TTFT p99 ms':>12} {'+chunk p50 ms':>13} "
          f"{'+chunk p99 ms':>13} {'CPU us/chunk':>12} {'CPU s/1k tok':>12} {'errors':>6}")
    for streams, d, p, cpu_s in rows:
        def added(q: float, a: list[float], b: list[float]) -> str:
            return f"{(_pct(b, q) - _pct(a, q)) * 1e3:+.3f}"
        per_chunk_us = cpu_s / p.chunks * 1e6 if p.chunks else float("nan")
        per_1k_s = cpu_s / p.chunks * 1000 if p.chunks else float("nan")
        ttft50 = f"{_pct(d.ttft_s, 0.5) * 1e3:.1f}/{_pct(p.ttft_s, 0.5) * 1e3:.1f}"
        ttft99 = f"{_pct(d.ttft_s, 0.99) * 1e3:.1f}/{_pct(p.ttft_s, 0.99) * 1e3:.1f}"
        print(f"{streams:>7} {f'{d.requests}/{p.requests}':>10} {ttft50:>16} {ttft99:>16} "
              f"{added(0.5, d.ttft_overhead_s, p.ttft_overhead_s):>12} "
              f"{added(0.99, d.ttft_overhead_s, p.ttft_overhead_s):>12} "
              f"{added(0.5, d.chunk_delivery_s, p.chunk_delivery_s):>13} "
              f"{added(0.99, d.chunk_delivery_s, p.chunk_delivery_s):>13} "
              f"{per_chunk_us:>12.1f} {per_1k_s:>12.3f} {d.errors + p.errors:>6}")
    print("d = direct, p = through the proxy. +TTFT: added to the TTFT overhead outside the "
          "engine (client send -> emulator arrival, plus first-chunk delivery), proxied minus "
          "direct percentile; +chunk: the same for every chunk's delivery (emulator write -> "
          "client read). Timestamps from the emulator's `borrowd_timing` extension "
          "(CLOCK_MONOTONIC, one host). One chunk = one token.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
