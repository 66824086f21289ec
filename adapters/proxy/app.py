"""The proxy's aiohttp application: authenticate, classify, admit, forward, measure, revoke.

Per request: API key -> tenant -> class (a header may demote to batch, never promote);
body validated (400 names the field); batch requests pass the gate (429/503 when denied)
and get `max_tokens` clamped to the budget's output cap; the body is forwarded with
vLLM's `priority` injected to the upstream with the fewest outstanding requests, over one
shared keep-alive `ClientSession`. Streams are relayed event by event; a revoked batch
stream ends with a `preempted` chunk carrying its text and usage so far. Batch requests are
always streamed from the upstream (a non-streaming batch client gets the response assembled
by the proxy), so they too can be revoked resumably. Interactive non-streaming requests are
passed through unchanged (no TTFT is observable for them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from adapters.proxy.admission import BatchAdmitter, GateLike
from adapters.proxy.config import ProxyConfig, RequestClass, Tenant
from adapters.proxy.metrics import ProxyMetrics
from adapters.proxy.openai import (
    CompletionRequest,
    Endpoint,
    FieldError,
    error_body,
    parse_completion_request,
    rewrite_body,
)
from adapters.proxy.revocation import BatchRegistry, BatchStream, renew_leases, watch_revocations
from adapters.proxy.sse import StreamTally, event_data, split_events
from adapters.proxy.upstreams import Upstream, UpstreamPool

log = logging.getLogger(__name__)

CLASS_HEADER = "X-Borrowd-Class"
"""Request header that lets a client demote its request to batch (never promote)."""
MAX_WAIT_HEADER = "X-Borrowd-Max-Wait-S"
"""Request header: how long a batch request may wait in the admission queue, seconds."""

INTERACTIVE = RequestClass.INTERACTIVE.value
BATCH = RequestClass.BATCH.value


@dataclass(slots=True)
class Exchange:
    """One proxied generation request as it progresses (mutable, per request)."""

    request_id: str
    request_class: str
    arrived_s: float
    request: CompletionRequest
    requested_max_tokens: int | None
    outcome: str = "error"
    output_tokens: int = 0
    prompt_tokens: int = 0
    tally: StreamTally | None = None


class UpstreamFailure(Exception):
    """No upstream answered; carries the HTTP status and outcome to report."""

    def __init__(self, status: int, outcome: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.outcome = outcome


class ProxyServer:
    """State of one proxy: config, metrics, upstream pool, gate and in-flight batch work."""

    def __init__(self, config: ProxyConfig, gate: GateLike,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.gate = gate
        self.clock = clock
        self.registry = CollectorRegistry()
        self.metrics = ProxyMetrics(config.pool, self.registry, clock)
        self.upstreams = UpstreamPool(config.upstreams)
        self.admitter = BatchAdmitter(gate, config.admission, clock)
        self.batch = BatchRegistry()
        self.session: aiohttp.ClientSession | None = None
        self._background: list[asyncio.Task] = []
        self._stopped = asyncio.Event()
        self._pending: set[asyncio.Task] = set()

    # -- application -------------------------------------------------------------------

    def build_app(self) -> web.Application:
        """The aiohttp application (start it with handler cancellation on)."""
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app: web.Application) -> None:
        cfg = self.config
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60.0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=cfg.upstream_connect_timeout_s,
                                          sock_read=cfg.upstream_read_timeout_s),
            auto_decompress=False,
        )
        self._background = [
            asyncio.create_task(watch_revocations(self.gate, self.batch, self._revoked,
                                                  self._stopped)),
            asyncio.create_task(renew_leases(self.gate, self.batch,
                                             cfg.admission.lease_ms / 3000.0, self._stopped)),
        ]

    async def _stop(self, _app: web.Application) -> None:
        self._stopped.set()
        for task in self._background:
            task.cancel()
        # A Redis call being cancelled may not return promptly (redis-py reconnect logic);
        # never let that hold the shutdown.
        await asyncio.wait(self._background, timeout=1.0)
        if self._pending:
            await asyncio.wait(self._pending, timeout=self.config.admission.gate_timeout_s * 2)
        if self.session is not None:
            await self.session.close()

    def _revoked(self, request_id: str) -> None:
        log.info("revoked batch request %s", request_id)

    # -- helpers -----------------------------------------------------------------------

    def _tenant(self, request: web.Request) -> Tenant | None:
        header = request.headers.get("Authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            return None
        return self.config.tenants_by_key.get(key.strip())

    def _upstream_headers(self, request_id: str) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        if self.config.upstream_api_key:
            headers["Authorization"] = f"Bearer {self.config.upstream_api_key}"
        return headers

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _release(self, request_id: str, output_tokens: int) -> None:
        try:
            await asyncio.wait_for(self.gate.release(request_id, output_tokens),
                                   self.config.admission.gate_timeout_s * 4)
        except Exception as exc:  # the lease returns the capacity if this fails
            log.warning("release of %s failed (its lease will expire): %r", request_id, exc)

    # -- handlers ----------------------------------------------------------------------

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _models(self, request: web.Request) -> web.Response:
        if self._tenant(request) is None:
            return _error(401, "missing or unknown API key (Authorization: Bearer KEY)",
                          "authentication_error")
        assert self.session is not None
        upstream = self.upstreams.candidates()[0]
        try:
            async with self.session.get(upstream.base_url + "/v1/models",
                                        headers=self._upstream_headers("models")) as resp:
                body = await resp.read()
                if resp.status >= 500:
                    return _error(502, f"upstream {upstream.base_url} answered {resp.status}",
                                  "upstream_error")
                return web.Response(status=resp.status, body=body,
                                    content_type="application/json")
        except (TimeoutError, aiohttp.ClientError) as exc:
            return _error(502, f"upstream {upstream.base_url} unreachable: {exc!r}",
                          "upstream_error")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.CHAT)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.COMPLETIONS)

    async def _generate(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        arrived_s = self.clock()
        tenant = self._tenant(request)
        if tenant is None:
            return _error(401, "missing or unknown API key (Authorization: Bearer KEY)",
                          "authentication_error")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"request body exceeds {self.config.max_body_bytes} bytes",
                          "invalid_request_error", field="body")
        try:
            req = parse_completion_request(raw, endpoint)
            request_class = _request_class(tenant, request.headers.get(CLASS_HEADER))
        except FieldError as exc:
            return _error(400, str(exc), "invalid_request_error", field=exc.field)
        ex = Exchange(request_id=f"borrowd-{uuid.uuid4().hex}", request_class=request_class,
                      arrived_s=arrived_s, request=req, requested_max_tokens=req.max_tokens,
                      prompt_tokens=req.prompt_tokens)
        if request_class == INTERACTIVE:
            return await self._forward(request, ex, req.max_tokens, None)
        return await self._batch(request, ex)

    async def _batch(self, request: web.Request, ex: Exchange) -> web.StreamResponse:
        req = ex.request
        if req.n != 1:
            return _error(400, "n: batch requests take n = 1 (send one request per sequence)",
                          "invalid_request_error", field="n")
        try:
            max_wait_s = _max_wait_s(request.headers.get(MAX_WAIT_HEADER))
        except FieldError as exc:
            return _error(400, str(exc), "invalid_request_error", field=exc.field)
        requested = req.max_tokens or self.config.admission.default_batch_max_tokens
        try:
            decision = await self.admitter.admit(ex.request_id, req.prompt_tokens, requested,
                                                 max_wait_s)
        except asyncio.CancelledError:
            self.metrics.finished(BATCH, "client_disconnect", 0, 0)
            raise
        self.metrics.queue[BATCH].observe(decision.waited_s)
        if not decision.admitted:
            self.metrics.finished(BATCH, decision.outcome, 0, 0)
            kind = "rate_limit_exceeded" if decision.status == 429 else "service_unavailable"
            return _error(decision.status, f"batch request not admitted: {decision.reason}",
                          kind, retry_after_s=decision.retry_after_s)
        ex.requested_max_tokens = requested
        stream = self.batch.add(ex.request_id)
        try:
            return await self._forward(request, ex, min(requested, decision.max_output_tokens),
                                       stream)
        finally:
            self.batch.remove(ex.request_id)
            self._spawn(self._release(ex.request_id, ex.output_tokens))

    async def _forward(self, request: web.Request, ex: Exchange, max_tokens: int | None,
                       batch_stream: BatchStream | None) -> web.StreamResponse:
        req = ex.request
        klass = ex.request_class
        cfg = self.config
        batch = batch_stream is not None
        priority = None
        if cfg.inject_priority:
            priority = cfg.batch_priority if batch else cfg.interactive_priority
        upstream_streams = req.stream or batch
        body = rewrite_body(req, priority=priority, max_tokens=max_tokens,
                            stream=upstream_streams, continuous_usage=batch)
        metrics = self.metrics
        metrics.inflight[klass].inc()
        metrics.tracker.waiting(klass, ex.request_id, ex.arrived_s)
        try:
            try:
                upstream, resp = await self._open(req.endpoint, body, ex.request_id)
            except UpstreamFailure as exc:
                ex.outcome = exc.outcome
                return _error(exc.status, str(exc), "upstream_error")
            try:
                if resp.status != 200:
                    return await self._relay_error(resp, upstream)
                if batch_stream is not None:
                    batch_stream.attach(resp.close)
                if req.stream:
                    return await self._pipe(request, resp, ex, batch_stream, max_tokens)
                if upstream_streams:
                    return await self._collect(resp, ex, batch_stream, max_tokens)
                return await self._passthrough(resp, ex)
            finally:
                # A fully read response returns its keep-alive connection to the pool; any
                # other ending drops the connection, which makes vLLM abort the request.
                if resp.content.at_eof() and not (batch_stream and batch_stream.revoked):
                    resp.release()
                else:
                    resp.close()
                UpstreamPool.release(upstream)
        except asyncio.CancelledError:
            ex.outcome = "client_disconnect"
            raise
        finally:
            if ex.tally is not None:
                ex.output_tokens = ex.tally.output_tokens
            metrics.tracker.settled(klass, ex.request_id)
            metrics.inflight[klass].dec()
            metrics.finished(klass, ex.outcome, ex.prompt_tokens, ex.output_tokens)
            if ex.outcome == "revoked":
                metrics.revocations.inc()

    async def _open(self, endpoint: Endpoint, body: bytes, request_id: str
                    ) -> tuple[Upstream, aiohttp.ClientResponse]:
        assert self.session is not None
        headers = self._upstream_headers(request_id)
        failures = []
        for upstream in self.upstreams.candidates():
            UpstreamPool.acquire(upstream)
            try:
                resp = await self.session.post(upstream.base_url + endpoint.path, data=body,
                                               headers=headers)
                return upstream, resp
            except aiohttp.ClientConnectorError as exc:
                UpstreamPool.release(upstream)
                failures.append(f"{upstream.base_url}: {exc.strerror or exc!r}")
            except (TimeoutError, aiohttp.ClientError) as exc:
                UpstreamPool.release(upstream)
                if isinstance(exc, asyncio.TimeoutError):
                    raise UpstreamFailure(504, "timeout",
                                          f"upstream {upstream.base_url} timed out") from None
                raise UpstreamFailure(502, "error",
                                      f"upstream {upstream.base_url} failed: {exc!r}") from None
        raise UpstreamFailure(502, "error", "no upstream reachable: " + "; ".join(failures))

    async def _relay_error(self, resp: aiohttp.ClientResponse, upstream: Upstream
                           ) -> web.Response:
        body = await resp.read()
        if resp.status < 500:
            return web.Response(status=resp.status, body=body,
                                content_type=resp.content_type or "application/json")
        snippet = body[:300].decode(errors="replace")
        return _error(502, f"upstream {upstream.base_url} answered {resp.status}: {snippet}",
                      "upstream_error")

    async def _passthrough(self, resp: aiohttp.ClientResponse, ex: Exchange) -> web.Response:
        body = await resp.read()
        ex.outcome = "success"
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            usage = json.loads(body).get("usage") or {}
            ex.prompt_tokens = int(usage.get("prompt_tokens", ex.prompt_tokens))
            ex.output_tokens = int(usage.get("completion_tokens", 0))
        return web.Response(status=200, body=body, content_type="application/json",
                            headers={"X-Request-Id": ex.request_id, CLASS_HEADER: ex.request_class})

    def _settle(self, ex: Exchange, tally: StreamTally, batch_stream: BatchStream | None,
                max_tokens: int | None, failure: str) -> str:
        """Outcome of a stream that ended; returns the reason to resume with ("" if none)."""
        ex.output_tokens = tally.output_tokens
        if tally.usage and isinstance(tally.usage.get("prompt_tokens"), int):
            ex.prompt_tokens = int(tally.usage["prompt_tokens"])
        if tally.done:
            clamped = (max_tokens is not None and ex.requested_max_tokens is not None
                       and max_tokens < ex.requested_max_tokens)
            ex.outcome = "truncated" if clamped and tally.saw_length else "success"
            return ""
        if batch_stream is not None and batch_stream.revoked:
            ex.outcome = "revoked"
            return f"revoked: {batch_stream.revoked_reason or 'budget cut'}"
        ex.outcome = "timeout" if failure == "timeout" else "error"
        return f"upstream failed mid-stream: {failure or 'connection closed early'}"

    async def _pipe(self, request: web.Request, resp: aiohttp.ClientResponse, ex: Exchange,
                    batch_stream: BatchStream | None, max_tokens: int | None
                    ) -> web.StreamResponse:
        req = ex.request
        klass = ex.request_class
        response = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "X-Request-Id": ex.request_id, CLASS_HEADER: klass,
        })
        await response.prepare(request)
        tally = ex.tally = StreamTally(req.endpoint, keep_payloads=batch_stream is not None)
        strip_usage = not req.include_usage
        clock = self.clock
        metrics = self.metrics
        itl = metrics.itl[klass]
        last_token_s = -1.0
        buffer = bytearray()
        failure = ""
        try:
            async for data in resp.content.iter_any():
                buffer += data
                out = []
                for event in split_events(buffer):
                    payload = event_data(event)
                    if payload is not None:
                        has_token, usage_only = tally.observe(payload)
                        if has_token:
                            now_s = clock()
                            if last_token_s < 0:
                                metrics.ttft[klass].observe(now_s - ex.arrived_s)
                                metrics.tracker.settled(klass, ex.request_id)
                            else:
                                itl.observe(now_s - last_token_s)
                            last_token_s = now_s
                        if usage_only and strip_usage:
                            continue
                    out.append(event)
                if out:
                    await response.write(out[0] if len(out) == 1 else b"".join(out))
        except ConnectionResetError:
            ex.outcome = "client_disconnect"
            return response
        except TimeoutError:
            failure = "timeout"
        except aiohttp.ClientError as exc:
            failure = repr(exc)
        resume_reason = self._settle(ex, tally, batch_stream, max_tokens, failure)
        with contextlib.suppress(ConnectionResetError):
            if resume_reason and batch_stream is not None:
                await response.write(tally.preempted_chunk(ex.request_id, req.model,
                                                           ex.prompt_tokens, resume_reason))
            elif resume_reason:
                await response.write(b"data: " + error_body(502, resume_reason,
                                                            kind="upstream_error")
                                     + b"\n\ndata: [DONE]\n\n")
            await response.write_eof()
        return response

    async def _collect(self, resp: aiohttp.ClientResponse, ex: Exchange,
                       batch_stream: BatchStream | None, max_tokens: int | None) -> web.Response:
        req = ex.request
        klass = ex.request_class
        tally = ex.tally = StreamTally(req.endpoint, keep_payloads=True)
        buffer = bytearray()
        failure = ""
        first = True
        try:
            async for data in resp.content.iter_any():
                buffer += data
                for event in split_events(buffer):
                    payload = event_data(event)
                    if payload is not None and tally.observe(payload)[0] and first:
                        first = False
                        self.metrics.ttft[klass].observe(self.clock() - ex.arrived_s)
                        self.metrics.tracker.settled(klass, ex.request_id)
        except TimeoutError:
            failure = "timeout"
        except aiohttp.ClientError as exc:
            failure = repr(exc)
        resume_reason = self._settle(ex, tally, batch_stream, max_tokens, failure)
        if resume_reason and batch_stream is None:
            return _error(502, resume_reason, "upstream_error")
        body = tally.completion_body(ex.request_id, req.model, ex.prompt_tokens,
                                     preempted_reason=resume_reason)
        return web.Response(status=200, body=body, content_type="application/json",
                            headers={"X-Request-Id": ex.request_id, CLASS_HEADER: klass})


def _request_class(tenant: Tenant, header: str | None) -> str:
    """The tenant's class, demoted to batch when the header asks; never promoted."""
    if header is None:
        return tenant.request_class.value
    value = header.strip().lower()
    if value not in (INTERACTIVE, BATCH):
        raise FieldError(f"header {CLASS_HEADER}", f"must be interactive or batch, got {header!r}")
    if value == BATCH:
        return BATCH
    return tenant.request_class.value


def _max_wait_s(header: str | None) -> float | None:
    if header is None:
        return None
    try:
        value = float(header)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise FieldError(f"header {MAX_WAIT_HEADER}", f"must be seconds >= 0, got {header!r}")
    return value


def _error(status: int, message: str, kind: str, *, field: str | None = None,
           retry_after_s: float | None = None) -> web.Response:
    headers = {}
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
    return web.Response(status=status, body=error_body(status, message, kind=kind, field=field),
                        content_type="application/json", headers=headers)


async def serve(server: ProxyServer, host: str, port: int,
                shutdown_timeout_s: float = 5.0) -> web.AppRunner:
    """Start `server` on host:port (handler cancellation on, so a client disconnect aborts
    the upstream request); returns the runner to clean up."""
    runner = web.AppRunner(server.build_app(), handler_cancellation=True, access_log=None,
                           shutdown_timeout=shutdown_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    return runner
