"""A throw-away 3-node Redis Cluster (no replicas) on free loopback ports, for tests.

Three `redis-server --cluster-enabled yes` processes (each cluster bus on a free port of its
own, not port + 10000), joined by `redis-cli --cluster create`, each in its own temporary
directory (its nodes.conf there), stopped by PID.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import redis

from tests.support.servers import ServerProcess, free_port, start_redis, wait_until


@dataclass
class RedisCluster:
    """The cluster's nodes and its `redis+cluster://` URL."""

    nodes: list[ServerProcess]

    @property
    def url(self) -> str:
        """`redis+cluster://` URL naming every node."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes) + "/0"

    def node_client(self, index: int) -> redis.Redis:
        """A plain (non-cluster) client of one node."""
        return redis.Redis(port=self.nodes[index].port, decode_responses=True)

    def owner_index(self, key: str) -> int:
        """Which node serves the slot of `key`."""
        client = self.node_client(0)
        slot = client.cluster("keyslot", key)
        for start, end, (_host, port, *_rest), *_replicas in client.cluster("slots"):
            if start <= slot <= end:
                return next(i for i, node in enumerate(self.nodes) if node.port == port)
        raise AssertionError(f"no node owns slot {slot}")


def needs_cluster_tools() -> str | None:
    """Why a cluster cannot be started here, or None."""
    missing = [b for b in ("redis-server", "redis-cli") if shutil.which(b) is None]
    return f"needs {', '.join(missing)} (Debian package redis-server)" if missing else None


@contextmanager
def redis_cluster() -> Iterator[RedisCluster]:
    """Start three cluster-enabled redis-servers and create the cluster; stop them after."""
    nodes: list[ServerProcess] = []
    try:
        for _ in range(3):
            port = free_port()
            nodes.append(start_redis(port, extra_args=[
                "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                "--cluster-port", str(free_port()), "--cluster-node-timeout", "2000"]))
        created = subprocess.run(
            ["redis-cli", "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in nodes],
             "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, text=True, timeout=60, check=False)
        if created.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {created.stdout[-2000:]}")
        cluster = RedisCluster(nodes)
        wait_until(lambda: all(cluster.node_client(i).cluster("info")["cluster_state"] == "ok"
                               for i in range(3)), 20.0, "the cluster to be ok")
        yield cluster
    finally:
        for node in nodes:
            node.stop()
