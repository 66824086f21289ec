"""Admission gate latency and throughput against a real redis-server on loopback.

Starts its own redis-server on a free port (stopped by PID), publishes a budget that admits
everything, then at each client count runs admit + release pairs (each call is one
decision: one EVALSHA of one atomic Lua script) and plain PINGs, and prints p50/p99 latency
and throughput. Clients are asyncio tasks spread over worker processes (fork), each task
with its own connection. A last row per client count drives admissions from redis-benchmark
(a C client) to show what one Redis decides when the client is not the bottleneck.

    python3 benchmarks/bench_gate.py [--clients 1,8,64] [--seconds 3] [--processes N]
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from borrowd.adapters.gate import AsyncGate
from borrowd.adapters.lua import script_text
from borrowd.adapters.redis_conn import connect, connect_async
from borrowd.adapters.store import REAP_LIMIT, BudgetStore, PoolKeys
from borrowd.models.budget import SCHEMA_VERSION, Budget, Mode

from tests.support.servers import start_redis

POOL = "bench"


def _open_budget() -> Budget:
    return Budget(pool=POOL, mode=Mode.OPEN, reason="bench", batch_tokens_per_s=1e12,
                  batch_burst_tokens=10**15, max_batch_seqs=10**9, max_batch_kv_tokens=10**15,
                  max_batch_output_tokens=1024)


async def _client_loop(url: str, op: str, tag: str, deadline: float,
                       batch: int) -> list[float]:
    client = connect_async(url)
    gate = AsyncGate(client, POOL)
    latencies: list[float] = []
    n = 0
    try:
        await client.ping()
        while time.perf_counter() < deadline:
            n += 1
            if op == "pipelined":
                ids = [f"{tag}-{n}-{i}" for i in range(batch)]
                t0 = time.perf_counter()
                admissions = await gate.admit_many([(i, 512, 256) for i in ids])
                t1 = time.perf_counter()
                if not all(a.admitted for a in admissions):
                    raise RuntimeError("bench budget denied a request")
                await gate.release_many([(i, 128) for i in ids])
                t2 = time.perf_counter()
                # Each decision in a batch waits for the whole batch's round trip.
                latencies += [t1 - t0] * batch + [t2 - t1] * batch
                continue
            if op == "ping":
                t0 = time.perf_counter()
                await client.ping()
                latencies.append(time.perf_counter() - t0)
                continue
            request_id = f"{tag}-{n}"
            t0 = time.perf_counter()
            admission = await gate.admit(request_id, 512, 256)
            t1 = time.perf_counter()
            if not admission.admitted:
                raise RuntimeError(f"bench budget denied a request: {admission.reason}")
            await gate.release(request_id, 128)
            t2 = time.perf_counter()
            latencies += [t1 - t0, t2 - t1]
    finally:
        await client.aclose()
    return latencies


def _process(url: str, op: str, tasks: int, proc: int, start_at: float, seconds: float,
             batch: int, out: multiprocessing.Queue) -> None:
    async def main() -> list[float]:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        deadline = time.perf_counter() + seconds
        results = await asyncio.gather(*(
            _client_loop(url, op, f"p{proc}t{t}", deadline, batch) for t in range(tasks)))
        return [x for r in results for x in r]

    out.put(np.asarray(asyncio.run(main()), dtype=np.float64))


def run_level(url: str, op: str, clients: int, processes: int, seconds: float,
              batch: int) -> dict:
    """p50/p99 latency (ms) and throughput (calls/s) of `op` at `clients` concurrent clients,
    with the Redis server's own time per call of the row's command (INFO commandstats)."""
    server = connect(url)
    server.config_resetstat()
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    n_proc = max(1, min(processes, clients))
    per_proc = [clients // n_proc + (1 if i < clients % n_proc else 0) for i in range(n_proc)]
    start_at = time.time() + 0.5
    procs = [ctx.Process(target=_process, args=(url, op, k, i, start_at, seconds, batch, out))
             for i, k in enumerate(per_proc)]
    for p in procs:
        p.start()
    arrays = [out.get(timeout=seconds + 60) for _ in procs]
    for p in procs:
        p.join()
    lat = np.concatenate(arrays)
    stats = server.info("commandstats")
    server.close()
    command = stats.get("cmdstat_ping" if op == "ping" else "cmdstat_evalsha", {})
    name = f"admit+release x{batch} pipelined" if op == "pipelined" else op
    return {"op": name, "clients": clients, "processes": n_proc, "calls": int(lat.size),
            "server_us": float(command.get("usec_per_call", float("nan"))),
            "p50_ms": float(np.percentile(lat, 50) * 1e3),
            "p99_ms": float(np.percentile(lat, 99) * 1e3),
            "calls_per_s": lat.size / seconds}


def run_c_level(url: str, port: int, clients: int, requests: int) -> dict | None:
    """Admit-only decisions driven by redis-benchmark (a C client, no Python in the way):
    EVALSHA of the admit script with random request ids; None when it is not installed."""
    binary = shutil.which("redis-benchmark")
    if binary is None:
        return None
    server = connect(url)
    keys = PoolKeys(POOL)
    sha = server.script_load(script_text("admit"))
    gate_keys = [keys.budget, keys.epoch, keys.stop, keys.leases, keys.order, keys.reqs,
                 keys.state]
    server.config_resetstat()
    argv = [binary, "-h", "127.0.0.1", "-p", str(port), "-n", str(requests), "-c", str(clients),
            "-r", str(10**9), "--csv", "EVALSHA", sha, str(len(gate_keys)), *gate_keys,
            "req-__rand_int__", "512", "256", "", "30000", str(SCHEMA_VERSION), "1000",
            str(REAP_LIMIT)]
    csv_rows = list(csv.DictReader(io.StringIO(
        subprocess.run(argv, check=True, capture_output=True, text=True).stdout)))
    stats = server.info("commandstats").get("cmdstat_evalsha", {})
    admitted = server.zcard(keys.leases)
    # These admissions are never released: drop them so later rows start clean.
    server.delete(keys.leases, keys.order, keys.reqs, keys.state)
    server.close()
    row = csv_rows[-1]
    return {"op": f"admit only, C client ({admitted} ok)", "clients": clients, "processes": 1,
            "calls": requests, "server_us": float(stats.get("usec_per_call", float("nan"))),
            "p50_ms": float(row["p50_latency_ms"]), "p99_ms": float(row["p99_latency_ms"]),
            "calls_per_s": float(row["rps"])}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="1,8,64", help="comma-separated client counts")
    parser.add_argument("--seconds", type=float, default=3.0, help="duration of each level")
    parser.add_argument("--batch", type=int, default=16,
                        help="decisions per pipeline in the pipelined rows (0 = no such rows)")
    parser.add_argument("--c-requests", type=int, default=20_000,
                        help="admissions per redis-benchmark row")
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1,
                        help="worker processes the clients are spread over (default: CPUs)")
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.clients.split(",")]

    server = start_redis()
    try:
        url = server.extra["url"]
        client = connect(url)
        BudgetStore(client, POOL).publish(_open_budget(), epoch=1, ttl_ms=3_600_000,
                                          now_s=time.time())
        version = client.info("server")["redis_version"]
        rows = []
        for clients in levels:
            ops = ("ping", "admit+release") + (("pipelined",) if args.batch > 0 else ())
            for op in ops:
                rows.append(run_level(url, op, clients, args.processes, args.seconds, args.batch))
            c_row = run_c_level(url, server.port, clients, args.c_requests)
            if c_row is not None:
                rows.append(c_row)
        inflight = client.zcard(PoolKeys(POOL).leases)
        client.close()
    finally:
        server.stop()

    print(f"redis-server {version} on loopback (pid stopped), {os.cpu_count()} CPUs, "
          f"{args.seconds:g} s per row, hiredis parser, EVALSHA; latency per call")
    print(f"{'clients':>7} {'procs':>5} {'operation':<32} {'calls':>8} {'p50 ms':>8} "
          f"{'p99 ms':>8} {'calls/s':>10} {'server us':>9}")
    for r in rows:
        print(f"{r['clients']:>7} {r['processes']:>5} {r['op']:<32} {r['calls']:>8} "
              f"{r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} {r['calls_per_s']:>10.0f} "
              f"{r['server_us']:>9.2f}")
    print("calls = decisions (each admit and each release is one atomic script) or PINGs; "
          "server us = Redis's own time per call (INFO commandstats), so one Redis core "
          "decides at most 1e6 / server_us per second.")
    print(f"{inflight} requests left in flight at the end (expected 0).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
