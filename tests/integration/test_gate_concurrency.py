"""Many concurrent admitters (processes x threads) against one real redis-server: the caps
and the token bucket are never exceeded, and accounting ends balanced."""

from __future__ import annotations

import multiprocessing
import random
import threading
import time

import pytest
from borrowd.adapters.gate import Gate
from borrowd.adapters.redis_conn import connect
from borrowd.adapters.store import BudgetStore, PoolKeys
from borrowd.models.budget import Budget, Mode

pytestmark = pytest.mark.integration

POOL = "p1"
PROCESSES = 4
THREADS = 6
RUN_S = 2.0
RATE = 100_000.0
BURST = 5000
SEQS, KV = 8, 6000
CUT_SEQS, CUT_KV = 3, 2000


def _budget(max_batch_seqs: int, max_batch_kv_tokens: int) -> Budget:
    return Budget(pool=POOL, mode=Mode.OPEN, reason="law", batch_tokens_per_s=RATE,
                  batch_burst_tokens=BURST, max_batch_seqs=max_batch_seqs,
                  max_batch_kv_tokens=max_batch_kv_tokens, max_batch_output_tokens=300)


def _worker(url: str, seed: int, held, held_max, lock, results) -> None:
    """One process: THREADS admitters looping admit -> hold -> release until RUN_S is over."""
    totals = {"admitted": 0, "cost": 0, "revoked": 0, "denied": 0}
    totals_lock = threading.Lock()

    def loop(thread_seed: int) -> None:
        rng = random.Random(thread_seed)
        gate = Gate(connect(url), POOL)
        deadline = time.monotonic() + RUN_S
        n = 0
        while time.monotonic() < deadline:
            n += 1
            request_id = f"{thread_seed}-{n}"
            prompt, max_out = rng.randint(50, 600), rng.randint(50, 500)
            admission = gate.admit(request_id, prompt, max_out)
            if not admission.admitted:
                with totals_lock:
                    totals["denied"] += 1
                continue
            with lock:
                held.value += 1
                held_max.value = max(held_max.value, held.value)
            time.sleep(rng.random() * 0.005)
            with lock:
                held.value -= 1
            released = gate.release(request_id, None)
            with totals_lock:
                totals["admitted"] += 1
                totals["cost"] += prompt + admission.max_output_tokens
                totals["revoked"] += released < 0

    threads = [threading.Thread(target=loop, args=(seed * 100 + i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.put(totals)


def _server_time_s(client) -> float:
    seconds, micros = client.time()
    return seconds + micros / 1e6


def test_caps_and_bucket_hold_under_concurrent_admitters(redis_proc) -> None:
    """Sampled in Redis and counted by the clients, in-flight work never exceeds the caps
    (before and after a cut), admitted tokens never exceed burst + rate x time, and every
    reservation is returned at the end."""
    url = redis_proc.extra["url"]
    client = connect(url)
    store = BudgetStore(client, POOL)
    store.publish(_budget(SEQS, KV), epoch=1, ttl_ms=60_000, now_s=time.time())
    ctx = multiprocessing.get_context("fork")
    held, held_max, lock = ctx.Value("i", 0, lock=False), ctx.Value("i", 0, lock=False), ctx.Lock()
    results = ctx.Queue()
    start_s = _server_time_s(client)
    procs = [ctx.Process(target=_worker, args=(url, p + 1, held, held_max, lock, results))
             for p in range(PROCESSES)]
    for p in procs:
        p.start()

    gate = Gate(client, POOL)
    samples, violations, cut_done = 0, [], False
    began = time.monotonic()
    while any(p.is_alive() for p in procs):
        if not cut_done and time.monotonic() - began > RUN_S / 2:
            store.publish(_budget(CUT_SEQS, CUT_KV), epoch=1, ttl_ms=60_000, now_s=time.time())
            cut_done = True
        # Caps first, then the snapshot: caps only fall during the run, so this order is safe.
        seqs_cap, kv_cap = (int(v) for v in client.hmget(
            PoolKeys(POOL).budget, "max_batch_seqs", "max_batch_kv_tokens"))
        snapshot = gate.inflight()
        samples += 1
        if snapshot.seqs > seqs_cap or snapshot.kv_tokens > kv_cap:
            violations.append((snapshot, seqs_cap, kv_cap))
        time.sleep(0.001)
    for p in procs:
        p.join()
        assert p.exitcode == 0
    end_s = _server_time_s(client)
    totals = [results.get(timeout=5) for _ in procs]

    admitted = sum(t["admitted"] for t in totals)
    admitted_cost = sum(t["cost"] for t in totals)
    assert violations == []
    assert samples > 100
    assert cut_done
    assert held_max.value <= SEQS
    assert admitted > 50
    assert sum(t["denied"] for t in totals) > 0
    assert admitted_cost <= BURST + RATE * (end_s - start_s)
    final = gate.inflight()
    assert (final.seqs, final.kv_tokens) == (0, 0)
