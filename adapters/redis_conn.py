"""Redis connections from one URL, sync and asyncio, for every borrowd part that talks to Redis.

Accepted URLs: `redis://[user:password@]host:port/db`, `rediss://...` (TLS; `ssl_*` query
options as redis-py reads them), Sentinel
`redis+sentinel://[user:password@]host:port[,host:port...]/service[/db]` (`rediss+sentinel`
for TLS), and Redis Cluster `redis+cluster://[user:password@]host:port[,host:port...][/0]`
(`rediss+cluster` for TLS; any reachable nodes, the client discovers the rest and follows
MOVED/ASK; every pool's keys share one hash tag, so its scripts run on one node). Clients
decode responses to `str`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.sentinel
import redis.cluster
import redis.sentinel
from borrowd.adapters.redact import redact_url
from borrowd.models.errors import ConfigError

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
REDIS_URL_ENV = "BORROWD_REDIS_URL"
DEFAULT_CONNECT_TIMEOUT_S = 2.0
DEFAULT_SOCKET_TIMEOUT_S = 5.0

_PLAIN_SCHEMES = ("redis", "rediss", "unix")
_SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
_CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")


def resolve_redis_url(arg: str | None) -> str:
    """The Redis URL to use: `arg`, else env `BORROWD_REDIS_URL`, else the local default."""
    if arg:
        return arg
    return os.environ.get(REDIS_URL_ENV) or DEFAULT_REDIS_URL


@dataclass(frozen=True)
class SentinelTarget:
    """A parsed `redis+sentinel://` URL."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int
    username: str | None
    password: str | None
    tls: bool
    sentinel_password: str | None


def _split_hosts(url: str, kind: str) -> tuple[str | None, str | None, list[tuple[str, int]],
                                              list[str], dict[str, list[str]]]:
    """(username, password, [(host, port)], path segments, query) of a multi-host URL."""
    _, _, rest = url.partition("://")
    netloc, _, path_query = rest.partition("/")
    path, _, query = path_query.partition("?")
    if "?" in netloc:
        netloc, _, query = netloc.partition("?")
    username = password = None
    if "@" in netloc:
        userinfo, netloc = netloc.rsplit("@", 1)
        user, sep, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if sep else None
    hosts = []
    for hostport in netloc.split(","):
        host, sep, port = hostport.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(
                f"{kind} URL {redact_url(url)}: address {hostport!r} is not host:port"
            )
        hosts.append((host.strip("[]"), int(port)))
    return username, password, hosts, [seg for seg in path.split("/") if seg], parse_qs(query)


def parse_sentinel_url(url: str) -> SentinelTarget:
    """Parse `redis+sentinel://[user:pw@]h:p[,h:p]/service[/db][?sentinel_password=...]`."""
    scheme = url.partition("://")[0]
    if scheme not in _SENTINEL_SCHEMES:
        raise ConfigError(f"not a Sentinel URL: {redact_url(url)}")
    username, password, sentinels, segments, options = _split_hosts(url, "Sentinel")
    if not segments or len(segments) > 2:
        raise ConfigError(f"Sentinel URL {redact_url(url)} must end in /service or /service/db")
    db = 0
    if len(segments) == 2:
        if not segments[1].isdigit():
            raise ConfigError(f"Sentinel URL {redact_url(url)}: db {segments[1]!r} is not a number")
        db = int(segments[1])
    return SentinelTarget(
        sentinels=tuple(sentinels),
        service=unquote(segments[0]),
        db=db,
        username=username,
        password=password,
        tls=scheme.startswith("rediss"),
        sentinel_password=options.get("sentinel_password", [None])[0],
    )


@dataclass(frozen=True)
class ClusterTarget:
    """A parsed `redis+cluster://` URL."""

    nodes: tuple[tuple[str, int], ...]
    username: str | None
    password: str | None
    tls: bool


def parse_cluster_url(url: str) -> ClusterTarget:
    """Parse `redis+cluster://[user:pw@]h:p[,h:p][/0]` (a cluster has only database 0)."""
    scheme = url.partition("://")[0]
    if scheme not in _CLUSTER_SCHEMES:
        raise ConfigError(f"not a Redis Cluster URL: {redact_url(url)}")
    username, password, nodes, segments, _ = _split_hosts(url, "Redis Cluster")
    if segments not in ([], ["0"]):
        raise ConfigError(f"Redis Cluster URL {redact_url(url)}: a cluster has only db 0, "
                          f"got /{'/'.join(segments)}")
    return ClusterTarget(nodes=tuple(nodes), username=username, password=password,
                         tls=scheme.startswith("rediss"))


class _AsyncClusterPubSub(redis.asyncio.cluster.ClusterPubSub):
    """redis-py's asyncio cluster pub/sub, usable as a client's first command: it looks the
    channel's slot up in a map that only the client's initialisation fills."""

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        """Initialise the cluster client (a no-op once done), then run the command."""
        await self.cluster.initialize()
        return await super().execute_command(*args, **kwargs)


class _AsyncCluster(redis.asyncio.cluster.RedisCluster):
    """The asyncio cluster client with `_AsyncClusterPubSub` (the budget watchers subscribe
    before anything else)."""

    def pubsub(self, node: Any = None, host: str | None = None, port: int | None = None,
               **kwargs: Any) -> redis.asyncio.cluster.ClusterPubSub:
        """A pub/sub that initialises this client before its first command."""
        return _AsyncClusterPubSub(self, node=node, host=host, port=port, **kwargs)


def _scheme(url: str) -> str:
    scheme = url.partition("://")[0] if "://" in url else ""
    if scheme not in _PLAIN_SCHEMES + _SENTINEL_SCHEMES + _CLUSTER_SCHEMES:
        raise ConfigError(
            f"Redis URL {redact_url(url)!r} has scheme {scheme!r}; use redis://, rediss://, "
            "unix://, redis+sentinel:// or redis+cluster://"
        )
    return scheme


def _options(connect_timeout_s: float, socket_timeout_s: float) -> dict:
    return {
        "decode_responses": True,
        "socket_connect_timeout": connect_timeout_s,
        "socket_timeout": socket_timeout_s,
    }


def connect(
    url: str,
    *,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    socket_timeout_s: float = DEFAULT_SOCKET_TIMEOUT_S,
) -> redis.Redis:
    """A sync client for `url` (no I/O yet: the first command connects)."""
    scheme = _scheme(url)
    options = _options(connect_timeout_s, socket_timeout_s)
    if scheme in _CLUSTER_SCHEMES:
        cluster = parse_cluster_url(url)
        return redis.cluster.RedisCluster(  # type: ignore[return-value]
            startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in cluster.nodes],
            username=cluster.username, password=cluster.password, ssl=cluster.tls, **options,
        )
    if scheme in _SENTINEL_SCHEMES:
        target = parse_sentinel_url(url)
        sentinel = redis.sentinel.Sentinel(
            list(target.sentinels),
            sentinel_kwargs={"password": target.sentinel_password,
                             "socket_timeout": socket_timeout_s,
                             "socket_connect_timeout": connect_timeout_s},
            **options,
        )
        return sentinel.master_for(
            target.service, db=target.db, username=target.username,
            password=target.password, ssl=target.tls,
        )
    try:
        return redis.Redis.from_url(url, **options)
    except ValueError as exc:
        raise ConfigError(f"Redis URL {redact_url(url)!r} is malformed: {exc}") from None


def connect_async(
    url: str,
    *,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    socket_timeout_s: float = DEFAULT_SOCKET_TIMEOUT_S,
) -> redis.asyncio.Redis:
    """An asyncio client for `url` (no I/O yet: the first command connects)."""
    scheme = _scheme(url)
    options = _options(connect_timeout_s, socket_timeout_s)
    if scheme in _CLUSTER_SCHEMES:
        cluster = parse_cluster_url(url)
        return _AsyncCluster(  # type: ignore[return-value]
            startup_nodes=[redis.asyncio.cluster.ClusterNode(h, p) for h, p in cluster.nodes],
            username=cluster.username, password=cluster.password, ssl=cluster.tls, **options,
        )
    if scheme in _SENTINEL_SCHEMES:
        target = parse_sentinel_url(url)
        sentinel = redis.asyncio.sentinel.Sentinel(
            list(target.sentinels),
            sentinel_kwargs={"password": target.sentinel_password,
                             "socket_timeout": socket_timeout_s,
                             "socket_connect_timeout": connect_timeout_s},
            **options,
        )
        return sentinel.master_for(
            target.service, db=target.db, username=target.username,
            password=target.password, ssl=target.tls,
        )
    try:
        return redis.asyncio.Redis.from_url(url, **options)
    except ValueError as exc:
        raise ConfigError(f"Redis URL {redact_url(url)!r} is malformed: {exc}") from None
