"""What a client may hold on the proxy's HTTP/1.1 server, over real loopback sockets: header
size and count, body size, header/body/idle time, open connections, framing it refuses."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
from borrowd.adapters.proxy.http1 import HttpRequest, HttpServer, Responder, ServerLimits

from tests.support.servers import free_port


async def _handler(request: HttpRequest, out: Responder) -> None:
    """413 for a body flagged too large, a stream on /stream, a long wait on /slow."""
    if request.too_large:
        out.respond(413, b"{}")
    elif request.path == "/stream":
        out.start_stream(200, {"Content-Type": "text/event-stream"})
        out.write(b"data: 1\n\n")
        out.end()
    elif request.path == "/slow":
        await asyncio.sleep(30)
    else:
        out.respond(200, b"ok " + request.body, content_type="text/plain")


@contextlib.asynccontextmanager
async def _server(**limits: float) -> AsyncIterator[tuple[int, HttpServer]]:
    server = HttpServer(_handler, 1024, ServerLimits(**limits))  # type: ignore[arg-type]
    port = free_port()
    await server.start("127.0.0.1", port)
    try:
        yield port, server
    finally:
        await server.cleanup(0.2)


async def _read_all(reader: asyncio.StreamReader, timeout_s: float = 3.0) -> bytes:
    """Everything until EOF (or `timeout_s`)."""
    data = b""
    with contextlib.suppress(TimeoutError, ConnectionError):
        async with asyncio.timeout(timeout_s):
            while chunk := await reader.read(65536):
                data += chunk
    return data


async def _send(port: int, raw: bytes) -> tuple[bytes, float]:
    """Send `raw`, read to EOF; the answer and how long it took."""
    started_s = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    data = await _read_all(reader)
    writer.close()
    return data, time.monotonic() - started_s


@pytest.mark.parametrize("raw, status", [
    (b"GET / HTTP/1.1\r\nHost: h\r\nX-Big: " + b"a" * 3000 + b"\r\n\r\n", b"431"),
    (b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(30)) + b"\r\n", b"431"),
    (b"GET /" + b"a" * 3000 + b" HTTP/1.1\r\nHost: h\r\n\r\n", b"431"),
    (b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
     b"5\r\nhello\r\n0\r\n\r\n", b"501"),
], ids=["header-size", "header-count", "url-size", "gzip-chunked"])
async def test_oversized_heads_and_unknown_codings_are_refused(raw: bytes, status: bytes) -> None:
    """Too large a head or too many fields get 431, a coding other than chunked 501; each
    closes the connection."""
    async with _server(max_header_bytes=2048, max_headers=20) as (port, _):
        data, _took_s = await _send(port, raw)
    assert data.startswith(b"HTTP/1.1 " + status)
    assert b"Connection: close" in data


async def test_a_declared_huge_body_is_answered_before_it_arrives() -> None:
    """`Content-Length: 10000000000` with no body gets 413 at once, not a wait for 10 GB."""
    async with _server() as (port, _):
        data, took_s = await _send(
            port, b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 10000000000\r\n\r\n")
    assert data.startswith(b"HTTP/1.1 413")
    assert took_s < 1.0


@pytest.mark.parametrize("raw, what", [
    (b"GET / HTTP/1.1\r\nHost: h\r\n", "headers"),
    (b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 100\r\n\r\nabc", "body"),
], ids=["slow-headers", "slow-body"])
async def test_slow_clients_get_408_and_are_closed(raw: bytes, what: str) -> None:
    """A client that stops half way through its headers or its body (slowloris) is answered
    408 and closed after the limit."""
    async with _server(header_timeout_s=0.3, body_timeout_s=0.3) as (port, _):
        data, took_s = await _send(port, raw)
    assert data.startswith(b"HTTP/1.1 408")
    assert what.encode() in data
    assert 0.25 < took_s < 2.5


async def test_idle_keepalive_connections_are_closed() -> None:
    """A keep-alive connection that sends no next request is closed after the idle limit."""
    async with _server(idle_timeout_s=0.3) as (port, server):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
        started_s = time.monotonic()
        data = await _read_all(reader)
        writer.close()
        assert data.startswith(b"HTTP/1.1 200")
        assert 0.25 < time.monotonic() - started_s < 2.5
        assert not server.connections


async def test_connection_cap_closes_idle_connections_then_refuses() -> None:
    """Past the cap an idle connection makes room for a newcomer; when every connection is
    busy the newcomer gets 503 with Retry-After."""
    async with _server(max_connections=2) as (port, server):
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        await asyncio.sleep(0.05)
        answer, _took_s = await _send(port, b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close"
                                            b"\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 200")
        assert await _read_all(idle[0][0], 1.0) == b""  # the oldest idle one was closed
        busy = []
        for _ in range(2):
            _reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /slow HTTP/1.1\r\nHost: h\r\n\r\n")
            busy.append(writer)
            await asyncio.sleep(0.05)
        refused, _took_s = await _send(port, b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
        assert refused.startswith(b"HTTP/1.1 503")
        assert b"Retry-After: 1" in refused
        assert len(server.connections) == 2
        for _reader, writer in idle:
            writer.close()
        for writer in busy:
            writer.close()


async def test_http10_clients_get_an_unframed_stream_ended_by_close() -> None:
    """HTTP/1.0 has no chunked encoding: the stream comes raw and the connection closes."""
    async with _server() as (port, _):
        data, _took_s = await _send(port, b"GET /stream HTTP/1.0\r\n\r\n")
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"Transfer-Encoding" not in head
    assert b"Connection: close" in head
    assert body == b"data: 1\n\n"


@pytest.mark.parametrize("raw, status", [
    (b"GET / HTTP/1.1\r\nHost: h\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n", b"431"),
    (b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 10000000000\r\n\r\n" + b"x" * (1 << 20),
     b"413"),
], ids=["1MiB-header", "1MiB-of-a-10GB-body"])
async def test_a_client_still_sending_gets_its_refusal_not_a_reset(raw: bytes,
                                                                   status: bytes) -> None:
    """The server reads and drops what a refused client goes on sending for a moment
    (lingering close), so the client reads its 431/413 instead of a connection reset."""
    async with _server(max_header_bytes=2048) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(raw)
        await writer.drain()
        data = await _read_all(reader)
        writer.close()
    assert data.startswith(b"HTTP/1.1 " + status)


async def test_a_header_that_never_ends_is_refused_as_it_grows() -> None:
    """A header line sent in pieces without end is refused once past the limit (plus one
    read), not buffered until the header timeout."""
    async with _server(max_header_bytes=4096) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: h\r\nX-Big: ")
        started_s = time.monotonic()
        with contextlib.suppress(ConnectionError):
            for _ in range(64):
                writer.write(b"a" * 1024)
                await writer.drain()
                await asyncio.sleep(0.005)
        data = await _read_all(reader)
        writer.close()
    assert data.startswith(b"HTTP/1.1 431")
    assert time.monotonic() - started_s < 5.0


async def test_a_refused_connection_lingering_past_the_header_timeout_is_left_alone() -> None:
    """A client refused (431) late in its header time is not answered again when the
    header timeout passes while its connection lingers; the server goes on expiring others."""
    async with _server(max_header_bytes=2048, header_timeout_s=0.4) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: h\r\nX-Big: ")
        await asyncio.sleep(0.3)
        with contextlib.suppress(ConnectionError):
            writer.write(b"a" * 8192)
            await writer.drain()
        refused = await asyncio.wait_for(reader.read(65536), 2.0)
        await asyncio.sleep(0.4)  # the header timeout passes while the connection lingers
        slow, took_s = await _send(port, b"GET / HTTP/1.1\r\nHost: h\r\n")
        writer.close()
    assert refused.startswith(b"HTTP/1.1 431")
    assert slow.startswith(b"HTTP/1.1 408") and took_s < 2.0
