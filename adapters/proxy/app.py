"""The proxy's request handling: authenticate, classify, admit, forward, measure, revoke.

Per request: API key -> tenant -> class (a header may demote to batch, never promote);
body validated (400 names the field); batch requests pass the gate (429/503 when denied)
and get `max_tokens` clamped to the budget's output cap; the body is forwarded with
vLLM's `priority` injected to the upstream with the fewest outstanding requests, over
keep-alive connections. Streams are relayed event by event from the upstream connection's
data callback straight to the client's (`http1`, `upstream_http`: no task switch per
chunk); a revoked batch stream ends with a `preempted` chunk carrying its text and usage so
far. Batch requests are always streamed from the upstream (a non-streaming batch client
gets the response assembled by the proxy), so they too can be revoked resumably.
Interactive non-streaming requests are passed through unchanged (no TTFT is observable for
them).
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

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from adapters.proxy.admission import BatchAdmitter, GateLike
from adapters.proxy.config import ProxyConfig, RequestClass, Tenant
from adapters.proxy.http1 import HttpRequest, HttpServer, Responder
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
from adapters.proxy.sse import StreamTally, event_payload, take_complete
from adapters.proxy.upstream_http import UpstreamClient, UpstreamError, UpstreamResponse
from adapters.proxy.upstreams import Upstream, UpstreamPool

log = logging.getLogger(__name__)

CLASS_HEADER = "X-Borrowd-Class"
"""Request header that lets a client demote its request to batch (never promote)."""
MAX_WAIT_HEADER = "X-Borrowd-Max-Wait-S"
"""Request header: how long a batch request may wait in the admission queue, seconds."""

INTERACTIVE = RequestClass.INTERACTIVE.value
BATCH = RequestClass.BATCH.value
_GENERATE = {"/v1/chat/completions": Endpoint.CHAT, "/v1/completions": Endpoint.COMPLETIONS}
_GET = ("/v1/models", "/metrics", "/health")


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


class _Relay:
    """Forwards one upstream SSE stream to its client, chunk by chunk, measuring as it goes.

    `on_body` runs in the upstream connection's data callback: it takes the complete
    events, tallies each payload (token? usage-only?), observes TTFT on the first token and
    ITL between tokens, and writes the events on unchanged (less usage-only chunks the
    client did not ask for) in one write.
    """

    __slots__ = ("_buffer", "_clock", "_ex", "_itl", "_last_token_s", "_metrics", "_out",
                 "_strip_usage", "_tally", "_ttft", "done")

    def __init__(self, ex: Exchange, tally: StreamTally, out: Responder | None,
                 metrics: ProxyMetrics, clock: Callable[[], float], strip_usage: bool) -> None:
        self._ex = ex
        self._tally = tally
        self._out = out
        self._metrics = metrics
        self._ttft = metrics.ttft[ex.request_class]
        self._itl = metrics.itl[ex.request_class]
        self._clock = clock
        self._strip_usage = strip_usage
        self._buffer = bytearray()
        self._last_token_s = -1.0
        self.done: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    def on_body(self, data: bytes) -> None:
        """Take, tally and forward the complete events in `data`."""
        complete = take_complete(self._buffer, data)
        if not complete:
            return
        kept: list[bytes] | None = None
        events = complete.split(b"\n\n")
        for index, event in enumerate(events):
            payload = event_payload(event) if event else None
            if payload is None:
                continue
            has_token, usage_only = self._tally.observe(payload)
            if has_token:
                now_s = self._clock()
                if self._last_token_s < 0:
                    self._ttft.observe(now_s - self._ex.arrived_s)
                    self._metrics.tracker.settled(self._ex.request_class, self._ex.request_id)
                else:
                    self._itl.observe(now_s - self._last_token_s)
                self._last_token_s = now_s
            if usage_only and self._strip_usage:
                if kept is None:
                    kept = [e for e in events[:index] if e]
                continue
            if kept is not None:
                kept.append(event)
        if self._out is not None:
            if kept is None:
                self._out.write(complete)
            elif kept:
                self._out.write(b"\n\n".join(kept) + b"\n\n")

    def on_end(self, failure: str) -> None:
        """The upstream response ended ("" when complete, else why not)."""
        if not self.done.done():
            self.done.set_result(failure)


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
        self.client: UpstreamClient | None = None
        self._background: list[asyncio.Task] = []
        self._stopped = asyncio.Event()
        self._pending: set[asyncio.Task] = set()

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Open the upstream client and start revocation watching and lease renewal."""
        cfg = self.config
        self.client = UpstreamClient(cfg.upstream_connect_timeout_s, cfg.upstream_read_timeout_s)
        self._background = [
            asyncio.create_task(watch_revocations(self.gate, self.batch, self._revoked,
                                                  self._stopped)),
            asyncio.create_task(renew_leases(self.gate, self.batch,
                                             cfg.admission.lease_ms / 3000.0, self._stopped)),
        ]

    async def stop(self) -> None:
        """Stop background work, let pending releases finish, close upstream connections."""
        self._stopped.set()
        for task in self._background:
            task.cancel()
        # A Redis call being cancelled may not return promptly (redis-py reconnect logic);
        # never let that hold the shutdown.
        if self._background:
            await asyncio.wait(self._background, timeout=1.0)
        if self._pending:
            await asyncio.wait(self._pending, timeout=self.config.admission.gate_timeout_s * 2)
        if self.client is not None:
            await self.client.close()

    def _revoked(self, request_id: str) -> None:
        log.info("revoked batch request %s", request_id)

    # -- helpers -----------------------------------------------------------------------

    def _tenant(self, request: HttpRequest) -> Tenant | None:
        header = request.headers.get("authorization", "")
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

    async def handle(self, request: HttpRequest, out: Responder) -> None:
        """Route one request."""
        endpoint = _GENERATE.get(request.path)
        if endpoint is not None and request.method == "POST":
            await self._generate(request, out, endpoint)
        elif request.path in _GET and request.method in ("GET", "HEAD"):
            if request.path == "/metrics":
                out.respond(200, generate_latest(self.registry), content_type=CONTENT_TYPE_LATEST)
            elif request.path == "/health":
                out.respond(200, b"ok\n", content_type="text/plain")
            else:
                await self._models(request, out)
        elif endpoint is not None or request.path in _GET:
            allow = "POST" if endpoint is not None else "GET"
            _error(out, 405, f"{request.method} is not allowed on {request.path} (use {allow})",
                   "invalid_request_error", headers={"Allow": allow})
        else:
            _error(out, 404, f"no route {request.path}", "not_found_error")

    async def _models(self, request: HttpRequest, out: Responder) -> None:
        if self._tenant(request) is None:
            _error(out, 401, "missing or unknown API key (Authorization: Bearer KEY)",
                   "authentication_error")
            return
        assert self.client is not None
        upstream = self.upstreams.candidates()[0]
        try:
            resp = await self.client.request(upstream.base_url, "GET", "/v1/models",
                                             self._upstream_headers("models"))
            body = await resp.read()
        except UpstreamError as exc:
            _error(out, 502, f"upstream {upstream.base_url} unreachable: {exc}",
                   "upstream_error")
            return
        if resp.status >= 500:
            _error(out, 502, f"upstream {upstream.base_url} answered {resp.status}",
                   "upstream_error")
            return
        out.respond(resp.status, body)

    async def _generate(self, request: HttpRequest, out: Responder, endpoint: Endpoint) -> None:
        arrived_s = self.clock()
        tenant = self._tenant(request)
        if tenant is None:
            _error(out, 401, "missing or unknown API key (Authorization: Bearer KEY)",
                   "authentication_error")
            return
        if request.too_large:
            _error(out, 413, f"request body exceeds {self.config.max_body_bytes} bytes",
                   "invalid_request_error", field="body")
            return
        try:
            req = parse_completion_request(request.body, endpoint)
            request_class = _request_class(tenant, request.headers.get(CLASS_HEADER.lower()))
        except FieldError as exc:
            _error(out, 400, str(exc), "invalid_request_error", field=exc.field)
            return
        ex = Exchange(request_id=f"borrowd-{uuid.uuid4().hex}", request_class=request_class,
                      arrived_s=arrived_s, request=req, requested_max_tokens=req.max_tokens,
                      prompt_tokens=req.prompt_tokens)
        if request_class == INTERACTIVE:
            await self._forward(out, ex, req.max_tokens, None)
        else:
            await self._batch(request, out, ex)

    async def _batch(self, request: HttpRequest, out: Responder, ex: Exchange) -> None:
        req = ex.request
        if req.n != 1:
            _error(out, 400, "n: batch requests take n = 1 (send one request per sequence)",
                   "invalid_request_error", field="n")
            return
        try:
            max_wait_s = _max_wait_s(request.headers.get(MAX_WAIT_HEADER.lower()))
        except FieldError as exc:
            _error(out, 400, str(exc), "invalid_request_error", field=exc.field)
            return
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
            _error(out, decision.status, f"batch request not admitted: {decision.reason}",
                   kind, retry_after_s=decision.retry_after_s)
            return
        ex.requested_max_tokens = requested
        stream = self.batch.add(ex.request_id)
        try:
            await self._forward(out, ex, min(requested, decision.max_output_tokens), stream)
        finally:
            self.batch.remove(ex.request_id)
            self._spawn(self._release(ex.request_id, ex.output_tokens))

    async def _forward(self, out: Responder, ex: Exchange, max_tokens: int | None,
                       batch_stream: BatchStream | None) -> None:
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
                _error(out, exc.status, str(exc), "upstream_error")
                return
            # Everything below that drops this exchange's connection must not touch the
            # connection once it went back to the pool for another request.
            abort = resp.aborter()
            try:
                if resp.status != 200:
                    await self._relay_error(out, resp, upstream)
                    return
                if batch_stream is not None:
                    batch_stream.attach(abort)
                if req.stream:
                    await self._pipe(out, resp, ex, batch_stream, max_tokens)
                elif upstream_streams:
                    await self._collect(out, resp, ex, batch_stream, max_tokens)
                else:
                    await self._passthrough(out, resp, ex)
            finally:
                # A response not read to its end drops its connection: vLLM aborts it.
                abort()
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
                    ) -> tuple[Upstream, UpstreamResponse]:
        assert self.client is not None
        headers = self._upstream_headers(request_id)
        failures = []
        for upstream in self.upstreams.candidates():
            UpstreamPool.acquire(upstream)
            try:
                resp = await self.client.request(upstream.base_url, "POST", endpoint.path,
                                                 headers, body)
                return upstream, resp
            except UpstreamError as exc:
                UpstreamPool.release(upstream)
                if exc.kind == "connect":
                    failures.append(f"{upstream.base_url}: {exc}")
                    continue
                if exc.kind == "timeout":
                    raise UpstreamFailure(504, "timeout",
                                          f"upstream {upstream.base_url} timed out") from None
                raise UpstreamFailure(502, "error",
                                      f"upstream {upstream.base_url} failed: {exc}") from None
            except BaseException:
                UpstreamPool.release(upstream)
                raise
        raise UpstreamFailure(502, "error", "no upstream reachable: " + "; ".join(failures))

    async def _relay_error(self, out: Responder, resp: UpstreamResponse,
                           upstream: Upstream) -> None:
        try:
            body = await resp.read()
        except UpstreamError as exc:
            body = str(exc).encode()
        if resp.status < 500:
            out.respond(resp.status, body,
                        content_type=resp.headers.get("content-type", "application/json"))
            return
        snippet = body[:300].decode(errors="replace")
        _error(out, 502, f"upstream {upstream.base_url} answered {resp.status}: {snippet}",
               "upstream_error")

    async def _passthrough(self, out: Responder, resp: UpstreamResponse, ex: Exchange) -> None:
        try:
            body = await resp.read()
        except UpstreamError as exc:
            ex.outcome = "timeout" if exc.kind == "timeout" else "error"
            _error(out, 502, f"upstream failed mid-response: {exc}", "upstream_error")
            return
        ex.outcome = "success"
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            usage = json.loads(body).get("usage") or {}
            ex.prompt_tokens = int(usage.get("prompt_tokens", ex.prompt_tokens))
            ex.output_tokens = int(usage.get("completion_tokens", 0))
        out.respond(200, body, headers={"X-Request-Id": ex.request_id,
                                        CLASS_HEADER: ex.request_class})

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

    async def _pipe(self, out: Responder, resp: UpstreamResponse, ex: Exchange,
                    batch_stream: BatchStream | None, max_tokens: int | None) -> None:
        req = ex.request
        out.start_stream(200, {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                               "X-Request-Id": ex.request_id, CLASS_HEADER: ex.request_class})
        tally = ex.tally = StreamTally(req.endpoint, keep_payloads=batch_stream is not None)
        relay = _Relay(ex, tally, out, self.metrics, self.clock,
                       strip_usage=not req.include_usage)
        out.on_flow(resp.pauser(), resp.resumer())
        resp.stream(relay.on_body, relay.on_end)
        failure = await relay.done
        resume_reason = self._settle(ex, tally, batch_stream, max_tokens, failure)
        if resume_reason and batch_stream is not None:
            out.write(tally.preempted_chunk(ex.request_id, req.model, ex.prompt_tokens,
                                            resume_reason))
        elif resume_reason:
            out.write(b"data: " + error_body(502, resume_reason, kind="upstream_error")
                      + b"\n\ndata: [DONE]\n\n")
        out.end()

    async def _collect(self, out: Responder, resp: UpstreamResponse, ex: Exchange,
                       batch_stream: BatchStream | None, max_tokens: int | None) -> None:
        req = ex.request
        tally = ex.tally = StreamTally(req.endpoint, keep_payloads=True)
        relay = _Relay(ex, tally, None, self.metrics, self.clock, strip_usage=False)
        resp.stream(relay.on_body, relay.on_end)
        failure = await relay.done
        resume_reason = self._settle(ex, tally, batch_stream, max_tokens, failure)
        if resume_reason and batch_stream is None:
            _error(out, 502, resume_reason, "upstream_error")
            return
        body = tally.completion_body(ex.request_id, req.model, ex.prompt_tokens,
                                     preempted_reason=resume_reason)
        out.respond(200, body, headers={"X-Request-Id": ex.request_id,
                                        CLASS_HEADER: ex.request_class})


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


def _error(out: Responder, status: int, message: str, kind: str, *,
           field: str | None = None, retry_after_s: float | None = None,
           headers: dict[str, str] | None = None) -> None:
    all_headers = dict(headers or {})
    if retry_after_s is not None:
        all_headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
    out.respond(status, error_body(status, message, kind=kind, field=field),
                headers=all_headers)


@dataclass(frozen=True)
class ProxyRunner:
    """A running proxy: its listening server and its state; `cleanup()` stops both."""

    http: HttpServer
    server: ProxyServer
    shutdown_timeout_s: float

    async def cleanup(self) -> None:
        """Stop accepting, give requests in flight the shutdown timeout, then stop."""
        await self.http.cleanup(self.shutdown_timeout_s)
        await self.server.stop()


async def serve(server: ProxyServer, host: str, port: int,
                shutdown_timeout_s: float = 5.0) -> ProxyRunner:
    """Start `server` on host:port (a client that disconnects cancels its request, which
    aborts the upstream request); returns the runner to clean up."""
    await server.start()
    http = HttpServer(server.handle, server.config.max_body_bytes)
    try:
        await http.start(host, port)
    except BaseException:
        await server.stop()
        raise
    return ProxyRunner(http, server, shutdown_timeout_s)
