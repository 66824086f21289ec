"""The proxy's own HTTP/1.1 layer over real loopback sockets: server, upstream client, eager
handler start."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import uvloop
from borrowd.adapters.proxy.http1 import HttpRequest, HttpServer, Responder, start_eagerly
from borrowd.adapters.proxy.upstream_http import UpstreamClient, UpstreamError

from tests.support.servers import free_port


async def _echo(request: HttpRequest, out: Responder) -> None:
    """A handler: /stream sends three chunks, /slow waits, anything else echoes."""
    if request.path == "/stream":
        out.start_stream(200, {"Content-Type": "text/event-stream"})
        for index in range(3):
            out.write(b"data: %d\n\n" % index)
        out.end()
    elif request.path == "/slow":
        await asyncio.sleep(30)
    else:
        out.respond(200, f"{request.method} {request.path} {request.query} ".encode()
                    + request.body, content_type="text/plain")


@contextlib.asynccontextmanager
async def _server(handler=_echo, max_body_bytes: int = 1024) -> AsyncIterator[int]:
    server = HttpServer(handler, max_body_bytes)
    port = free_port()
    await server.start("127.0.0.1", port)
    try:
        yield port
    finally:
        await server.cleanup(0.5)


async def _exchange(port: int, raw: bytes, *, until: bytes = b"", read_s: float = 2.0) -> bytes:
    """Send raw bytes, read until `until` shows up (or EOF, or `read_s`)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    data = b""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(read_s):
            while not (until and until in data):
                chunk = await reader.read(65536)
                if not chunk:
                    break
                data += chunk
    writer.close()
    return data


async def test_pipelined_requests_are_answered_in_order() -> None:
    """Two requests in one write get two responses, in order, on one keep-alive connection."""
    async with _server() as port:
        raw = (b"POST /a?x=1 HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n\r\nabc"
               b"GET /b HTTP/1.1\r\nHost: h\r\n\r\n")
        data = await _exchange(port, raw, until=b"GET /b  ")
    first, second = data.index(b"POST /a x=1 abc"), data.index(b"GET /b  ")
    assert first < second
    assert data.count(b"HTTP/1.1 200 OK") == 2
    assert b"Connection: close" not in data


async def test_streamed_response_is_chunked_and_terminated() -> None:
    """A stream goes out with chunked framing, one chunk per write, and a final zero chunk."""
    async with _server() as port:
        data = await _exchange(port, b"GET /stream HTTP/1.1\r\nHost: h\r\n\r\n",
                               until=b"0\r\n\r\n")
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in head
    assert body == b"9\r\ndata: 0\n\n\r\n9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n"


async def test_malformed_request_gets_400_and_the_connection_closes() -> None:
    """Bytes that are not HTTP get a 400 naming the problem, then EOF."""
    async with _server() as port:
        data = await _exchange(port, b"NOT-HTTP\r\n\r\n")
    assert data.startswith(b"HTTP/1.1 400 Bad Request")
    assert b"malformed HTTP request" in data
    assert b"Connection: close" in data


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_oversized_body_is_flagged_and_the_connection_closes(framing: str) -> None:
    """A body over the limit, declared or streamed, reaches the handler as too_large with no
    body kept, and the connection is not reused."""
    seen: list[HttpRequest] = []

    async def handler(request: HttpRequest, out: Responder) -> None:
        seen.append(request)
        out.respond(413 if request.too_large else 200, b"{}")

    body = b"x" * 2000
    if framing == "content-length":
        raw = b"POST /p HTTP/1.1\r\nHost: h\r\nContent-Length: 2000\r\n\r\n" + body
    else:
        raw = (b"POST /p HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"7d0\r\n" + body + b"\r\n0\r\n\r\n")
    async with _server(handler) as port:
        data = await _exchange(port, raw)
    assert data.startswith(b"HTTP/1.1 413")
    assert b"Connection: close" in data
    assert seen[0].too_large and seen[0].body == b""


async def test_expect_100_continue_is_answered() -> None:
    """A client that waits for 100 Continue before its body gets it (curl does this)."""
    async with _server() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /e HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n"
                     b"Expect: 100-continue\r\n\r\n")
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2.0)
        writer.write(b"hi")
        final = await asyncio.wait_for(reader.readuntil(b"hi"), 2.0)
        writer.close()
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert final.endswith(b"POST /e  hi")


async def test_client_disconnect_cancels_its_handler() -> None:
    """A client that leaves mid-request cancels the handler's task (the proxy's cue to
    abort the upstream request)."""
    cancelled = asyncio.Event()

    async def handler(request: HttpRequest, out: Responder) -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async with _server(handler) as port:
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /slow HTTP/1.1\r\nHost: h\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.close()
        await asyncio.wait_for(cancelled.wait(), 2.0)


async def test_eager_start_runs_the_synchronous_prefix_at_once() -> None:
    """The coroutine runs up to its first suspension before start_eagerly returns; the task
    finishes it, returns its failure, and cancels through what it waits on."""
    steps: list[str] = []
    gate: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def work() -> None:
        steps.append("prefix")
        value = await gate
        steps.append(f"got {value}")
        await asyncio.sleep(0)
        steps.append("done")

    task = start_eagerly(work())
    assert steps == ["prefix"]
    gate.set_result(7)
    await task
    assert steps == ["prefix", "got 7", "done"]

    async def fails() -> None:
        await asyncio.sleep(0)
        raise ValueError("bad")

    with pytest.raises(ValueError, match="bad"):
        await start_eagerly(fails())

    cleaned = asyncio.Event()

    async def waits() -> None:
        try:
            await asyncio.get_running_loop().create_future()
        finally:
            cleaned.set()

    task = start_eagerly(waits())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned.is_set()


async def test_upstream_client_reuses_and_retries_a_closed_keepalive_connection() -> None:
    """Sequential requests share one connection; when the server closes the idle connection
    as the next request goes out (no byte answered), that request goes out once more on a
    new connection and succeeds."""
    connections: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        answered = 0
        while True:
            try:
                await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            if len(connections) == 1 and answered == 3:
                break  # the keep-alive race: closed without a byte of response
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            answered += 1
        writer.close()

    port = free_port()
    server = await asyncio.start_server(handler, "127.0.0.1", port)
    client = UpstreamClient(connect_timeout_s=1.0, read_timeout_s=5.0)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(3):
            resp = await client.request(base, "GET", "/x", {})
            assert (resp.status, await resp.read()) == (200, b"ok")
        assert len(connections) == 1
        resp = await client.request(base, "GET", "/x", {})
        assert (resp.status, await resp.read()) == (200, b"ok")
        assert len(connections) == 2
    finally:
        await client.close()
        server.close()


async def test_upstream_client_reports_refusal_and_silence() -> None:
    """A refused connection is a `connect` error; an upstream silent past the read timeout
    is a `timeout`."""
    client = UpstreamClient(connect_timeout_s=1.0, read_timeout_s=0.3)

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)

    port = free_port()
    server = await asyncio.start_server(silent, "127.0.0.1", port)
    try:
        with pytest.raises(UpstreamError) as refused:
            await client.request(f"http://127.0.0.1:{free_port()}", "GET", "/", {})
        assert refused.value.kind == "connect"
        with pytest.raises(UpstreamError) as silence:
            await asyncio.wait_for(client.request(f"http://127.0.0.1:{port}", "GET", "/", {}),
                                   3.0)
        assert silence.value.kind == "timeout"
    finally:
        await client.close()
        server.close()


async def test_stale_aborter_leaves_a_reused_connection_alone() -> None:
    """Dropping a finished exchange must not close its connection, which may already serve
    the next request (a late revocation would otherwise cut another stream)."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    port = free_port()
    server = await asyncio.start_server(handler, "127.0.0.1", port)
    client = UpstreamClient(connect_timeout_s=1.0, read_timeout_s=5.0)
    try:
        first = await client.request(f"http://127.0.0.1:{port}", "GET", "/", {})
        abort_first = first.aborter()
        await first.read()
        second = await client.request(f"http://127.0.0.1:{port}", "GET", "/", {})
        assert second._conn is first._conn  # the same connection, reused
        abort_first()
        assert await second.read() == b"ok"
    finally:
        await client.close()
        server.close()


async def _tagging_upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers each request in ONE write: a body naming the request's path; /stream/* as
    three chunks with pauses, /err/* as a 404."""
    while True:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            break
        path = head.split(b" ", 2)[1]
        if path.startswith(b"/stream/"):
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for part in (b"<", path, b">"):
                await asyncio.sleep(0.001)
                writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            writer.write(b"0\r\n\r\n")
        else:
            status = b"404 Not Found" if path.startswith(b"/err/") else b"200 OK"
            writer.write(b"HTTP/1.1 %s\r\nContent-Length: %d\r\n\r\n%s"
                         % (status, len(path), path))
        await writer.drain()
    writer.close()


async def test_a_reused_connection_never_hands_over_an_unread_response() -> None:
    """The whole response arrives in one read, so its connection is back in the pool before
    its handler reads the body; a request that reuses the connection at once must neither
    wipe that body nor be handed it (the cross-client mix-up)."""
    port = free_port()
    server = await asyncio.start_server(_tagging_upstream, "127.0.0.1", port)
    client = UpstreamClient(connect_timeout_s=1.0, read_timeout_s=5.0)
    base = f"http://127.0.0.1:{port}"
    try:
        first = await client.request(base, "GET", "/first", {})
        second = await client.request(base, "GET", "/err/second", {})
        assert second._conn is first._conn  # the race: the first's connection, reused
        assert (second.status, await asyncio.wait_for(second.read(), 5)) == (404, b"/err/second")
        assert (first.status, await asyncio.wait_for(first.read(), 5)) == (200, b"/first")
    finally:
        await client.close()
        server.close()


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_every_response_reaches_its_own_request_under_load(loop_kind: str) -> None:
    """400 concurrent workers x 5 requests (whole bodies, chunked streams, errors) over a
    shared keep-alive pool: every response carries its own request's tag."""
    async def main() -> list[str]:
        port = free_port()
        server = await asyncio.start_server(_tagging_upstream, "127.0.0.1", port)
        client = UpstreamClient(connect_timeout_s=20.0, read_timeout_s=20.0)
        base = f"http://127.0.0.1:{port}"
        wrong: list[str] = []

        async def worker(index: int) -> None:
            for round_ in range(5):
                kind = ("whole", "stream", "err")[(index + round_) % 3]
                path = {"whole": f"/w/{index}/{round_}", "stream": f"/stream/{index}/{round_}",
                        "err": f"/err/{index}/{round_}"}[kind]
                resp = await client.request(base, "GET", path, {})
                if kind == "stream":
                    got: list[bytes] = []
                    ended: asyncio.Future[str] = asyncio.get_running_loop().create_future()
                    resp.stream(got.append, ended.set_result)
                    body = b"".join(got) if await ended == "" else b"failed"
                    expected = b"<" + path.encode() + b">"
                else:
                    body = await resp.read()
                    expected = path.encode()
                status = 404 if kind == "err" else 200
                if (resp.status, body) != (status, expected):
                    wrong.append(f"{path}: {resp.status} {body[:40]!r}")

        try:
            await asyncio.wait_for(asyncio.gather(*(worker(i) for i in range(400))), 90)
        finally:
            await client.close()
            server.close()
        return wrong

    run = uvloop.run if loop_kind == "uvloop" else asyncio.run
    assert run(main()) == []


def test_server_runs_on_uvloop() -> None:
    """`borrowd proxy` runs on uvloop, whose transports are not asyncio.Transport."""
    async def main() -> bytes:
        async with _server() as port:
            return await _exchange(port, b"GET /stream HTTP/1.1\r\nHost: h\r\n\r\n",
                                   until=b"0\r\n\r\n")

    assert b"data: 2" in uvloop.run(main())
