"""Property tests of the upstream client's response framing (hypothesis): any valid response,
cut anywhere, reaches its exchange whole and leaves the connection reusable; bytes that
answer no request close the connection; any bytes end the exchange once, without raising."""

from __future__ import annotations

import asyncio
import itertools

from borrowd.adapters.proxy.upstream_http import (
    UpstreamClient,
    UpstreamResponse,
    _Connection,
    _Target,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


class _Transport:
    """Records what the client writes and whether it closed the connection."""

    def __init__(self) -> None:
        self.closed = False

    def write(self, _data: bytes) -> None:
        assert not self.closed, "write after close"

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        return None

    def resume_reading(self) -> None:
        return None

    def get_extra_info(self, _name: str, default: object = None) -> object:
        return default


class _Seen:
    """What one exchange delivered: status, body, endings, head failure."""

    def __init__(self, resp: UpstreamResponse) -> None:
        self.resp = resp
        self.body = bytearray()
        self.endings: list[str] = []
        resp.stream(self.body.extend, self.endings.append)

    @property
    def head_failed(self) -> bool:
        return resp_head_failed(self.resp)


def resp_head_failed(resp: UpstreamResponse) -> bool:
    """The exchange failed before its head (the requester would get an UpstreamError)."""
    head = resp._head
    return head.done() and head.exception() is not None


def _run(pieces: list[bytes], server_closes: bool) -> tuple[_Seen, _Transport, _Connection]:
    async def run() -> tuple[_Seen, _Transport, _Connection]:
        client = UpstreamClient(1.0, 5.0)
        conn = _Connection(client, _Target("http://upstream:8000"))
        transport = _Transport()
        conn.connection_made(transport)  # type: ignore[arg-type]
        seen = _Seen(conn.send(b"GET / HTTP/1.1\r\nHost: upstream:8000\r\n\r\n"))
        for piece in pieces:
            if transport.closed:
                break
            conn.data_received(piece)
        if server_closes or transport.closed:
            conn.connection_lost(None)
        return seen, transport, conn

    return asyncio.run(run())


def _cut(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


def _response(status: int, body: bytes, chunked: bool, sizes: list[int]) -> bytes:
    if not chunked:
        return b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n\r\n%b" % (status, len(body), body)
    framed, rest = b"", body
    for size in [*sizes, len(body)]:
        if rest:
            framed += b"%x\r\n%b\r\n" % (len(rest[:size]), rest[:size])
            rest = rest[size:]
    return b"HTTP/1.1 %d X\r\nTransfer-Encoding: chunked\r\n\r\n%b0\r\n\r\n" % (status, framed)


_valid = st.tuples(st.sampled_from([200, 404, 429, 500, 503]), st.binary(max_size=300),
                   st.booleans(), st.lists(st.integers(1, 50), max_size=5))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(response=_valid, cuts=st.lists(st.integers(0, 10_000), max_size=10))
def test_a_valid_response_cut_anywhere_arrives_whole(response: tuple, cuts: list[int]) -> None:
    """Status and body arrive intact whatever the reads look like, the exchange ends once,
    complete, and the connection goes back to the pool open."""
    status, body, chunked, sizes = response
    seen, transport, conn = _run(_cut(_response(status, body, chunked, sizes), cuts), False)
    assert (seen.resp.status, bytes(seen.body), seen.endings) == (status, body, [""])
    assert not transport.closed
    assert conn in conn.target.idle


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(response=_valid,
       extra=st.one_of(st.binary(min_size=1, max_size=200).filter(
                           lambda b: b[:1] not in (b"\r", b"\n")),  # blank lines are skipped
                       _valid.map(lambda r: _response(*r)),
                       _valid.map(lambda r: _response(*r)[:20])),
       cuts=st.lists(st.integers(0, 10_000), max_size=6))
def test_bytes_after_the_response_close_the_connection(response: tuple, extra: bytes,
                                                       cuts: list[int]) -> None:
    """Bytes after a complete response (a second answer, whole or begun, or garbage) answer
    no request: the response still arrives whole, and the connection, out of step, is
    closed and not reused (a pooled connection mid-way through a stray answer would hand it
    to the next request)."""
    status, body, chunked, sizes = response
    wire = _response(status, body, chunked, sizes) + extra
    seen, transport, conn = _run(_cut(wire, cuts), False)
    assert (seen.resp.status, bytes(seen.body), seen.endings) == (status, body, [""])
    assert transport.closed
    assert conn not in conn.target.idle


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prefix=st.sampled_from([b"", b"HTTP/1.1 200 OK\r\n",
                               b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nab",
                               b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"]),
       noise=st.binary(max_size=300), cuts=st.lists(st.integers(0, 10_000), max_size=6),
       server_closes=st.booleans())
def test_any_bytes_end_the_exchange_once_without_raising(prefix: bytes, noise: bytes,
                                                         cuts: list[int],
                                                         server_closes: bool) -> None:
    """Whatever the upstream sends, nothing raises into the event loop, the exchange ends at
    most once (or fails before its head), and a connection is pooled only after a whole
    response."""
    seen, _transport, conn = _run(_cut(prefix + noise, cuts), server_closes)
    assert len(seen.endings) <= 1
    if server_closes:
        assert seen.endings or seen.head_failed
    if conn in conn.target.idle:
        assert seen.endings == [""]
