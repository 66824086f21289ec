"""The proxy's HTTP/1.1 client to vLLM: keep-alive connections, httptools, callbacks per chunk.

A streamed response body is handed to a sink callback from the connection's
`data_received` (no task per chunk), so the proxy can forward a chunk in the same callback
it arrived in. Idle connections are kept per upstream for `idle_keepalive_s`, below
uvicorn's 5 s keep-alive timeout (vLLM's server); a request sent on a reused connection
that the server closed before answering a byte is sent once more on a new connection.
Read timeouts are the longest silence mid-response, checked by one sweeper task rather
than a timer per chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

import httptools

from adapters.proxy.http1 import no_delay

BodySink = Callable[[bytes], None]
EndSink = Callable[[str], None]
"""Called once when a response ends: "" when complete, else why it failed."""


class UpstreamError(Exception):
    """An upstream request failed before its response head; `kind` is connect or timeout."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class _Target:
    """Where one upstream base URL points: scheme, host, port, path prefix, idle pool."""

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        self.secure = parts.scheme == "https"
        self.host = parts.hostname or "localhost"
        self.port = parts.port or (443 if self.secure else 80)
        self.prefix = parts.path.rstrip("/")
        default_port = (self.secure and self.port == 443) or (not self.secure and self.port == 80)
        self.host_header = self.host if default_port else f"{self.host}:{self.port}"
        self.idle: list[UpstreamResponse] = []


class UpstreamResponse(asyncio.Protocol):
    """One connection to an upstream, and the response being read on it.

    `status` and `headers` are set once the head has arrived. The body goes to the sink set
    by `stream(on_body, on_end)` (chunks that came before are handed over first), or is
    gathered by `read()`. `close()` drops the connection, which makes vLLM abort the request.
    """

    def __init__(self, client: UpstreamClient, target: _Target) -> None:
        self._client = client
        self._target = target
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.status = 0
        self.headers: dict[str, str] = {}
        self._head: asyncio.Future[None] | None = None
        self._early: list[bytes] = []
        self._on_body: BodySink | None = None
        self._on_end: EndSink | None = None
        self._ended: str | None = None
        self._framed = True
        self.received_bytes = 0
        self.last_data_s = 0.0
        self.idle_since_s = 0.0
        self.busy = False
        self.closed = False
        self.exchanges = 0

    # -- transport -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = no_delay(transport)

    def data_received(self, data: bytes) -> None:
        self.received_bytes += len(data)
        self.last_data_s = time.monotonic()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"malformed response from upstream: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        with contextlib.suppress(ValueError):
            self._target.idle.remove(self)
        if self.busy:
            if not self._framed and self.status:
                self._end("")
            else:
                self._fail("connection closed early" if exc is None else repr(exc))

    # -- httptools callbacks -----------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self._framed = ("content-length" in self.headers
                        or "chunked" in self.headers.get("transfer-encoding", "")
                        or self.status in (204, 304))
        if self._head is not None and not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self._on_body is not None:
            self._on_body(body)
        else:
            self._early.append(body)

    def on_message_complete(self) -> None:
        self._end("")

    # -- one exchange ------------------------------------------------------------------

    def send(self, request: bytes) -> asyncio.Future[None]:
        """Write a request; the returned future resolves when the response head is in."""
        self.busy = True
        self.exchanges += 1
        self.status = 0
        self.headers = {}
        self._early = []
        self._on_body = self._on_end = None
        self._ended = None
        self.received_bytes = 0
        self.last_data_s = time.monotonic()
        self._head = asyncio.get_running_loop().create_future()
        assert self.transport is not None
        self.transport.write(request)
        return self._head

    def stream(self, on_body: BodySink, on_end: EndSink) -> None:
        """Hand the body to `on_body` chunk by chunk, then call `on_end` once."""
        early, self._early = self._early, []
        for chunk in early:
            on_body(chunk)
        self._on_body = on_body
        self._on_end = on_end
        if self._ended is not None:
            ended, self._ended = self._ended, None
            self._deliver_end(ended)

    async def read(self) -> bytes:
        """The whole body; raises UpstreamError when the response breaks off."""
        parts: list[bytes] = []
        done: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        def on_end(failure: str) -> None:
            if not done.done():
                done.set_result(failure)

        self.stream(parts.append, on_end)
        failure = await done
        if failure:
            raise UpstreamError("timeout" if failure == "timeout" else "closed", failure)
        return b"".join(parts)

    def _current(self, action: Callable[[], None]) -> Callable[[], None]:
        """`action`, made to do nothing once this exchange has ended (the connection may
        then serve another request)."""
        exchange = self.exchanges

        def guarded() -> None:
            if self.busy and self.exchanges == exchange:
                action()

        return guarded

    def aborter(self) -> Callable[[], None]:
        """A callable that drops the connection while this exchange is unfinished."""
        return self._current(self.close)

    def pauser(self) -> Callable[[], None]:
        """A callable that pauses reading while this exchange is unfinished."""
        return self._current(self.pause_reading)

    def resumer(self) -> Callable[[], None]:
        """A callable that resumes reading while this exchange is unfinished."""
        return self._current(self.resume_reading)

    def close(self) -> None:
        """Drop the connection (mid-response this aborts the request upstream)."""
        if self.transport is not None and not self.closed:
            self.transport.close()

    def pause_reading(self) -> None:
        """Stop reading the body (the client is slow)."""
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        """Read the body again."""
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def timed_out(self) -> None:
        """The upstream was silent too long mid-response."""
        self._fail("timeout")
        self.close()

    def _fail(self, reason: str) -> None:
        if self._head is not None and not self._head.done():
            kind = "timeout" if reason == "timeout" else "closed"
            self._head.set_exception(UpstreamError(kind, reason))
            self.busy = False
            self._client._settled(self, keep=False)
            self.close()
            return
        self._end(reason)
        self.close()

    def _end(self, failure: str) -> None:
        if not self.busy:
            return
        self.busy = False
        self._client._settled(self, keep=failure == "" and not self.closed
                              and self._parser.should_keep_alive())
        if self._on_end is None:
            self._ended = failure
        else:
            self._deliver_end(failure)

    def _deliver_end(self, failure: str) -> None:
        on_end, self._on_end = self._on_end, None
        self._on_body = None
        if on_end is not None:
            on_end(failure)


class UpstreamClient:
    """Keep-alive HTTP/1.1 connections to the upstreams, one request per connection at a time."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float,
                 idle_keepalive_s: float = 4.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.idle_keepalive_s = idle_keepalive_s
        self._targets: dict[str, _Target] = {}
        self._busy: set[UpstreamResponse] = set()
        self._sweeper: asyncio.Task | None = None
        self._ssl: ssl.SSLContext | None = None

    def _target(self, base_url: str) -> _Target:
        target = self._targets.get(base_url)
        if target is None:
            target = self._targets[base_url] = _Target(base_url)
        return target

    async def request(self, base_url: str, method: str, path: str,
                      headers: Mapping[str, str], body: bytes = b"") -> UpstreamResponse:
        """Send a request; returns once the response head arrived (raises UpstreamError)."""
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        target = self._target(base_url)
        lines = [f"{method} {target.prefix}{path} HTTP/1.1", f"Host: {target.host_header}",
                 f"Content-Length: {len(body)}"]
        lines.extend(f"{name}: {value}" for name, value in headers.items())
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        conn = self._reuse(target)
        if conn is not None:
            try:
                return await self._exchange(conn, head + body)
            except UpstreamError as exc:
                # The server closed an idle connection as the request went out: retry once
                # on a new one. A response byte would mean the server took the request.
                if exc.kind != "closed" or conn.received_bytes:
                    raise
        return await self._exchange(await self._connect(target), head + body)

    def _reuse(self, target: _Target) -> UpstreamResponse | None:
        horizon_s = time.monotonic() - self.idle_keepalive_s
        while target.idle:
            conn = target.idle.pop()
            if not conn.closed and conn.idle_since_s >= horizon_s:
                return conn
            conn.close()
        return None

    async def _connect(self, target: _Target) -> UpstreamResponse:
        loop = asyncio.get_running_loop()
        context = None
        if target.secure:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        try:
            _transport, conn = await asyncio.wait_for(
                loop.create_connection(lambda: UpstreamResponse(self, target), target.host,
                                       target.port, ssl=context),
                self.connect_timeout_s)
        except TimeoutError:
            raise UpstreamError("timeout", f"connect to {target.host_header} timed out "
                                f"after {self.connect_timeout_s:g} s") from None
        except OSError as exc:
            raise UpstreamError("connect", exc.strerror or repr(exc)) from None
        return conn

    async def _exchange(self, conn: UpstreamResponse, request: bytes) -> UpstreamResponse:
        self._busy.add(conn)
        try:
            await conn.send(request)
        except BaseException:
            self._busy.discard(conn)
            conn.close()
            raise
        return conn

    def _settled(self, conn: UpstreamResponse, keep: bool) -> None:
        self._busy.discard(conn)
        if keep:
            conn.idle_since_s = time.monotonic()
            conn._target.idle.append(conn)

    async def _sweep(self) -> None:
        """Time out silent responses; close idle connections past their keep-alive."""
        interval_s = min(1.0, self.read_timeout_s / 4)
        while True:
            await asyncio.sleep(interval_s)
            now_s = time.monotonic()
            for conn in list(self._busy):
                if conn.closed or not conn.busy:
                    self._busy.discard(conn)
                elif now_s - conn.last_data_s > self.read_timeout_s:
                    self._busy.discard(conn)
                    conn.timed_out()
            for target in self._targets.values():
                for conn in [c for c in target.idle if now_s - c.idle_since_s
                             > self.idle_keepalive_s]:
                    conn.close()

    async def close(self) -> None:
        """Close every connection and stop the sweeper."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        for conn in list(self._busy):
            conn.close()
        for target in self._targets.values():
            for conn in list(target.idle):
                conn.close()
