"""borrowd on a real 3-node Redis Cluster (`redis+cluster://`): store, leader election, gate,
revocations, watchers (sync and asyncio), the pool registry and the HTTP gate's /healthz.

The pool is chosen so that its hash slot lives on the third node while the URL names the
first node first: only a cluster client that follows MOVED can serve it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio.cluster
import redis.cluster
import redis.exceptions
from borrowd.adapters.gate import AsyncGate, Gate
from borrowd.adapters.pool_registry import PoolRegistry
from borrowd.adapters.redis_conn import connect, connect_async
from borrowd.adapters.store import AsyncBudgetWatcher, BudgetStore, BudgetWatcher, LeaderElection
from borrowd.models.budget import Budget, Mode

from tests.support.daemon_harness import borrowd_command
from tests.support.redis_cluster import RedisCluster, needs_cluster_tools, redis_cluster
from tests.support.servers import free_port, start_process, wait_until

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(needs_cluster_tools() is not None,
                                 reason=str(needs_cluster_tools()))]


def _budget(pool: str, tokens_per_s: float = 10_000.0, mode: Mode = Mode.OPEN) -> Budget:
    return Budget(pool=pool, mode=mode, reason="test", batch_tokens_per_s=tokens_per_s,
                  batch_burst_tokens=50_000, max_batch_seqs=4, max_batch_kv_tokens=100_000,
                  max_batch_output_tokens=512)


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    """A fresh 3-node cluster for this module."""
    with redis_cluster() as started:
        yield started


@pytest.fixture(scope="module")
def pool(cluster: RedisCluster) -> str:
    """A pool whose keys live on the cluster's third node (not the URL's first)."""
    return next(name for name in (f"pool{i}" for i in range(100))
                if cluster.owner_index(f"borrowd:{{{name}}}:budget") == 2)


def test_cluster_url_builds_cluster_clients(cluster: RedisCluster) -> None:
    """`redis+cluster://` gives a RedisCluster (sync) and an asyncio RedisCluster."""
    assert isinstance(connect(cluster.url), redis.cluster.RedisCluster)
    assert isinstance(connect_async(cluster.url), redis.asyncio.cluster.RedisCluster)


def test_store_election_gate_and_watcher_work_on_the_cluster(cluster: RedisCluster,
                                                             pool: str) -> None:
    """Leader election, fenced publish, admission, stop with revocation, the watcher's push
    and the registry all work through the cluster client."""
    client = connect(cluster.url)
    election = LeaderElection(client, pool, "ctl-1", 5000)
    epoch = election.try_acquire()
    assert epoch is not None and election.renew()
    store = BudgetStore(client, pool)
    store.publish(_budget(pool), epoch=epoch, ttl_ms=30_000, now_s=time.time())
    assert store.read(time.time()).batch_tokens_per_s == 10_000.0
    gate = Gate(client, pool)
    assert gate.admit("r1", 1000, 100).admitted
    assert gate.inflight().seqs == 1
    watcher = BudgetWatcher(client, pool, poll_s=30.0).start()
    try:
        wait_until(watcher.ready.is_set, 10.0, "the watcher to subscribe")
        last_id, _ = gate.revocations("$")
        store.stop("cluster test")
        wait_until(lambda: (b := watcher.current(time.time())) and b.mode == Mode.STOPPED,
                   5.0, "the pushed stop")
        _, revoked = gate.revocations(last_id)
        assert [r.request_id for r in revoked] == ["r1"]
        assert store.resume()
    finally:
        watcher.stop()
    PoolRegistry(client).register([pool], "ctl-1", time.time())
    assert pool in PoolRegistry(client).known() and PoolRegistry(client).exists(pool)
    election.release()


def test_async_gate_and_watcher_work_on_the_cluster(cluster: RedisCluster, pool: str) -> None:
    """The proxy's asyncio side: admission and the pushed record through the cluster client."""

    async def scenario() -> None:
        client = connect_async(cluster.url)
        watcher = await AsyncBudgetWatcher(client, pool, poll_s=30.0).start()
        try:
            await asyncio.sleep(0.5)  # subscribed
            BudgetStore(connect(cluster.url), pool).publish(
                _budget(pool, 20_000.0), epoch=99, ttl_ms=30_000, now_s=time.time())
            for _ in range(100):
                budget = watcher.current(time.time())
                if budget is not None and budget.batch_tokens_per_s == 20_000.0:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the pushed record never arrived")
            admission = await AsyncGate(client, pool).admit("a1", 500, 50)
            assert admission.admitted, admission
        finally:
            await watcher.stop()
            await client.aclose()

    asyncio.run(scenario())


def _get_json(url: str, headers: dict[str, str] | None = None,
              method: str = "GET") -> tuple[int, dict]:
    request = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, {}


def test_gate_healthz_reflects_slot_ownership(cluster: RedisCluster, pool: str) -> None:
    """Pointed (plain URL) at a node that does not own the pool's slot, the gate denies batch
    and /healthz says Redis is down for that pool; through the cluster URL both are fine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BORROWD_")}
    admit_headers = {"X-Borrowd-Request-Id": "h1", "X-Borrowd-Prompt-Tokens": "10",
                     "X-Borrowd-Max-Tokens": "10"}
    wrong_node = f"redis://127.0.0.1:{cluster.nodes[0].port}/0"
    for url, health, admit in ((wrong_node, "down", 503), (cluster.url, "up", 200)):
        port = free_port()
        gate = start_process("gate", [borrowd_command(), "gate", "--pool", pool, "--listen",
                                      f"127.0.0.1:{port}", "--redis", url], port, env=env)
        try:
            status, body = _get_json(f"http://127.0.0.1:{port}/healthz")
            assert (status, body["redis"]) == (200, health), body
            assert body["pools"][pool].startswith(health)
            assert _get_json(f"http://127.0.0.1:{port}/admit", admit_headers, "POST")[0] == admit
        finally:
            gate.stop()


def test_status_command_on_the_cluster(cluster: RedisCluster, pool: str) -> None:
    """`borrowd status --redis redis+cluster://...` finds the pool and reads its record."""
    done = subprocess.run([borrowd_command(), "status", "--pool", pool, "--redis", cluster.url,
                           "--json"], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["pool"] == pool


def test_daemon_config_accepts_a_cluster_url() -> None:
    """`redis.url = "redis+cluster://..."` passes the daemon's config validation."""
    from borrowd.controller.config import config_from_mapping

    config = config_from_mapping({"redis": {"url": "redis+cluster://a:1,b:2/0"},
                                  "pools": [{"name": "chat"}]})
    assert config.redis.url.startswith("redis+cluster://")


def test_plain_client_on_the_wrong_node_is_refused(cluster: RedisCluster, pool: str) -> None:
    """The failure the cluster URL fixes: a plain client on a non-owner node gets MOVED."""
    with pytest.raises(redis.exceptions.MovedError):
        cluster.node_client(0).exists(f"borrowd:{{{pool}}}:budget")
