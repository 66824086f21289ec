"""Property tests of the proxy's HTTP/1.1 request framing (hypothesis), as h11 and uvicorn
fuzz theirs: any valid pipeline of requests, cut anywhere, is answered request by request
in order; any byte string gets well-formed responses only, and an error closes."""

from __future__ import annotations

import asyncio
import itertools

import httptools
from borrowd.adapters.proxy.http1 import (
    HttpRequest,
    HttpServer,
    Responder,
    ServerLimits,
    _Connection,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MAX_BODY = 256


class _Transport:
    """Collects what the server writes; records a half-close (lingering) or a close."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.closed = False
        self.eof = False

    def write(self, data: bytes) -> None:
        assert not (self.closed or self.eof), "write after close"
        self.out += data

    def close(self) -> None:
        self.closed = True

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    @property
    def done(self) -> bool:
        """The server has finished with this connection (closed or lingering)."""
        return self.closed or self.eof

    def get_extra_info(self, _name: str, default: object = None) -> object:
        return default


async def _echo(request: HttpRequest, out: Responder) -> None:
    if request.too_large:
        out.respond(413, b"{}")
    elif request.path == "/stream":
        out.start_stream(200, {"Content-Type": "text/plain"})
        out.write(request.body)
        out.end()
    else:
        out.respond(200, request.method.encode() + b" " + request.body)


def _feed(pieces: list[bytes]) -> _Transport:
    """Feed `pieces` to one server connection, letting handlers run between pieces."""
    async def run() -> _Transport:
        server = HttpServer(_echo, MAX_BODY, ServerLimits(max_header_bytes=512, max_headers=8))
        conn = _Connection(server)
        transport = _Transport()
        conn.connection_made(transport)  # type: ignore[arg-type]
        for piece in pieces:
            if transport.done:
                break
            conn.data_received(piece)
            for _ in range(100):  # each pipelined answer takes a loop turn or two
                if conn.idle or transport.done:
                    break
                await asyncio.sleep(0)
        if not transport.closed:
            conn.connection_lost(None)
        return transport

    return asyncio.run(run())


class _Responses:
    """httptools response parser callbacks: status and body of each response."""

    def __init__(self) -> None:
        self.parsed: list[tuple[int, bytes]] = []
        self._body = b""
        self.parser = httptools.HttpResponseParser(self)

    def on_message_begin(self) -> None:
        self._body = b""

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        self.parsed.append((self.parser.get_status_code(), self._body))


def _parse(out: bytes) -> list[tuple[int, bytes]]:
    responses = _Responses()
    responses.parser.feed_data(out)
    return responses.parsed


_body = st.binary(max_size=MAX_BODY)
_request = st.tuples(st.sampled_from(["POST", "PUT"]), st.sampled_from(["/", "/stream"]),
                     _body, st.booleans(), st.lists(st.integers(1, 64), max_size=4))


def _encode(method: str, path: str, body: bytes, chunked: bool, sizes: list[int]) -> bytes:
    if not chunked:
        return (f"{method} {path} HTTP/1.1\r\nHost: h\r\nContent-Length: {len(body)}\r\n\r\n"
                .encode() + body)
    chunks, rest = [], body
    for size in sizes:
        if rest:
            chunks.append(rest[:size])
            rest = rest[size:]
    if rest:
        chunks.append(rest)
    framed = b"".join(b"%x\r\n%b\r\n" % (len(c), c) for c in chunks)
    return (f"{method} {path} HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
            .encode() + framed + b"0\r\n\r\n")


def _cut(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(_request, min_size=1, max_size=4),
       cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_a_valid_pipeline_cut_anywhere_is_answered_in_order(requests: list, cuts: list[int]
                                                            ) -> None:
    """Every request of a pipeline, framed by length or by chunks and delivered in arbitrary
    pieces, gets its own answer, in order, on the same open connection."""
    wire = b"".join(_encode(*r) for r in requests)
    transport = _feed(_cut(wire, cuts))
    answers = _parse(bytes(transport.out))
    expected = [(200, body if path == "/stream" else method.encode() + b" " + body)
                for method, path, body, _chunked, _sizes in requests]
    assert answers == expected


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prefix=st.sampled_from([b"", b"POST / HTTP/1.1\r\n", b"GET / HTTP/1.1\r\nHost: h\r\n",
                               b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
                               b"POST / HTTP/1.1\r\nContent-Length: 3\r\n\r\nab"]),
       noise=st.binary(max_size=600), cuts=st.lists(st.integers(0, 10_000), max_size=6))
def test_any_bytes_get_well_formed_answers_and_errors_close(prefix: bytes, noise: bytes,
                                                           cuts: list[int]) -> None:
    """Arbitrary bytes never crash the connection: what it writes parses as whole HTTP
    responses, and once it answers an error (4xx/5xx) it closes."""
    transport = _feed(_cut(prefix + noise, cuts))
    answers = _parse(bytes(transport.out))
    for index, (status, _body) in enumerate(answers):
        if status >= 400:
            assert index == len(answers) - 1
            assert transport.done
