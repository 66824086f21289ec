"""The proxy's request handling: authenticate, classify, admit, forward, measure, revoke.

Per request: API key -> tenant -> class (a header may demote to batch, never promote);
body validated (400 names the field); batch requests pass the gate (429/503 when denied)
and get `max_tokens` clamped to the budget's output cap; the body is forwarded with
vLLM's `priority` injected to the upstream with the fewest outstanding requests (batch only
to the upstreams named in `batch_upstreams`, when any are), over keep-alive connections.
Streams are relayed event by event from the upstream connection's data callback straight
to the client's (`http1`, `upstream_http`: no task switch per chunk). Batch requests are
always streamed from the upstream (a non-streaming batch client gets the response
assembled by the proxy, tool calls, reasoning and logprobs included), so they too can be
revoked; a batch stream's per-chunk usage (asked for to count its tokens) reaches the
client only if it asked for it. Interactive non-streaming requests are passed
through unchanged (no TTFT is observable for them).

A revoked batch request (budget cut, lease lost, proxy shutting down) ends resumably, with
finish_reason `preempted` and its text so far, when the tenant (`resumable = true`) or the
request (`X-Borrowd-Resumable: 1`) opted in; otherwise a stream ends with an error event
and a non-streaming request gets 503 + Retry-After with the partial text in the error body,
since typed clients reject an unknown finish reason. An upstream failing mid-stream is an
error, never `preempted`; vLLM's own in-stream error events count as errors. An upstream's
4xx/5xx status is kept (with Retry-After), and a 503 before any byte of answer ("try
another instance") is retried on the next upstream. Batch prompts are charged by the
proxy's own count (`tokens`), trued up at release from the engine's reported usage.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import resource
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from borrowd.adapters.proxy.admission import BatchAdmitter, GateLike
from borrowd.adapters.proxy.config import ProxyConfig, RequestClass, Tenant
from borrowd.adapters.proxy.http1 import HttpRequest, HttpServer, Responder, ServerLimits
from borrowd.adapters.proxy.metrics import ProxyMetrics
from borrowd.adapters.proxy.openai import (
    CompletionRequest,
    Endpoint,
    FieldError,
    error_body,
    parse_completion_request,
    rewrite_body,
)
from borrowd.adapters.proxy.relay import Exchange, Relay
from borrowd.adapters.proxy.revocation import (
    BatchRegistry,
    BatchStream,
    renew_leases,
    watch_revocations,
)
from borrowd.adapters.proxy.sse import StreamTally, error_event
from borrowd.adapters.proxy.tokens import (
    PromptCounter,
    load_tokenizer,
    trued_up_output_tokens,
    utf8_bytes,
)
from borrowd.adapters.proxy.upstream_http import UpstreamClient, UpstreamError, UpstreamResponse
from borrowd.adapters.proxy.upstreams import Upstream, UpstreamPool
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

CLASS_HEADER = "X-Borrowd-Class"
"""Request header that lets a client demote its request to batch (never promote)."""
MAX_WAIT_HEADER = "X-Borrowd-Max-Wait-S"
"""Request header: how long a batch request may wait in the admission queue, seconds."""
RESUMABLE_HEADER = "X-Borrowd-Resumable"
"""Request header: `1` opts a batch request in to the resumable `preempted` ending."""
SHUTDOWN = "shutdown"
"""Revocation reason of batch work the proxy ends because it is stopping."""
REVOKED_RETRY_AFTER_S = 1

INTERACTIVE = RequestClass.INTERACTIVE.value
BATCH = RequestClass.BATCH.value
_GENERATE = {"/v1/chat/completions": Endpoint.CHAT, "/v1/completions": Endpoint.COMPLETIONS}
_GET = ("/v1/models", "/metrics", "/health")


class UpstreamFailure(Exception):
    """No upstream answered; carries the HTTP status and outcome to report."""

    def __init__(self, status: int, outcome: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.outcome = outcome


class UpstreamStatus(Exception):
    """Every upstream answered with an error status before any output: relay the last."""

    def __init__(self, upstream: Upstream, resp: UpstreamResponse) -> None:
        super().__init__(f"upstream answered {resp.status}")
        self.upstream = upstream
        self.resp = resp


class ProxyServer:
    """State of one proxy: config, metrics, upstream pool, gate and in-flight batch work."""

    def __init__(self, config: ProxyConfig, gate: GateLike,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.gate = gate
        self.clock = clock
        self.registry = CollectorRegistry()
        self.metrics = ProxyMetrics(config.pool, self.registry, clock,
                                    slo_ttft_s=config.slo_ttft_s, slo_itl_s=config.slo_itl_s)
        self.upstreams = UpstreamPool(config.upstreams, config.batch_upstreams)
        self.admitter = BatchAdmitter(gate, config.admission, clock)
        self.batch = BatchRegistry()
        count_text = (load_tokenizer(config.tokenizer_path) if config.tokenizer_path
                      else utf8_bytes)
        self.counter = PromptCounter(count_text, config.media_part_tokens)
        self.client: UpstreamClient | None = None
        self.open_connections: Callable[[], int] = lambda: 0
        self.max_connections = config.max_connections
        self.stopping = False
        self._background: list[asyncio.Task] = []
        self._stopped = asyncio.Event()
        self._pending: set[asyncio.Task] = set()

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Open the upstream client and start revocation watching and lease renewal."""
        cfg = self.config
        adm = cfg.admission
        self.client = UpstreamClient(cfg.upstream_connect_timeout_s, cfg.upstream_read_timeout_s)
        self._background = [
            asyncio.create_task(watch_revocations(self.gate, self.batch, self._revoked,
                                                  self._stopped)),
            asyncio.create_task(renew_leases(self.gate, self.batch, adm.lease_ms / 3000.0,
                                             adm.lease_ms / 1000.0, adm.gate_timeout_s,
                                             self._stopped, self.clock)),
        ]

    def end_batch(self, reason: str = SHUTDOWN) -> int:
        """End every batch request in flight through its revoked ending and admit no more;
        how many were ended."""
        self.stopping = True
        count = self.batch.revoke_all(reason)
        if count:
            log.info("ending %d batch requests in flight (%s)", count, reason)
        return count

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
            log.warning("upstream %s unreachable for /v1/models: %s", upstream.base_url, exc)
            _error(out, 502, "upstream unreachable", "upstream_error")
            return
        if resp.status >= 500:
            log.warning("upstream %s answered %d to /v1/models", upstream.base_url, resp.status)
            _error(out, resp.status, f"upstream answered {resp.status}", "upstream_error",
                   headers=_retry_after(resp))
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
        resumable = (tenant.resumable
                     or request.headers.get(RESUMABLE_HEADER.lower(), "").strip() == "1")
        ex = Exchange(request_id=f"borrowd-{uuid.uuid4().hex}", request_class=request_class,
                      arrived_s=arrived_s, request=req, requested_max_tokens=req.max_tokens,
                      prompt_tokens=req.prompt_tokens, resumable=resumable)
        if request_class == INTERACTIVE:
            await self._forward(out, ex, req.max_tokens, None)
        else:
            await self._batch(request, out, ex)

    async def _batch(self, request: HttpRequest, out: Responder, ex: Exchange) -> None:
        req = ex.request
        cfg = self.config
        if self.stopping:
            self.metrics.finished(BATCH, "rejected", 0, 0)
            _error(out, 503, "the proxy is shutting down", "service_unavailable",
                   retry_after_s=cfg.admission.unavailable_retry_after_s, close=True)
            return
        batch_room = self.max_connections - cfg.interactive_reserved_connections
        if self.open_connections() > batch_room:
            self.metrics.finished(BATCH, "rejected", 0, 0)
            _error(out, 503, f"batch requests may hold at most {batch_room} connections (the "
                   "rest is kept for interactive work)", "service_unavailable",
                   retry_after_s=cfg.admission.unavailable_retry_after_s, close=True)
            return
        try:
            _one_sequence(req)
            max_wait_s = _max_wait_s(request.headers.get(MAX_WAIT_HEADER.lower()))
        except FieldError as exc:
            _error(out, 400, str(exc), "invalid_request_error", field=exc.field)
            return
        ex.prompt_tokens = ex.charged_prompt_tokens = self.counter.prompt_tokens(req)
        requested = req.max_tokens or cfg.admission.default_batch_max_tokens
        try:
            decision = await self.admitter.admit(ex.request_id, ex.charged_prompt_tokens,
                                                 requested, max_wait_s)
        except asyncio.CancelledError:
            self.metrics.finished(BATCH, "client_disconnect", 0, 0)
            raise
        self.metrics.queue[BATCH].observe(decision.waited_s)
        if not decision.admitted:
            self.metrics.finished(BATCH, decision.outcome, 0, 0)
            kind = "rate_limit_exceeded" if decision.status == 429 else "service_unavailable"
            _error(out, decision.status,
                   f"batch request not admitted in pool {cfg.pool!r}: {decision.reason}",
                   kind, retry_after_s=decision.retry_after_s)
            return
        if self.stopping:  # admitted while the proxy began to stop: start nothing new
            self._spawn(self._release(ex.request_id, 0))
            self.metrics.finished(BATCH, "rejected", 0, 0)
            _error(out, 503, "the proxy is shutting down", "service_unavailable",
                   retry_after_s=cfg.admission.unavailable_retry_after_s, close=True)
            return
        ex.requested_max_tokens = requested
        # The gate's lease began during the admit call, at most one gate timeout ago.
        stream = self.batch.add(ex.request_id, self.clock() - cfg.admission.gate_timeout_s)
        try:
            await self._forward(out, ex, min(requested, decision.max_output_tokens), stream)
        finally:
            self.batch.remove(ex.request_id)
            reported = ex.tally.reported_prompt_tokens if ex.tally is not None else None
            used = trued_up_output_tokens(ex.output_tokens, ex.charged_prompt_tokens, reported)
            self._spawn(self._release(ex.request_id, used))

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
                upstream, resp = await self._open(req.endpoint, body, ex.request_id, batch)
            except UpstreamFailure as exc:
                ex.outcome = exc.outcome
                _error(out, exc.status, str(exc), "upstream_error")
                return
            except UpstreamStatus as exc:
                try:
                    await self._relay_error(out, exc.resp, exc.upstream)
                finally:
                    UpstreamPool.release(exc.upstream, batch=batch)
                return
            ex.batch_eligible_upstream = upstream.batch_eligible
            # Everything below that drops this exchange's connection must not touch the
            # connection once it went back to the pool for another request.
            abort = resp.aborter()
            try:
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
                UpstreamPool.release(upstream, batch=batch)
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

    async def _open(self, endpoint: Endpoint, body: bytes, request_id: str, batch: bool
                    ) -> tuple[Upstream, UpstreamResponse]:
        """Send the request to the least busy upstream its class may use (batch: an eligible
        one); on a refused connection or a 503 ("try another instance", nothing generated
        yet) go on to the next one."""
        assert self.client is not None
        headers = self._upstream_headers(request_id)
        refused = 0
        candidates = self.upstreams.candidates(batch=batch)
        for index, upstream in enumerate(candidates):
            UpstreamPool.acquire(upstream, batch=batch)
            try:
                resp = await self.client.request(upstream.base_url, "POST", endpoint.path,
                                                 headers, body)
            except UpstreamError as exc:
                UpstreamPool.release(upstream, batch=batch)
                log.warning("upstream %s failed for %s: %s (%s)", upstream.base_url,
                            request_id, exc, exc.kind)
                if exc.kind == "connect":
                    refused += 1
                    continue
                if exc.kind == "timeout":
                    raise UpstreamFailure(504, "timeout", "upstream timed out") from None
                raise UpstreamFailure(502, "error", f"upstream failed ({exc.kind})") from None
            except BaseException:
                UpstreamPool.release(upstream, batch=batch)
                raise
            if resp.status == 200:
                return upstream, resp
            if resp.status == 503 and index + 1 < len(candidates):
                log.warning("upstream %s answered 503 for %s; trying the next one",
                            upstream.base_url, request_id)
                with contextlib.suppress(UpstreamError):
                    await resp.read()
                UpstreamPool.release(upstream, batch=batch)
                continue
            raise UpstreamStatus(upstream, resp)
        raise UpstreamFailure(502, "error", f"no upstream reachable ({refused} tried)")

    async def _relay_error(self, out: Responder, resp: UpstreamResponse,
                           upstream: Upstream) -> None:
        """Relay an upstream's error status and body (OpenAI-shaped; else a generic body),
        with its Retry-After; where it came from goes to the log, not to the client."""
        try:
            body = await resp.read()
        except UpstreamError as exc:
            body = b""
            log.warning("upstream %s broke off its %d answer: %s", upstream.base_url,
                        resp.status, exc)
        if resp.status >= 500:
            log.warning("upstream %s answered %d: %s", upstream.base_url, resp.status,
                        body[:300].decode(errors="replace"))
        if not _is_error_object(body):
            body = error_body(resp.status, f"upstream answered {resp.status}",
                              kind="upstream_error")
        out.respond(resp.status, body, headers=_retry_after(resp))

    async def _passthrough(self, out: Responder, resp: UpstreamResponse, ex: Exchange) -> None:
        try:
            body = await resp.read()
        except UpstreamError as exc:
            ex.outcome = "timeout" if exc.kind == "timeout" else "error"
            log.warning("upstream failed mid-response for %s: %s", ex.request_id, exc)
            _error(out, 502, f"upstream failed mid-response ({exc.kind})", "upstream_error")
            return
        ex.outcome = "success"
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            usage = json.loads(body).get("usage") or {}
            ex.prompt_tokens = int(usage.get("prompt_tokens", ex.prompt_tokens))
            ex.output_tokens = int(usage.get("completion_tokens", 0))
        out.respond(200, body, headers={"X-Request-Id": ex.request_id,
                                        CLASS_HEADER: ex.request_class})

    def _settle(self, ex: Exchange, tally: StreamTally, batch_stream: BatchStream | None,
                max_tokens: int | None, failure: str) -> Ending:
        """Outcome of a stream that ended, and how it ended."""
        ex.output_tokens = tally.output_tokens
        if tally.reported_prompt_tokens is not None:
            ex.prompt_tokens = tally.reported_prompt_tokens
        if tally.error is not None:
            ex.outcome = "error"
            return Ending("upstream_error_event", "upstream error event")
        if tally.done:
            clamped = (max_tokens is not None and ex.requested_max_tokens is not None
                       and max_tokens < ex.requested_max_tokens)
            ex.outcome = "truncated" if clamped and tally.saw_length else "success"
            return Ending("done", "")
        if batch_stream is not None and batch_stream.revoked:
            ex.outcome = "revoked"
            return Ending("revoked", batch_stream.revoked_reason or "budget cut")
        ex.outcome = "timeout" if failure == "timeout" else "error"
        log.warning("upstream failed mid-stream for %s: %s", ex.request_id,
                    failure or "connection closed early")
        return Ending("upstream_failed", "upstream failed mid-stream"
                      + (" (timeout)" if failure == "timeout" else ""))

    async def _pipe(self, out: Responder, resp: UpstreamResponse, ex: Exchange,
                    batch_stream: BatchStream | None, max_tokens: int | None) -> None:
        req = ex.request
        out.start_stream(200, {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                               "X-Request-Id": ex.request_id, CLASS_HEADER: ex.request_class})
        batch = batch_stream is not None
        tally = ex.tally = StreamTally(req.endpoint, keep_payloads=batch)
        relay = Relay(ex, tally, out, self.metrics, self.clock,
                       strip_usage=not req.include_usage,
                       strip_chunk_usage=batch and not _asked_continuous_usage(req))
        out.on_flow(resp.pauser(), resp.resumer())
        resp.stream(relay.on_body, relay.on_end)
        failure = await relay.done
        ending = self._settle(ex, tally, batch_stream, max_tokens, failure)
        if ending.kind == "revoked" and ex.resumable:
            out.write(tally.preempted_chunk(ex.request_id, req.model, ex.prompt_tokens,
                                            ending.reason))
        elif ending.kind == "revoked":
            out.write(error_event(503, f"batch request revoked ({ending.reason}); retry later",
                                  "service_unavailable"))
        elif ending.kind == "upstream_failed":
            out.write(error_event(502, ending.reason, "upstream_error"))
        out.end()

    async def _collect(self, out: Responder, resp: UpstreamResponse, ex: Exchange,
                       batch_stream: BatchStream | None, max_tokens: int | None) -> None:
        req = ex.request
        tally = ex.tally = StreamTally(req.endpoint, keep_payloads=True)
        relay = Relay(ex, tally, None, self.metrics, self.clock, strip_usage=False)
        resp.stream(relay.on_body, relay.on_end)
        failure = await relay.done
        ending = self._settle(ex, tally, batch_stream, max_tokens, failure)
        headers = {"X-Request-Id": ex.request_id, CLASS_HEADER: ex.request_class}
        if ending.kind == "upstream_error_event":
            status, detail = tally.error_detail()
            out.respond(status, json.dumps({"error": detail}).encode(), headers=headers)
        elif ending.kind == "upstream_failed":
            _error(out, 502, ending.reason, "upstream_error", headers=headers)
        elif ending.kind == "revoked" and not ex.resumable:
            body = json.loads(error_body(503, f"batch request revoked ({ending.reason}); "
                                         "retry later", kind="service_unavailable"))
            body["error"]["borrowd_partial"] = tally.partial(ex.prompt_tokens)
            headers["Retry-After"] = str(REVOKED_RETRY_AFTER_S)
            out.respond(503, json.dumps(body).encode(), headers=headers)
        else:
            reason = ending.reason if ending.kind == "revoked" else ""
            out.respond(200, tally.completion_body(ex.request_id, req.model, ex.prompt_tokens,
                                                   preempted_reason=reason), headers=headers)


@dataclass(frozen=True, slots=True)
class Ending:
    """How a stream ended: done, revoked (with the revocation reason), upstream_failed,
    or upstream_error_event (vLLM sent an error event)."""

    kind: str
    reason: str


def _one_sequence(req: CompletionRequest) -> None:
    """Batch requests run one sequence each (the gate's caps count sequences)."""
    if req.n != 1:
        raise FieldError("n", "batch requests take n = 1 (send one request per sequence)")
    if req.best_of != 1:
        raise FieldError("best_of", "batch requests take best_of = 1")
    if req.prompts != 1:
        raise FieldError("prompt", f"batch requests take one prompt, got {req.prompts} "
                                   "(send one request per prompt)")


def _asked_continuous_usage(req: CompletionRequest) -> bool:
    options = req.body.get("stream_options")
    return isinstance(options, dict) and options.get("continuous_usage_stats") is True


def _is_error_object(body: bytes) -> bool:
    with contextlib.suppress(ValueError, UnicodeDecodeError):
        parsed = json.loads(body)
        return isinstance(parsed, dict) and isinstance(parsed.get("error"), dict)
    return False


def _retry_after(resp: UpstreamResponse) -> dict[str, str]:
    """The upstream's Retry-After header, to pass on."""
    value = resp.headers.get("retry-after")
    return {"Retry-After": value} if value else {}


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
           headers: dict[str, str] | None = None, close: bool = False) -> None:
    all_headers = dict(headers or {})
    if retry_after_s is not None:
        all_headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
    if close:
        out.keep_alive = False
    out.respond(status, error_body(status, message, kind=kind, field=field),
                headers=all_headers)


FD_HEADROOM = 64
"""File descriptors kept for Redis, logs, the listening socket and the like."""


def connection_cap(configured: int) -> int:
    """`configured`, lowered to what the open-file limit allows: each client connection may
    hold an upstream connection too, so two descriptors each."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    allowed = max(2, (soft - FD_HEADROOM) // 2)
    if configured > allowed:
        log.warning("proxy.max_connections %d lowered to %d: the open-file limit is %d",
                    configured, allowed, soft)
    return min(configured, allowed)


@dataclass(frozen=True)
class ProxyRunner:
    """A running proxy: its listening server and its state; `cleanup()` stops both."""

    http: HttpServer
    server: ProxyServer
    shutdown_timeout_s: float

    async def cleanup(self) -> None:
        """Stop accepting; end batch work in flight at once through its revoked ending (no
        generated text is lost), give interactive requests the shutdown timeout, then stop."""
        self.http.stop_listening()
        self.server.end_batch(SHUTDOWN)
        await self.http.cleanup(self.shutdown_timeout_s)
        await self.server.stop()


async def serve(server: ProxyServer, host: str, port: int,
                shutdown_timeout_s: float | None = None) -> ProxyRunner:
    """Start `server` on host:port (a client that disconnects cancels its request, which
    aborts the upstream request); returns the runner to clean up."""
    cfg = server.config
    await server.start()
    limits = ServerLimits(max_header_bytes=cfg.max_header_bytes, max_headers=cfg.max_headers,
                          header_timeout_s=cfg.header_timeout_s,
                          body_timeout_s=cfg.body_timeout_s, idle_timeout_s=cfg.idle_timeout_s,
                          max_connections=connection_cap(cfg.max_connections))
    http = HttpServer(server.handle, cfg.max_body_bytes, limits)
    try:
        await http.start(host, port)
    except BaseException:
        await server.stop()
        raise
    server.open_connections = lambda: len(http.connections)
    server.max_connections = limits.max_connections
    timeout_s = cfg.shutdown_timeout_s if shutdown_timeout_s is None else shutdown_timeout_s
    return ProxyRunner(http, server, timeout_s)
