"""The proxy's client-facing HTTP/1.1 server: asyncio protocols with httptools' C parser.

A streamed chunk must cost the proxy as little as possible: an engine step releases one
chunk per running stream at once, and the last of 200 waits for the 199 before it. Through
aiohttp each chunk woke a handler task and ran its response writer (~50-70 us). Here the
upstream's data callback writes the chunk straight to the client's transport (`Responder.
write`, chunked framing in one `transport.write`), with no task switch per chunk. Requests
are parsed by httptools; each runs one handler task; pipelined requests on a connection
are answered in order; a client that disconnects cancels its handler.

What a client may hold is bounded as uvicorn, h11 and nginx bound it (`ServerLimits`): the
request line and headers by size (431) and count (431); the body by size, declared or
streamed (413 at once, before any body arrives); the time to send the headers, the body,
and the time a keep-alive connection may sit idle (slowloris); and the open connections (an
idle one is closed to make room, else the newcomer gets 503). Only `chunked` is accepted as
a Transfer-Encoding (others get 501); an HTTP/1.0 client gets a stream unframed, ended by
closing the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import logging
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, cast

import httptools
from borrowd.adapters.proxy.openai import error_body

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerLimits:
    """What one client connection may hold; defaults follow uvicorn, h11 and nginx."""

    max_header_bytes: int = 65_536
    """Request line plus headers, bytes (more: 431)."""
    max_headers: int = 100
    """Header fields per request (more: 431)."""
    header_timeout_s: float = 10.0
    """From a request's first byte to the end of its headers (slower: 408, closed)."""
    body_timeout_s: float = 60.0
    """From the end of the headers to the end of the body (slower: 408, closed)."""
    idle_timeout_s: float = 60.0
    """How long a keep-alive connection may wait for its next request."""
    max_connections: int = 1024
    """Open client connections; past it idle ones are closed, else the newcomer gets 503."""


LINGER_S = 2.0
"""How long a refused client may go on sending (dropped) before the connection closes."""


class _StopReading(Exception):
    """Read no more from this connection: its handler answers and closes it."""


class _Refusal(Exception):
    """A request the server answers itself (status, message), then closes."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class HttpRequest:
    """One parsed request; header names are lower case."""

    method: str
    path: str
    query: str
    headers: Mapping[str, str]
    body: bytes
    too_large: bool = False


Handler = Callable[[HttpRequest, "Responder"], Awaitable[None]]


class _DateCache:
    """The `Date` header value, formatted at most once a second."""

    def __init__(self) -> None:
        self._second = -1
        self._value = b""

    def value(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._value = email.utils.formatdate(now, usegmt=True).encode()
        return self._value


_DATE = _DateCache()
_REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}


def no_delay(transport: asyncio.BaseTransport) -> asyncio.Transport:
    """Turn Nagle off on a TCP transport (a chunk must leave at once); return it typed."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return cast(asyncio.Transport, transport)  # uvloop's transports are no subclass


def response_head(status: int, headers: Mapping[str, str], *, keep_alive: bool,
                  content_length: int | None, chunked: bool = True) -> bytes:
    """Status line and headers of a response; chunked when `content_length` is None (unless
    `chunked` is False: an HTTP/1.0 body that ends when the connection closes)."""
    lines = [b"HTTP/1.1 %d %s" % (status, _REASONS.get(status, b"Unknown")),
             b"Date: " + _DATE.value(), b"Server: borrowd"]
    lines.extend(f"{name}: {value}".encode("latin-1") for name, value in headers.items())
    if content_length is None:
        if chunked:
            lines.append(b"Transfer-Encoding: chunked")
    else:
        lines.append(b"Content-Length: %d" % content_length)
    if not keep_alive:
        lines.append(b"Connection: close")
    lines.append(b"\r\n")
    return b"\r\n".join(lines)


class Responder:
    """Writes the response to one request and reports the client's state to its handler.

    A handler calls `respond` once, or `start_stream`, any number of `write`s, then `end`.
    `on_flow(pause, resume)` registers callbacks for the client's write buffer crossing its
    high and low marks, so a stream's upstream can stop reading while the client is slow.
    """

    __slots__ = ("_conn", "_flow", "_framed", "finished", "keep_alive", "started")

    def __init__(self, conn: _Connection, keep_alive: bool, framed: bool = True) -> None:
        self._conn = conn
        self.keep_alive = keep_alive
        self._framed = framed
        """False for an HTTP/1.0 client: no chunked framing, the stream ends by closing."""
        self.started = False
        self.finished = False
        self._flow: tuple[Callable[[], None], Callable[[], None]] | None = None

    @property
    def closed(self) -> bool:
        """The client has gone (writes are dropped)."""
        return self._conn.closed

    def respond(self, status: int, body: bytes, *, content_type: str = "application/json",
                headers: Mapping[str, str] | None = None) -> None:
        """Send a whole response."""
        all_headers = {"Content-Type": content_type, **(headers or {})}
        self.started = self.finished = True
        self._conn.write(response_head(status, all_headers, keep_alive=self.keep_alive,
                                       content_length=len(body)) + body)

    def start_stream(self, status: int, headers: Mapping[str, str]) -> None:
        """Send the head of a chunked response (unframed to an HTTP/1.0 client)."""
        self.started = True
        if self._framed:
            self._conn.write(response_head(status, headers, keep_alive=self.keep_alive,
                                           content_length=None))
        else:
            self.keep_alive = False
            self._conn.write(response_head(status, headers, keep_alive=False,
                                           content_length=None, chunked=False))

    def write(self, data: bytes) -> None:
        """Send `data` as one chunk of a started stream (empty data is skipped)."""
        if data:
            if self._framed:
                self._conn.write(b"%x\r\n%b\r\n" % (len(data), data))
            else:
                self._conn.write(data)

    def end(self) -> None:
        """End a started stream."""
        if not self.finished:
            self.finished = True
            if self._framed:
                self._conn.write(b"0\r\n\r\n")

    def on_flow(self, pause: Callable[[], None], resume: Callable[[], None]) -> None:
        """Call `pause` when the client's write buffer is full, `resume` when it drains."""
        self._flow = (pause, resume)
        if self._conn.writing_paused:
            pause()

    def _pause(self) -> None:
        if self._flow is not None:
            self._flow[0]()

    def _resume(self) -> None:
        if self._flow is not None:
            self._flow[1]()


class _Connection(asyncio.Protocol):
    """One client connection: parse requests, run their handler tasks one at a time.

    `reading` is where the parser stands ("" between requests, "head", "body") and
    `since_s` when it got there, or when the connection last went idle: the server's
    sweeper closes a connection that stays in one of them past its limit.
    """

    def __init__(self, server: HttpServer) -> None:
        self._server = server
        self._limits = server.limits
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self.closed = False
        self._closing = False
        self._eof_sent = False
        self.writing_paused = False
        self._pending: deque[tuple[HttpRequest, bool, bool]] = deque()
        self._task: asyncio.Task | None = None
        self._responder: Responder | None = None
        self.reading = ""
        self.since_s = time.monotonic()
        self._url = b""
        self._headers: dict[str, str] = {}
        self._header_bytes = 0
        self._header_count = 0
        self._head_fresh = True
        self._head_bytes_read = 0
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._discarding = False

    @property
    def idle(self) -> bool:
        """No request in progress: nothing being read, handled or waiting."""
        return (not self.reading and not self._pending
                and (self._task is None or self._task.done()))

    # -- transport -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = no_delay(transport)
        if not self._server.admit(self):
            # No lingering here: a refused connection is not counted, so it must not stay.
            self._refuse(503, "too many connections; retry shortly", retry_after_s=1,
                         linger=False)
            return
        self._server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._server.connections.discard(self)
        self._pending.clear()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self.writing_paused and self._responder is not None:
            self.writing_paused = False
            self._responder._resume()

    def pause_writing(self) -> None:
        self.writing_paused = True
        if self._responder is not None:
            self._responder._pause()

    def resume_writing(self) -> None:
        self.writing_paused = False
        if self._responder is not None:
            self._responder._resume()

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            return
        try:
            self._parser.feed_data(data)
            if self.reading == "head":
                self._count_unfinished_head(len(data))
        except httptools.HttpParserCallbackError as exc:
            refusal = exc.__context__
            if isinstance(refusal, _Refusal):
                self._refuse(refusal.status, str(refusal))
            elif not isinstance(refusal, _StopReading):
                raise
        except _Refusal as refusal:
            self._refuse(refusal.status, str(refusal))
        except httptools.HttpParserUpgrade:
            self._refuse(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            self._refuse(400, f"malformed HTTP request: {exc}")

    def write(self, data: bytes) -> None:
        """Write to the client unless it has gone (or was half-closed by `linger`)."""
        if not self.closed and self._transport is not None and not self._eof_sent:
            self._transport.write(data)

    def close(self) -> None:
        """Close the connection (a handler's task, if any, is cancelled)."""
        self._closing = True
        if self._transport is not None and not self.closed:
            self._transport.close()

    def linger(self) -> None:
        """Close once the client has had the answer: half-close, read and drop what it still
        sends for up to `LINGER_S`, then close (as nginx's lingering close). Closing with
        unread bytes would make the kernel reset the connection, and the client could lose
        the 413 or 431 it is owed."""
        self._closing = True
        self._discarding = True
        transport = self._transport
        if transport is None or self.closed or not transport.can_write_eof():
            self.close()
            return
        transport.write_eof()
        self._eof_sent = True
        asyncio.get_running_loop().call_later(LINGER_S, self.close)

    def _refuse(self, status: int, message: str, retry_after_s: int | None = None,
                linger: bool = True) -> None:
        """Answer a request the server will not hand on, then close (lingering)."""
        self._discarding = True
        if self._task is None or self._task.done():
            body = error_body(status, message, kind="invalid_request_error")
            headers = {"Content-Type": "application/json"}
            if retry_after_s is not None:
                headers["Retry-After"] = str(retry_after_s)
            self.write(response_head(status, headers, keep_alive=False,
                                     content_length=len(body)) + body)
        if linger and (self._task is None or self._task.done()):
            self.linger()
        else:
            self.close()

    def expire(self, now_s: float) -> None:
        """Close the connection if it sat past a limit: idle, or slow to send its request."""
        if self._closing:
            return  # already answered and closing (or lingering)
        limits = self._limits
        if self.reading == "head" and now_s - self.since_s > limits.header_timeout_s:
            self._refuse(408, f"request headers not received within "
                              f"{limits.header_timeout_s:g} s")
        elif self.reading == "body" and now_s - self.since_s > limits.body_timeout_s:
            self._refuse(408, f"request body not received within {limits.body_timeout_s:g} s")
        elif self.idle and now_s - self.since_s > limits.idle_timeout_s:
            self.close()

    # -- httptools callbacks -----------------------------------------------------------

    def on_message_begin(self) -> None:
        self.reading = "head"
        self.since_s = time.monotonic()
        self._head_fresh = True
        self._head_bytes_read = 0
        self._url = b""
        self._headers = {}
        self._header_bytes = 0
        self._header_count = 0
        self._body = []
        self._body_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_header_bytes(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self._limits.max_headers:
            raise _Refusal(431, f"more than {self._limits.max_headers} header fields")
        self._count_header_bytes(len(name) + len(value) + 4)
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        previous = self._headers.get(key)
        self._headers[key] = text if previous is None else f"{previous}, {text}"

    def _count_unfinished_head(self, size: int) -> None:
        """Bound a head still arriving: httptools hands a header over only once its value
        has ended, buffering it until then, so a never-ending header line is counted here.
        The read a head began in is not counted (part of it may be the previous request);
        a head is refused past `max_header_bytes` plus one read."""
        if self._head_fresh:
            self._head_fresh = False
            return
        self._head_bytes_read += size
        if self._head_bytes_read > self._limits.max_header_bytes:
            raise _Refusal(431, f"request line and headers exceed "
                                f"{self._limits.max_header_bytes} bytes")

    def _count_header_bytes(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > self._limits.max_header_bytes:
            raise _Refusal(431, f"request line and headers exceed "
                                f"{self._limits.max_header_bytes} bytes")

    def on_headers_complete(self) -> None:
        self.reading = "body"
        self.since_s = time.monotonic()
        coding = self._headers.get("transfer-encoding")
        if coding is not None and coding.strip().lower() != "chunked":
            raise _Refusal(501, f"Transfer-Encoding {coding!r} is not supported "
                                "(only chunked)")
        length = self._headers.get("content-length", "")
        if length.isdigit() and int(length) > self._server.max_body_bytes:
            self._oversized()
        elif self._headers.get("expect", "").lower() == "100-continue":
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self._server.max_body_bytes:
            self._oversized()
        else:
            self._body.append(body)

    def _oversized(self) -> None:
        """Hand the request on at once, flagged too large and without its body, and read no
        more from this connection: a declared 10 GB body is answered before it arrives."""
        self._discarding = True
        self._body = []
        self._complete(too_large=True)
        raise _StopReading

    def on_message_complete(self) -> None:
        self._complete(too_large=False)

    def _complete(self, too_large: bool) -> None:
        self.reading = ""
        url = httptools.parse_url(self._url) if self._url else None
        request = HttpRequest(
            method=self._parser.get_method().decode("latin-1"),
            path=url.path.decode("latin-1") if url and url.path else "/",
            query=url.query.decode("latin-1") if url and url.query else "",
            headers=self._headers, body=b"".join(self._body), too_large=too_large)
        keep_alive = self._parser.should_keep_alive() and not too_large
        framed = self._parser.get_http_version() != "1.0"
        self._pending.append((request, keep_alive, framed))
        if self._task is None:
            self._next()

    # -- handlers ----------------------------------------------------------------------

    def _next(self) -> None:
        self._task = None
        self._responder = None
        if self.closed or self._closing or not self._pending:
            self.since_s = time.monotonic()
            return
        request, keep_alive, framed = self._pending.popleft()
        responder = Responder(self, keep_alive, framed)
        self._responder = responder
        task = self._task = start_eagerly(self._run(request, responder))
        task.add_done_callback(self._answered)

    def _answered(self, task: asyncio.Task) -> None:
        """The handler of the current request ended: go on with a pipelined one, if any."""
        if task is self._task:
            self._next()

    async def _run(self, request: HttpRequest, responder: Responder) -> None:
        try:
            await self._server.handler(request, responder)
        except asyncio.CancelledError:
            self.close()
            return
        except Exception:
            log.exception("handler failed on %s %s", request.method, request.path)
            if not responder.started:
                responder.keep_alive = False
                responder.respond(500, error_body(500, "internal proxy error",
                                                  kind="internal_error"))
            self.close()
            return
        if not responder.finished:
            log.error("handler left %s %s unanswered", request.method, request.path)
            self.close()
            return
        if not responder.keep_alive:
            if self._discarding:
                self.linger()  # the client may still be sending the body it was refused
            else:
                self.close()


def start_eagerly(coro: Coroutine[Any, Any, None]) -> asyncio.Task:
    """Run `coro` at once up to its first suspension, then on as a task (what Python 3.12's
    eager task factory does).

    A request's handler then writes its upstream request from the callback that parsed it,
    instead of after every other ready callback of this loop iteration: during a burst of
    streamed chunks that wait was most of the proxy's added TTFT. The returned task carries
    the rest; cancelling it cancels what the coroutine waits on, as for any task.
    """
    try:
        blocked_on = coro.send(None)
    except StopIteration:
        blocked_on = _FINISHED
    except BaseException as exc:  # surfaces as the task's exception, as in a task
        blocked_on = exc
    return asyncio.get_running_loop().create_task(_drive(coro, blocked_on))


_FINISHED = object()


async def _drive(coro: Coroutine[Any, Any, None], blocked_on: Any) -> None:
    """Step `coro` each time what it yielded (a future, or None for a bare yield) is done."""
    if blocked_on is _FINISHED:
        return
    if isinstance(blocked_on, BaseException):
        raise blocked_on
    while True:
        cancelled = False
        try:
            if blocked_on is None:
                await asyncio.sleep(0)
            else:
                # Hand the future over as a task step does; awaiting it again needs this.
                blocked_on._asyncio_future_blocking = False
                await blocked_on
        except asyncio.CancelledError:
            # A cancelled future raises inside `coro` when it resumes; otherwise (a bare
            # yield, or the future was already done) the cancellation is thrown in.
            cancelled = not (isinstance(blocked_on, asyncio.Future) and blocked_on.cancelled())
        except Exception:
            pass  # the future failed: its exception is raised inside `coro` when it resumes
        try:
            blocked_on = coro.throw(asyncio.CancelledError()) if cancelled else coro.send(None)
        except StopIteration:
            return


class HttpServer:
    """A listening HTTP/1.1 server; `cleanup()` stops it."""

    def __init__(self, handler: Handler, max_body_bytes: int,
                 limits: ServerLimits = ServerLimits()) -> None:
        self.handler = handler
        self.max_body_bytes = max_body_bytes
        self.limits = limits
        self.connections: set[_Connection] = set()
        self._server: asyncio.base_events.Server | None = None
        self._sweeper: asyncio.Task | None = None

    def admit(self, conn: _Connection) -> bool:
        """Make room for a new connection: past the cap close the longest-idle one; False
        when every connection is busy."""
        if len(self.connections) < self.limits.max_connections:
            return True
        idle = [c for c in self.connections if c.idle]
        if not idle:
            log.warning("connection refused: %d open, none idle", len(self.connections))
            return False
        oldest = min(idle, key=lambda c: c.since_s)
        self.connections.discard(oldest)
        oldest.close()
        return True

    async def start(self, host: str, port: int, backlog: int = 1024) -> None:
        """Listen on host:port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port,
                                                backlog=backlog, reuse_address=True)
        self._sweeper = loop.create_task(self._sweep())

    async def _sweep(self) -> None:
        """Close connections past their header, body or idle time limit."""
        limits = self.limits
        interval_s = min(1.0, limits.header_timeout_s / 4, limits.body_timeout_s / 4,
                         limits.idle_timeout_s / 4)
        while True:
            await asyncio.sleep(interval_s)
            now_s = time.monotonic()
            for conn in list(self.connections):
                try:
                    conn.expire(now_s)
                except Exception:  # one connection must never stop the sweeper
                    log.exception("expiring a connection failed")
                    conn.close()

    def stop_listening(self) -> None:
        """Accept no new connections (those open keep being served)."""
        if self._server is not None:
            self._server.close()

    async def cleanup(self, shutdown_timeout_s: float = 5.0) -> None:
        """Stop listening, give running handlers `shutdown_timeout_s`, then close every
        connection (which cancels what still runs)."""
        self.stop_listening()
        if self._sweeper is not None:
            self._sweeper.cancel()
        tasks = [c._task for c in self.connections if c._task is not None and not c._task.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=shutdown_timeout_s)
        for conn in list(self.connections):
            conn.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
