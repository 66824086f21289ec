"""Shared fixtures: real servers for integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from tests.support.servers import ServerProcess, start_redis


@pytest.fixture
def redis_proc() -> Iterator[ServerProcess]:
    """A real redis-server on a free loopback port for one test."""
    server = start_redis()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def shared_redis() -> Iterator[ServerProcess]:
    """A real redis-server shared by a whole test session (flush between uses yourself)."""
    server = start_redis()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(shared_redis: ServerProcess) -> Iterator[str]:
    """URL of the session's real redis-server, emptied (FLUSHALL) before each test."""
    client = redis.Redis.from_url(shared_redis.extra["url"])
    client.flushall()
    client.close()
    yield shared_redis.extra["url"]
