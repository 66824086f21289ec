"""`borrowd gate`: the admission gate as an HTTP service that a real router calls per request.

Request headers (case-insensitive):
  X-Borrowd-Pool           pool name (default: the service's `--pool`)
  X-Borrowd-Class          `interactive` or `batch` (default batch; the router must set it
                           from the API key, never from the client)
  X-Borrowd-Request-Id     unique id of the request (batch; nginx: `$request_id`)
  X-Borrowd-Prompt-Tokens  prompt tokens, integer >= 0 (batch)
  X-Borrowd-Max-Tokens     requested max output tokens, integer >= 1 (batch; optional for
                           interactive, echoed back)
  X-Borrowd-Output-Tokens  output tokens generated (release only; absent = refund nothing)

Endpoints:
  /admit    2xx admit; 429 + Retry-After deny; 503 + Retry-After when Redis fails (batch is
            denied, fail closed); 400 naming the bad header. Response headers:
            X-Borrowd-Decision (admit|deny), X-Borrowd-Reason, X-Borrowd-Priority (vLLM
            priority to inject), X-Borrowd-Max-Tokens (clamped), X-Borrowd-Lease-Ms,
            X-Borrowd-Retry-After-Ms.
  /auth     the same decision for nginx `auth_request`, which only passes 2xx/401/403: every
            denial (budget or Redis) is a 403 carrying the same headers; nginx maps it to a
            429 with Retry-After (see README).
  /release  POST: free a finished request (200, JSON {released, refunded_tokens}).
  /renew    POST: extend a live request's lease (200, or 404 when it is not in flight).
  /healthz  200 while the service runs; the JSON body says whether Redis answers.
Interactive requests are admitted without any Redis call.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import redis
import redis.asyncio
import structlog
from aiohttp import web

from adapters.gate import BATCH_PRIORITY, DEFAULT_LEASE_MS, Admission, AsyncGate
from adapters.redis_conn import connect_async, redact_url
from models.errors import InputError

log = structlog.get_logger(__name__)

H_POOL = "X-Borrowd-Pool"
H_CLASS = "X-Borrowd-Class"
H_REQUEST_ID = "X-Borrowd-Request-Id"
H_PROMPT_TOKENS = "X-Borrowd-Prompt-Tokens"
H_MAX_TOKENS = "X-Borrowd-Max-Tokens"
H_OUTPUT_TOKENS = "X-Borrowd-Output-Tokens"
H_DECISION = "X-Borrowd-Decision"
H_REASON = "X-Borrowd-Reason"
H_PRIORITY = "X-Borrowd-Priority"
H_LEASE_MS = "X-Borrowd-Lease-Ms"
H_RETRY_AFTER_MS = "X-Borrowd-Retry-After-Ms"

CLASSES = ("interactive", "batch")
# Longest a decision may wait on Redis before batch is denied (never a hang).
DEFAULT_DECISION_TIMEOUT_S = 0.5
_REDIS_FAILURES = (redis.RedisError, OSError, asyncio.TimeoutError)


@dataclass(frozen=True)
class GateServiceConfig:
    """Settings of one `borrowd gate` process."""

    redis_url: str
    default_pool: str | None
    lease_ms: int = DEFAULT_LEASE_MS
    batch_priority: int = BATCH_PRIORITY
    decision_timeout_s: float = DEFAULT_DECISION_TIMEOUT_S


class HeaderError(InputError):
    """A request header is missing or malformed; the message names it."""


def _header(request: web.Request, name: str, default: str | None = None) -> str:
    value = request.headers.get(name, default)
    if value is None or value == "":
        raise HeaderError(f"missing header {name}")
    return value.strip()


def _int_header(request: web.Request, name: str, minimum: int,
                default: str | None = None) -> int:
    text = _header(request, name, default)
    try:
        value = int(text)
    except ValueError:
        raise HeaderError(f"header {name} must be an integer, got {text!r}") from None
    if value < minimum:
        raise HeaderError(f"header {name} must be >= {minimum}, got {value}")
    return value


def _bad_request(exc: HeaderError) -> web.Response:
    return web.Response(status=400, text=f"{exc}\n", headers={H_REASON: "bad_header"})


def _decision_headers(admission: Admission) -> dict[str, str]:
    headers = {
        H_DECISION: "admit" if admission.admitted else "deny",
        H_REASON: admission.reason,
        H_PRIORITY: str(admission.priority),
        H_LEASE_MS: str(admission.lease_ms),
    }
    if admission.admitted:
        if admission.max_output_tokens > 0:
            headers[H_MAX_TOKENS] = str(admission.max_output_tokens)
    else:
        retry_ms = max(1, math.ceil(admission.retry_after_s * 1000))
        headers[H_RETRY_AFTER_MS] = str(retry_ms)
        # HTTP Retry-After is whole seconds; round up so clients never retry too early.
        headers["Retry-After"] = str(max(1, math.ceil(retry_ms / 1000)))
    return headers


class GateService:
    """Request handlers around one asyncio Redis client and one `AsyncGate` per pool."""

    def __init__(self, client: redis.asyncio.Redis, config: GateServiceConfig) -> None:
        self.client = client
        self.config = config
        self._gates: dict[str, AsyncGate] = {}

    def gate(self, pool: str) -> AsyncGate:
        """The gate of `pool` (created on first use; raises HeaderError on a bad pool name)."""
        gate = self._gates.get(pool)
        if gate is None:
            try:
                gate = AsyncGate(self.client, pool, lease_ms=self.config.lease_ms,
                                 batch_priority=self.config.batch_priority)
            except InputError as exc:
                raise HeaderError(f"header {H_POOL}: {exc}") from None
            self._gates[pool] = gate
        return gate

    def _pool(self, request: web.Request) -> str:
        return _header(request, H_POOL, self.config.default_pool)

    async def decide(self, request: web.Request) -> Admission:
        """The admission for one request (HeaderError on bad headers)."""
        klass = request.headers.get(H_CLASS, "batch").strip().lower()
        if klass not in CLASSES:
            raise HeaderError(f"header {H_CLASS} must be interactive or batch, got {klass!r}")
        if klass == "interactive":
            # Never block interactive work, not even on a malformed optional header.
            try:
                max_tokens = _int_header(request, H_MAX_TOKENS, 1)
            except HeaderError:
                max_tokens = 0
            return Admission.interactive(max_tokens)
        gate = self.gate(self._pool(request))
        request_id = _header(request, H_REQUEST_ID)
        prompt_tokens = _int_header(request, H_PROMPT_TOKENS, 0)
        max_tokens = _int_header(request, H_MAX_TOKENS, 1)
        try:
            return await asyncio.wait_for(gate.admit(request_id, prompt_tokens, max_tokens),
                                          self.config.decision_timeout_s)
        except _REDIS_FAILURES as exc:
            log.warning("gate_redis_unavailable", pool=gate.pool, error=repr(exc))
            return Admission.unavailable()

    def _admit_handler(self, deny_status: Callable[[Admission], int]):
        async def handler(request: web.Request) -> web.Response:
            try:
                admission = await self.decide(request)
            except HeaderError as exc:
                return _bad_request(exc)
            status = 200 if admission.admitted else deny_status(admission)
            return web.Response(status=status, headers=_decision_headers(admission))
        return handler

    async def release(self, request: web.Request) -> web.Response:
        """POST /release: free a finished request and refund its unused output tokens."""
        try:
            gate = self.gate(self._pool(request))
            request_id = _header(request, H_REQUEST_ID)
            output = (_int_header(request, H_OUTPUT_TOKENS, 0)
                      if request.headers.get(H_OUTPUT_TOKENS) else None)
        except HeaderError as exc:
            return _bad_request(exc)
        try:
            refunded = await asyncio.wait_for(gate.release(request_id, output),
                                              self.config.decision_timeout_s)
        except _REDIS_FAILURES as exc:
            log.warning("gate_redis_unavailable", pool=gate.pool, error=repr(exc))
            return web.json_response({"error": "redis_unavailable"}, status=503,
                                     headers={H_REASON: "redis_unavailable"})
        return web.json_response({"released": refunded >= 0, "refunded_tokens": max(refunded, 0)})

    async def renew(self, request: web.Request) -> web.Response:
        """POST /renew: extend a live request's lease."""
        try:
            gate = self.gate(self._pool(request))
            request_id = _header(request, H_REQUEST_ID)
        except HeaderError as exc:
            return _bad_request(exc)
        try:
            renewed = await asyncio.wait_for(gate.renew(request_id),
                                             self.config.decision_timeout_s)
        except _REDIS_FAILURES as exc:
            log.warning("gate_redis_unavailable", pool=gate.pool, error=repr(exc))
            return web.json_response({"error": "redis_unavailable"}, status=503)
        return web.json_response({"renewed": renewed}, status=200 if renewed else 404)

    async def healthz(self, request: web.Request) -> web.Response:
        """GET /healthz: the service is up; says whether Redis answers a PING."""
        try:
            redis_ok = bool(await asyncio.wait_for(self.client.ping(),
                                                   self.config.decision_timeout_s))
        except _REDIS_FAILURES:
            redis_ok = False
        return web.json_response({"status": "ok", "redis": "up" if redis_ok else "down"})

    def routes(self) -> list[web.RouteDef]:
        """The service's routes."""
        return [
            web.route("*", "/admit", self._admit_handler(
                lambda a: 503 if a.reason == "redis_unavailable" else 429)),
            web.route("*", "/auth", self._admit_handler(lambda a: 403)),
            web.post("/release", self.release),
            web.post("/renew", self.renew),
            web.get("/healthz", self.healthz),
        ]


def make_app(config: GateServiceConfig,
             client: redis.asyncio.Redis | None = None) -> web.Application:
    """The aiohttp application; a client made here from `config.redis_url` is closed with it."""
    owned = client is None
    if client is None:
        client = connect_async(config.redis_url, connect_timeout_s=config.decision_timeout_s,
                               socket_timeout_s=config.decision_timeout_s)
    service = GateService(client, config)
    app = web.Application()
    app.router.add_routes(service.routes())

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        log.info("gate_started", redis=redact_url(config.redis_url), pool=config.default_pool)
        yield
        if owned:
            await client.aclose()

    app.cleanup_ctx.append(lifetime)
    return app


def run(config: GateServiceConfig, host: str, port: int) -> None:
    """Serve until SIGINT/SIGTERM."""
    web.run_app(make_app(config), host=host, port=port, print=None, access_log=None)
