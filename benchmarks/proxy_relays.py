"""Bare streaming relays built from HTTP libraries, for `bench_proxy.py --relays`.

Each relay forwards POST /v1/chat/completions to one upstream and streams the answer back
chunk by chunk, with nothing else (no auth, no tally, no metrics): the least any proxy
built on that server and that client can add. Servers: `uvicorn` (httptools protocol on
uvloop, bare ASGI app), `granian` (ASGI, uvloop, one worker), `http1` (borrowd's own
`adapters.proxy.http1`). Clients: `httpx` (httpx2/httpcore2 pooled client), `aiohttp`
(its TCPConnector pool), `borrowd` (`adapters.proxy.upstream_http`).

    python3 benchmarks/proxy_relays.py --server uvicorn --client httpx --port P --upstream URL
    (granian imports `benchmarks.proxy_relays:app` and reads RELAY_CLIENT, RELAY_UPSTREAM)

uvicorn, granian and httpx are not borrowd dependencies: `pip install uvicorn granian` first
(httpx comes with the openai SDK of the dev extras).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PATH = "/v1/chat/completions"
_END = b""


class _Relay:
    """One pooled upstream client, opened on first use; `chunks()` streams one request."""

    def __init__(self, client: str, upstream: str) -> None:
        self.kind = client
        self.upstream = upstream.rstrip("/")
        self._client: Any = None

    def _open(self) -> Any:
        if self.kind == "httpx":
            import httpx2
            return httpx2.AsyncClient(timeout=None, limits=httpx2.Limits(
                max_connections=None, max_keepalive_connections=2048))
        if self.kind == "aiohttp":
            import aiohttp
            return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        from borrowd.adapters.proxy.upstream_http import UpstreamClient
        return UpstreamClient(5.0, 600.0)

    async def chunks(self, body: bytes) -> AsyncIterator[bytes]:
        """The upstream's response body, chunk by chunk."""
        if self._client is None:
            self._client = self._open()
        headers = {"Content-Type": "application/json"}
        if self.kind == "httpx":
            async with self._client.stream("POST", self.upstream + PATH, content=body,
                                           headers=headers) as resp:
                async for chunk in resp.aiter_raw():
                    yield chunk
        elif self.kind == "aiohttp":
            async with self._client.post(self.upstream + PATH, data=body,
                                         headers=headers) as resp:
                async for chunk in resp.content.iter_any():
                    yield chunk
        else:
            resp = await self._client.request(self.upstream, "POST", PATH, headers, body)
            queue: asyncio.Queue[bytes] = asyncio.Queue()
            resp.stream(queue.put_nowait, lambda _failure: queue.put_nowait(_END))
            while (chunk := await queue.get()) != _END:
                yield chunk


def make_app(relay: _Relay) -> Callable[..., Awaitable[None]]:
    """A bare ASGI app relaying every request to the upstream."""

    async def app(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        parts = []
        while True:
            message = await receive()
            parts.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        async for chunk in relay.chunks(b"".join(parts)):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


app = make_app(_Relay(os.environ.get("RELAY_CLIENT", "httpx"),
                      os.environ.get("RELAY_UPSTREAM", "http://127.0.0.1:1")))
"""The ASGI app granian imports (configured by RELAY_CLIENT and RELAY_UPSTREAM)."""


async def _serve_http1(relay: _Relay, port: int) -> None:
    from borrowd.adapters.proxy.http1 import HttpRequest, HttpServer, Responder

    async def pump(request: HttpRequest, out: Responder) -> None:
        out.start_stream(200, {"Content-Type": "text/event-stream"})
        async for chunk in relay.chunks(request.body):
            out.write(chunk)
        out.end()

    async def handle(request: HttpRequest, out: Responder) -> None:
        # http1 starts handlers eagerly, outside any task; httpx (sniffio) needs one.
        await asyncio.create_task(pump(request, out))

    server = HttpServer(handle, 4 * 1024 * 1024)
    await server.start("127.0.0.1", port)
    await asyncio.Event().wait()


def main() -> int:
    """Serve one relay until killed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", choices=("uvicorn", "http1"), required=True)
    parser.add_argument("--client", choices=("httpx", "aiohttp", "borrowd"), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    relay = _Relay(args.client, args.upstream)
    if args.server == "http1":
        import uvloop
        uvloop.run(_serve_http1(relay, args.port))
        return 0
    import uvicorn
    uvicorn.run(make_app(relay), host="127.0.0.1", port=args.port, loop="uvloop",
                http="httptools", lifespan="off", log_level="warning", access_log=False,
                backlog=1024)
    return 0


if __name__ == "__main__":
    sys.exit(main())
