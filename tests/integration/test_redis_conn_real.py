"""Connection URLs against real servers: an ACL user, TLS (rediss://) and Sentinel."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from borrowd.adapters.redis_conn import connect, connect_async
from borrowd.adapters.store import BudgetStore
from borrowd.models.budget import Budget, Mode

from tests.support.servers import ServerProcess, free_port, start_process, start_redis

pytestmark = pytest.mark.integration

POOL = "p1"


def _budget() -> Budget:
    return Budget(pool=POOL, mode=Mode.OPEN, reason="law", batch_tokens_per_s=10.0,
                  batch_burst_tokens=10, max_batch_seqs=1, max_batch_kv_tokens=10,
                  max_batch_output_tokens=10)


@pytest.fixture
def acl_redis() -> Iterator[ServerProcess]:
    """A redis-server whose only usable user is `gate` (password `s3cret`) on borrowd keys."""
    server = start_redis(extra_args=[
        "--user", "default", "off",
        "--user", "gate", "on", ">s3cret", "~borrowd:*", "&borrowd:*", "+@all",
    ])
    try:
        yield server
    finally:
        server.stop()


def test_acl_user_url(acl_redis: ServerProcess) -> None:
    """user:password in the URL authenticates as that ACL user; a wrong password is refused."""
    good = connect(f"redis://gate:s3cret@127.0.0.1:{acl_redis.port}/0")
    stored = BudgetStore(good, POOL).publish(_budget(), epoch=1, ttl_ms=5000, now_s=time.time())
    assert good.acl_whoami() == "gate"
    assert BudgetStore(good, POOL).read(stored.issued_at_s) == stored
    with pytest.raises(redis.AuthenticationError):
        connect(f"redis://gate:wrong@127.0.0.1:{acl_redis.port}/0").ping()


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[ServerProcess, Path]]:
    """A redis-server speaking only TLS, with a throw-away self-signed certificate."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    port = free_port()
    server = start_redis(port=free_port(), extra_args=[
        "--tls-port", str(port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
        "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"])
    server.port = port
    try:
        yield server, cert
    finally:
        server.stop()


async def test_tls_url(tls_redis: tuple[ServerProcess, Path]) -> None:
    """rediss:// with the CA from the query string talks TLS, sync and asyncio."""
    server, cert = tls_redis
    url = f"rediss://127.0.0.1:{server.port}/0?ssl_ca_certs={cert}"
    assert connect(url).ping()
    aclient = connect_async(url)
    try:
        assert await aclient.ping()
    finally:
        await aclient.aclose()
    with pytest.raises(redis.ConnectionError):
        connect(f"redis://127.0.0.1:{server.port}/0", socket_timeout_s=1.0).ping()


def test_sentinel_url(redis_proc: ServerProcess, tmp_path: Path) -> None:
    """redis+sentinel:// finds the master through a real Sentinel and writes to it."""
    port = free_port()
    conf = tmp_path / "sentinel.conf"
    conf.write_text(f"port {port}\nbind 127.0.0.1\n"
                    f"sentinel monitor mymaster 127.0.0.1 {redis_proc.port} 1\n")
    sentinel = start_process("redis-sentinel",
                             [shutil.which("redis-server"), str(conf), "--sentinel"], port,
                             workdir=tmp_path)
    try:
        client = connect(f"redis+sentinel://127.0.0.1:{port}/mymaster/0")
        BudgetStore(client, POOL).publish(_budget(), epoch=1, ttl_ms=5000, now_s=time.time())
        direct = connect(redis_proc.extra["url"])
        assert direct.hget(f"borrowd:{{{POOL}}}:budget", "pool") == POOL
    finally:
        sentinel.stop()
