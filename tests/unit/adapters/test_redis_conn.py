"""Redis URLs resolve and parse: plain, TLS, ACL user, Sentinel; bad ones are named."""

from __future__ import annotations

import pytest
import redis
import redis.asyncio
from borrowd.adapters.redis_conn import (
    DEFAULT_REDIS_URL,
    REDIS_URL_ENV,
    connect,
    connect_async,
    parse_cluster_url,
    parse_sentinel_url,
    redact_url,
    resolve_redis_url,
)
from borrowd.models.errors import ConfigError


@pytest.mark.parametrize(
    ("arg", "env", "expected"),
    [
        ("redis://h:1/2", "redis://env:9/0", "redis://h:1/2"),
        (None, "redis://env:9/0", "redis://env:9/0"),
        (None, None, DEFAULT_REDIS_URL),
        ("", None, DEFAULT_REDIS_URL),
    ],
    ids=["argument-wins", "env-next", "default", "empty-argument"],
)
def test_resolve_redis_url(monkeypatch, arg, env, expected) -> None:
    """The argument wins over BORROWD_REDIS_URL, which wins over the local default."""
    if env is None:
        monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    else:
        monkeypatch.setenv(REDIS_URL_ENV, env)
    assert resolve_redis_url(arg) == expected


def test_acl_url_carries_user_and_password() -> None:
    """A redis:// URL with user:password sets both on the connection pool."""
    client = connect("redis://gate:s3cret@10.0.0.5:6380/3")
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["username"], kwargs["password"], kwargs["host"], kwargs["port"],
            kwargs["db"]) == ("gate", "s3cret", "10.0.0.5", 6380, 3)


def test_tls_url_uses_ssl_connections() -> None:
    """rediss:// gives TLS connections, sync and asyncio."""
    sync_client = connect("rediss://h:6379/0")
    async_client = connect_async("rediss://h:6379/0")
    assert issubclass(sync_client.connection_pool.connection_class, redis.SSLConnection)
    assert issubclass(async_client.connection_pool.connection_class,
                      redis.asyncio.connection.SSLConnection)


def test_sentinel_url_parses() -> None:
    """Sentinel URLs name several sentinels, the service, the db and the credentials."""
    target = parse_sentinel_url(
        "redis+sentinel://u:p%40ss@s1:26379,s2:26380/mymaster/4?sentinel_password=x"
    )
    assert target.sentinels == (("s1", 26379), ("s2", 26380))
    assert (target.service, target.db, target.username, target.password) == (
        "mymaster", 4, "u", "p@ss")
    assert target.sentinel_password == "x"
    assert not target.tls


def test_sentinel_connect_builds_master_client() -> None:
    """connect() on a Sentinel URL returns a client bound to the service's master."""
    client = connect("redis+sentinel://s1:26379/mymaster")
    assert client.connection_pool.service_name == "mymaster"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://h:1/0", "scheme"),
        ("redis+sentinel://s1/mymaster", "host:port"),
        ("redis+sentinel://s1:1", "service"),
        ("redis+sentinel://s1:1/m/x", "db"),
    ],
    ids=["wrong-scheme", "sentinel-without-port", "sentinel-without-service", "bad-db"],
)
def test_bad_urls_are_named(url, message) -> None:
    """A malformed URL raises ConfigError naming what is wrong."""
    with pytest.raises(ConfigError, match=message):
        connect(url)


def test_redact_hides_password() -> None:
    """Passwords never appear in printed URLs."""
    assert redact_url("redis://u:pw@h:1/0") == "redis://u:***@h:1/0"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"


@pytest.mark.parametrize(
    ("url", "nodes", "user", "password", "tls"),
    [("redis+cluster://a:7000,b:7001/0", (("a", 7000), ("b", 7001)), None, None, False),
     ("rediss+cluster://u:p%40ss@[::1]:7000", (("::1", 7000),), "u", "p@ss", True)],
    ids=["plain", "tls-acl-ipv6"],
)
def test_cluster_url(url: str, nodes: tuple, user: str | None, password: str | None,
                     tls: bool) -> None:
    """A `redis+cluster://` URL names startup nodes, an ACL user and TLS."""
    target = parse_cluster_url(url)
    assert (target.nodes, target.username, target.password, target.tls) == (
        nodes, user, password, tls)


@pytest.mark.parametrize(
    ("url", "message"),
    [("redis+cluster://a:7000/3", "only db 0"), ("redis+cluster://a/0", "not host:port")],
    ids=["db-3", "no-port"],
)
def test_bad_cluster_url_is_named(url: str, message: str) -> None:
    """A cluster URL with a database other than 0 or a node without port is refused."""
    with pytest.raises(ConfigError, match=message):
        parse_cluster_url(url)
