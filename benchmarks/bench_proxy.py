"""Added latency and CPU cost of the borrowd proxy against direct calls to the emulator.

Starts a redis-server, `borrowd emulate`, `borrowd proxy` and, as a compiled reference, an
nginx reverse proxy (streaming, `proxy_buffering off`, upstream keep-alive) as processes on
free loopback ports. For each concurrency level C and each proxy, one run sends C streams
straight to the emulator and C streams through the proxy at the same time (client i of each
group replays the same requests), so both groups share the engine's steps and the
machine's noise: on a shared 2-core VM, separate runs differed by more than the proxy's
cost. Each stream sends streaming chat requests back to back. The emulator stamps each
chunk with when the request arrived and when the chunk was written (its `borrowd_timing`
extension), so the latency outside the engine is measured per request and per chunk, free
of the engine's step times; a proxy's added latency is the proxied minus the direct
percentile of that overhead. nginx shows what one more loopback hop costs here when the hop
runs no Python. Also printed: end-to-end TTFT p50/p99 and the proxy's CPU per streamed
chunk and per 1k tokens (psutil, user + system seconds).

    python3 benchmarks/bench_proxy.py [--streams 1,50,200] [--duration-s 12]
        [--relays uvicorn+httpx,granian+httpx,http1+aiohttp,...]

`--relays` adds bare relays built from HTTP libraries (`proxy_relays.py`: server uvicorn,
granian or borrowd's http1; client httpx, aiohttp or borrowd's upstream client), the least
a proxy on each library can add, measured in the same paired way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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
    start_nginx,
    start_process,
    start_redis,
)

MODEL = "emulated-llama-3-8b"
KEY = "sk-bench"
PROMPT_TOKENS = 16  # short prompts: TTFT is the proxy's and the step's, not a long prefill
RUN_SERVE = (
    "import argparse, sys; from borrowd.controller.cli import serve; "
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


async def run_load(targets: list[tuple[str, str | None]], streams: int, duration_s: float,
                   max_tokens: int) -> list[LoadResult]:
    """`streams` concurrent clients per target, all at once, each sending streaming chat
    requests back to back; one result per target.

    Each request asks for a length drawn uniformly from [max_tokens / 2, 3 * max_tokens / 2]
    (client i of every target replays the same seeded sequence): equal lengths would finish
    every stream in the same engine step and make all of them arrive again at once, a
    lockstep that real traffic does not have.
    """
    low, high = max(1, max_tokens // 2), max(1, max_tokens * 3 // 2)
    bodies = [json.dumps({"model": MODEL, "stream": True, "max_tokens": n,
                          "borrowd_prompt_tokens": PROMPT_TOKENS, "borrowd_timing": True,
                          "messages": [{"role": "user", "content": "benchmark " * 50}]}).encode()
              for n in range(low, high + 1)]
    results = [LoadResult() for _ in targets]
    deadline = time.monotonic() + duration_s

    async def client(index: int, url: str, headers: dict[str, str], result: LoadResult) -> None:
        rng = random.Random(index)
        await asyncio.sleep(index * 0.003)
        while time.monotonic() < deadline:
            await _one_stream(session, url, headers, rng.choice(bodies), result)

    clients = []
    for (base_url, key), result in zip(targets, results, strict=True):
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        clients.extend(client(i, base_url + "/v1/chat/completions", headers, result)
                       for i in range(streams))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*clients)
    return results


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its children (nginx's workers)."""
    process = psutil.Process(pid)
    total = 0.0
    for proc in [process, *process.children(recursive=True)]:
        times = proc.cpu_times()
        total += times.user + times.system
    return total


def _start_nginx_relay(emulator_port: int) -> tuple[ServerProcess, int]:
    """nginx as a plain streaming reverse proxy in front of the emulator."""
    port = free_port()
    blocks = f"""
    upstream emulator {{ server 127.0.0.1:{emulator_port}; keepalive 1024; }}
    server {{
        listen 127.0.0.1:{port} backlog=1024;
        access_log off;
        location / {{
            proxy_pass http://emulator;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
"""
    return start_nginx(blocks, port, worker_connections=4096), port


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


RELAYS = Path(__file__).resolve().with_name("proxy_relays.py")


def _start_relay(spec: str, emulator_port: int, workdir: Path) -> tuple[ServerProcess, int]:
    """A bare library relay (`server+client`) in front of the emulator."""
    server, _, client = spec.partition("+")
    port = free_port()
    upstream = f"http://127.0.0.1:{emulator_port}"
    if server == "granian":
        argv = [sys.executable, "-m", "granian", "--interface", "asgi", "--loop", "uvloop",
                "--http", "1", "--workers", "1", "--runtime-mode", "st", "--host",
                "127.0.0.1", "--port", str(port), "--no-ws", "--log-level", "warning",
                "--backlog", "1024", "benchmarks.proxy_relays:app"]
        env = {**os.environ, "RELAY_CLIENT": client, "RELAY_UPSTREAM": upstream,
               "PYTHONPATH": str(RELAYS.parents[1])}
        return start_process(spec, argv, port, workdir=workdir, env=env), port
    argv = [sys.executable, str(RELAYS), "--server", server, "--client", client,
            "--port", str(port), "--upstream", upstream]
    return start_process(spec, argv, port, workdir=workdir), port


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
    parser.add_argument("--relays", default="",
                        help="comma-separated bare library relays, server+client "
                             "(uvicorn|granian|http1 + httpx|aiohttp|borrowd)")
    args = parser.parse_args()
    levels = [int(s) for s in args.streams.split(",")]

    workdir = Path(tempfile.mkdtemp(prefix="borrowd-bench-proxy-"))
    servers, emulator_port, proxy_port = _start_servers(workdir, args.time_scale)
    nginx, nginx_port = _start_nginx_relay(emulator_port)
    servers.append(nginx)
    hops = [("borrowd", servers[0].pid, proxy_port, KEY), ("nginx", nginx.pid, nginx_port, None)]
    for spec in filter(None, args.relays.split(",")):
        relay, relay_port = _start_relay(spec, emulator_port, workdir)
        servers.append(relay)
        hops.append((spec, relay.pid, relay_port, None))
    direct_url = f"http://127.0.0.1:{emulator_port}"
    rows = []
    try:
        for streams in levels:
            for via, pid, port, key in hops:
                cpu_before = _cpu_s(pid)
                direct, proxied = uvloop.run(run_load(
                    [(direct_url, None), (f"http://127.0.0.1:{port}", key)], streams,
                    args.duration_s, args.max_tokens))
                rows.append((streams, via, direct, proxied, _cpu_s(pid) - cpu_before))
    finally:
        for server in servers:
            server.stop()

    print(f"proxies vs direct to the emulator, paired: {args.duration_s:g} s per run, "
          f"{args.max_tokens // 2}-{args.max_tokens * 3 // 2} tokens per request, "
          f"emulator time scale {args.time_scale:g}, "
          f"{psutil.cpu_count()} CPUs, load average {psutil.getloadavg()[0]:.1f}")
    print(f"{'streams':>7} {'via':>15} {'reqs d/p':>10} {'TTFT p50 ms d/p':>16} "
          f"{'TTFT p99 ms d/p':>16} {'+TTFT p50 ms':>12} {'+TTFT p99 ms':>12} "
          f"{'+chunk p50 ms':>13} {'+chunk p99 ms':>13} {'CPU us/chunk':>12} "
          f"{'CPU s/1k tok':>12} {'errors':>6}")
    for streams, via, d, p, cpu_s in rows:
        def added(q: float, a: list[float], b: list[float]) -> str:
            return f"{(_pct(b, q) - _pct(a, q)) * 1e3:+.3f}"
        per_chunk_us = cpu_s / p.chunks * 1e6 if p.chunks else float("nan")
        per_1k_s = cpu_s / p.chunks * 1000 if p.chunks else float("nan")
        ttft50 = f"{_pct(d.ttft_s, 0.5) * 1e3:.1f}/{_pct(p.ttft_s, 0.5) * 1e3:.1f}"
        ttft99 = f"{_pct(d.ttft_s, 0.99) * 1e3:.1f}/{_pct(p.ttft_s, 0.99) * 1e3:.1f}"
        print(f"{streams:>7} {via:>15} {f'{d.requests}/{p.requests}':>10} {ttft50:>16} "
              f"{ttft99:>16} "
              f"{added(0.5, d.ttft_overhead_s, p.ttft_overhead_s):>12} "
              f"{added(0.99, d.ttft_overhead_s, p.ttft_overhead_s):>12} "
              f"{added(0.5, d.chunk_delivery_s, p.chunk_delivery_s):>13} "
              f"{added(0.99, d.chunk_delivery_s, p.chunk_delivery_s):>13} "
              f"{per_chunk_us:>12.1f} {per_1k_s:>12.3f} {d.errors + p.errors:>6}")
    print("Each row is one run: `streams` clients straight to the emulator (d) and `streams` "
          "clients through the proxy named in `via` (p: borrowd, or nginx as a compiled "
          "reference hop) at the same time, on the same engine steps and the same machine "
          "noise. +TTFT: added to the TTFT overhead outside the engine (client send -> "
          "emulator arrival, plus first-chunk delivery), p minus d percentile; +chunk: the "
          "same for every chunk's delivery (emulator write -> client read). Timestamps from "
          "the emulator's `borrowd_timing` extension (CLOCK_MONOTONIC, one host). One chunk = "
          "one token; CPU is the proxy's (nginx: master and worker).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
