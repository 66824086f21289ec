"""The proxy's HTTP/1.1 client to vLLM: keep-alive connections, httptools, callbacks per chunk.

A streamed response body is handed to a sink callback from the connection's
`data_received` (no task per chunk), so the proxy can forward a chunk in the same callback
it arrived in. Idle connections are kept per upstream for `idle_keepalive_s`, below
uvicorn's 5 s keep-alive timeout (vLLM's server); a request sent on a reused connection
that the server closed before answering a byte is sent once more on a new connection.
Read timeouts are the longest silence mid-response, checked by one sweeper task rather
than a timer per chunk.

Each request/response pair is its own `UpstreamResponse` object, apart from the connection
(`_Connection`) that carries it. A connection goes back to the idle pool the moment its
response's last byte is parsed, often before the request's handler has read the body; the
body and the ending stay buffered in that handler's own exchange, so a request that reuses
the connection at once starts a new exchange and cannot touch (or receive) the old one.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

import httptools
from borrowd.adapters.proxy.http1 import no_delay

BodySink = Callable[[bytes], None]
EndSink = Callable[[str], None]
"""Called once when a response ends: "" when complete, else why it failed."""


class UpstreamError(Exception):
    """An upstream request failed before its response head; `kind` is connect or timeout."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class _OutOfStep(Exception):
    """The upstream sent a response no request is waiting for."""


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
        self.idle: list[_Connection] = []


class UpstreamResponse:
    """One request sent to an upstream, and its response.

    `status` and `headers` are set once the head has arrived. The body goes to the sink set
    by `stream(on_body, on_end)` (chunks that came before are handed over first), or is
    gathered by `read()`. `close()` drops the connection while this response is still
    being read on it, which makes vLLM abort the request; once the response has ended it
    does nothing, since the connection may already carry another request.
    """

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.status = 0
        self.headers: dict[str, str] = {}
        self._head: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._early: list[bytes] = []
        self._on_body: BodySink | None = None
        self._on_end: EndSink | None = None
        self._ended: str | None = None
        self.framed = True
        self.received_bytes = 0
        self.last_data_s = time.monotonic()
        self.finished = False
        """True once the last byte was parsed or the exchange failed."""

    @property
    def live(self) -> bool:
        """True while this response is unfinished and its connection is still open."""
        return not self.finished and self._conn.current is self and not self._conn.closed

    # -- fed by the connection -----------------------------------------------------------

    def _head_done(self, status: int, headers: dict[str, str]) -> None:
        self.status = status
        self.headers = headers
        self.framed = ("content-length" in headers
                       or "chunked" in headers.get("transfer-encoding", "")
                       or status in (204, 304))
        if not self._head.done():
            self._head.set_result(None)

    def _body(self, body: bytes) -> None:
        if self._on_body is not None:
            self._on_body(body)
        else:
            self._early.append(body)

    def _finish(self, failure: str) -> None:
        """The exchange is over: complete ("") or failed; deliver or buffer the ending."""
        if self.finished:
            return
        self.finished = True
        if not self._head.done():
            kind = "timeout" if failure == "timeout" else "closed"
            self._head.set_exception(UpstreamError(kind, failure or "connection closed early"))
            # Nobody may await the head (the requester was cancelled): retrieve it here.
            self._head.exception()
            return
        if self._on_end is None:
            self._ended = failure
        else:
            self._deliver_end(failure)

    # -- used by the request's handler ---------------------------------------------------

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

    def _while_live(self, action: Callable[[], None]) -> Callable[[], None]:
        def guarded() -> None:
            if self.live:
                action()

        return guarded

    def aborter(self) -> Callable[[], None]:
        """A callable that drops the connection while this response is unfinished."""
        return self._while_live(self._conn.close)

    def pauser(self) -> Callable[[], None]:
        """A callable that pauses reading while this response is unfinished."""
        return self._while_live(self._conn.pause_reading)

    def resumer(self) -> Callable[[], None]:
        """A callable that resumes reading while this response is unfinished."""
        return self._while_live(self._conn.resume_reading)

    def close(self) -> None:
        """Drop the connection if it still carries this response (aborts it upstream)."""
        if self.live:
            self._conn.close()

    def _deliver_end(self, failure: str) -> None:
        on_end, self._on_end = self._on_end, None
        self._on_body = None
        if on_end is not None:
            on_end(failure)


class _Connection(asyncio.Protocol):
    """One keep-alive connection to an upstream; carries one `UpstreamResponse` at a time."""

    def __init__(self, client: UpstreamClient, target: _Target) -> None:
        self._client = client
        self.target = target
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.current: UpstreamResponse | None = None
        self._headers: dict[str, str] = {}
        self._paused = False
        self.idle_since_s = 0.0
        self.closed = False

    # -- transport -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = no_delay(transport)

    def data_received(self, data: bytes) -> None:
        exchange = self.current
        if exchange is None:
            # Bytes on an idle connection answer no request: the stream is out of step.
            self.close()
            return
        exchange.received_bytes += len(data)
        exchange.last_data_s = time.monotonic()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"malformed response from upstream: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        with contextlib.suppress(ValueError):
            self.target.idle.remove(self)
        exchange = self.current
        if exchange is not None:
            if not exchange.framed and exchange.status:
                self._settle("")
            else:
                self._fail("connection closed early" if exc is None else repr(exc))

    # -- httptools callbacks -----------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.current is None:
            # A second answer in the read that ended the first answers no request: stop
            # parsing (the parser error closes the connection) rather than pool it mid-way.
            raise _OutOfStep

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        if self.current is not None:
            self.current._head_done(self._parser.get_status_code(), self._headers)

    def on_body(self, body: bytes) -> None:
        if self.current is not None:
            self.current._body(body)

    def on_message_complete(self) -> None:
        self._settle("")

    # -- one exchange at a time ----------------------------------------------------------

    def send(self, request: bytes) -> UpstreamResponse:
        """Write a request and start its exchange; its head future is `exchange._head`."""
        assert self.current is None and self.transport is not None
        exchange = self.current = UpstreamResponse(self)
        self._headers = {}
        self.transport.write(request)
        return exchange

    def close(self) -> None:
        """Drop the connection (mid-response this aborts the request upstream)."""
        if self.transport is not None and not self.closed:
            self.transport.close()

    def pause_reading(self) -> None:
        """Stop reading the body (the client is slow)."""
        if self.transport is not None and not self.closed and not self._paused:
            self._paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        """Read the body again."""
        if self.transport is not None and not self.closed and self._paused:
            self._paused = False
            self.transport.resume_reading()

    def timed_out(self) -> None:
        """The upstream was silent too long mid-response."""
        self._fail("timeout")

    def _fail(self, reason: str) -> None:
        self._settle(reason)
        self.close()

    def _settle(self, failure: str) -> None:
        """Detach the current exchange, pool the connection if reusable, then tell it."""
        exchange, self.current = self.current, None
        if exchange is None:
            return
        keep = (failure == "" and not self.closed and exchange.framed
                and self._parser.should_keep_alive())
        self.resume_reading()
        self._client._settled(self, keep=keep)
        exchange._finish(failure)


class UpstreamClient:
    """Keep-alive HTTP/1.1 connections to the upstreams, one request per connection at a time."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float,
                 idle_keepalive_s: float = 4.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.idle_keepalive_s = idle_keepalive_s
        self._targets: dict[str, _Target] = {}
        self._busy: set[_Connection] = set()
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
            exchange = conn.send(head + body)
            try:
                return await self._head(conn, exchange)
            except UpstreamError as exc:
                # The server closed an idle connection as the request went out: retry once
                # on a new one. A response byte would mean the server took the request.
                if exc.kind != "closed" or exchange.received_bytes:
                    raise
        conn = await self._connect(target)
        return await self._head(conn, conn.send(head + body))

    def _reuse(self, target: _Target) -> _Connection | None:
        horizon_s = time.monotonic() - self.idle_keepalive_s
        while target.idle:
            conn = target.idle.pop()
            if not conn.closed and conn.current is None and conn.idle_since_s >= horizon_s:
                return conn
            conn.close()
        return None

    async def _connect(self, target: _Target) -> _Connection:
        loop = asyncio.get_running_loop()
        context = None
        if target.secure:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        try:
            _transport, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self, target), target.host,
                                       target.port, ssl=context),
                self.connect_timeout_s)
        except TimeoutError:
            raise UpstreamError("timeout", f"connect to {target.host_header} timed out "
                                f"after {self.connect_timeout_s:g} s") from None
        except OSError as exc:
            raise UpstreamError("connect", exc.strerror or repr(exc)) from None
        return conn

    async def _head(self, conn: _Connection, exchange: UpstreamResponse) -> UpstreamResponse:
        """Wait for the exchange's response head; a cancelled wait drops the connection."""
        if not exchange.finished:
            self._busy.add(conn)
        try:
            await exchange._head
        except BaseException:
            exchange.close()
            raise
        return exchange

    def _settled(self, conn: _Connection, keep: bool) -> None:
        self._busy.discard(conn)
        if keep:
            conn.idle_since_s = time.monotonic()
            conn.target.idle.append(conn)

    async def _sweep(self) -> None:
        """Time out silent responses; close idle connections past their keep-alive."""
        interval_s = min(1.0, self.read_timeout_s / 4)
        while True:
            await asyncio.sleep(interval_s)
            now_s = time.monotonic()
            for conn in list(self._busy):
                exchange = conn.current
                if conn.closed or exchange is None:
                    self._busy.discard(conn)
                elif now_s - exchange.last_data_s > self.read_timeout_s:
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
