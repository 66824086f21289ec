"""`borrowd gate`: the admission gate as an HTTP service that a real router calls per request.

Access control: callers authenticate with a shared secret (`X-Borrowd-Gate-Secret`, compared
in constant time; configured `[[gate.callers]]` or `BORROWD_GATE_SECRET`), and every request
id lives in its caller's namespace, so one caller can neither release nor renew another's
lease. Only the configured pools are served (no state is kept for any other name). Without a
secret the gate serves only on a loopback address, and says so in its log. Configured from
TOML (`borrowd gate --config FILE`, one `[gate]` table) through the one config loader, or
from flags.

Request headers (case-insensitive):
  X-Borrowd-Gate-Secret    the caller's shared secret (401 when missing or wrong)
  X-Borrowd-Pool           pool name (default: the first configured pool; others: 403)
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
            X-Borrowd-Retry-After-Ms. A retried id with another prompt is denied
            (`duplicate_mismatch`).
  /auth     the same decision for nginx `auth_request`, which only passes 2xx/401/403: every
            denial (budget or Redis) is a 403 carrying the same headers; nginx maps it to a
            429 with Retry-After (see deploy/nginx/).
  /release  POST: free a finished request (200, JSON {released, refunded_tokens}).
  /renew    POST: extend a live request's lease (200, or 404 when it is not in flight).
  /healthz  200 while the service runs (no secret needed); the JSON body says whether Redis
            answers.
Interactive requests are admitted without any Redis call.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import math
import os
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import redis.asyncio
import structlog
from aiohttp import web
from borrowd.adapters.gate import BATCH_PRIORITY, DEFAULT_LEASE_MS, Admission, AsyncGate
from borrowd.adapters.redis_conn import connect_async, redact_url, resolve_redis_url
from borrowd.models.config_loader import build_dataclass, load_toml, meta, reject_unknown
from borrowd.models.errors import ConfigError, InputError
from borrowd.models.priority import INTERACTIVE_PRIORITY

log = structlog.get_logger(__name__)

H_SECRET = "X-Borrowd-Gate-Secret"
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
DEFAULT_LISTEN = "127.0.0.1:8089"
# Environment variable holding the secret of the one caller when none is configured.
SECRET_ENV = "BORROWD_GATE_SECRET"
MIN_SECRET_CHARS = 16
# Longest request id kept in Redis (ids are the caller's; bound what one may store).
MAX_REQUEST_ID_CHARS = 200
NAME = r"^[A-Za-z0-9_.-]{1,64}$"
LISTEN = r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})$"
ANONYMOUS = "anonymous"
_REDIS_FAILURES = (redis.RedisError, OSError, asyncio.TimeoutError)


@dataclass(frozen=True)
class GateCaller:
    """A router allowed to call the gate: its name (its request ids are its own) and secret."""

    name: str = field(metadata=meta("name", "caller name; its request ids are its own",
                                    pattern=NAME, example="nginx"))
    secret: str = field(
        metadata=meta("secret", f"shared secret the caller sends in {H_SECRET} "
                      f"(>= {MIN_SECRET_CHARS} characters)", example="change-me-0123456789"),
        repr=False,
    )

    def __post_init__(self) -> None:
        if len(self.secret) < MIN_SECRET_CHARS:
            raise ConfigError(f"callers: the secret of {self.name!r} is shorter than "
                              f"{MIN_SECRET_CHARS} characters")


@dataclass(frozen=True)
class GateServiceConfig:
    """Settings of one `borrowd gate` process (the `[gate]` table)."""

    pools: tuple[str, ...] = field(
        metadata=meta("names", "pools served; the first is the default (others get 403)",
                      pattern=NAME, example=("chat-8b",)),
    )
    listen: str = field(
        default=DEFAULT_LISTEN,
        metadata=meta("host:port", "address to serve on; every interface is 0.0.0.0:PORT "
                      "and needs callers", pattern=LISTEN,
                      pattern_help="HOST:PORT with the host written out"),
    )
    redis_url: str = field(
        default="",
        metadata=meta("URL", "Redis URL ('' = $BORROWD_REDIS_URL, then local)"),
    )
    lease_ms: int = field(
        default=DEFAULT_LEASE_MS,
        metadata=meta("ms", "admission lease unless renewed", min=100, max=3_600_000),
    )
    batch_priority: int = field(
        default=BATCH_PRIORITY,
        metadata=meta("priority", "vLLM priority injected for batch (above interactive's)",
                      gt=INTERACTIVE_PRIORITY),
    )
    decision_timeout_s: float = field(
        default=DEFAULT_DECISION_TIMEOUT_S,
        metadata=meta("s", "longest wait on Redis before batch is denied", gt=0.0, max=10.0),
    )
    callers: tuple[GateCaller, ...] = field(
        default=(),
        metadata=meta("array", f"callers and their secrets (none: ${SECRET_ENV}, else "
                      "loopback only, unauthenticated)"),
    )

    def __post_init__(self) -> None:
        if not self.pools:
            raise ConfigError("pools: name at least one pool")
        for values, what in ((self.pools, "pool"),
                             ([c.name for c in self.callers], "caller name"),
                             ([c.secret for c in self.callers], "caller secret")):
            if len(set(values)) != len(values):
                raise ConfigError(f"a {what} appears more than once")
        if not self.callers and not _loopback(self.listen):
            raise ConfigError(
                f"listen = {self.listen!r} is not a loopback address: configure callers "
                f"(or set {SECRET_ENV}) so that only routers can admit batch work"
            )

    @property
    def default_pool(self) -> str:
        """The pool of a request without X-Borrowd-Pool."""
        return self.pools[0]

    def host_port(self) -> tuple[str, int]:
        """`listen` as (host, port)."""
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]"), int(port)


def _loopback(listen: str) -> bool:
    host = listen.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def gate_config(data: Mapping[str, Any], environ: Mapping[str, str] | None = None
                ) -> GateServiceConfig:
    """The gate's config from parsed TOML (`{"gate": {...}}`) through the one config loader;
    without configured callers, `$BORROWD_GATE_SECRET` (if set) is the one caller's secret."""
    reject_unknown(data, {"gate"}, "")
    table = dict(data.get("gate", {}))
    secret = (os.environ if environ is None else environ).get(SECRET_ENV, "")
    if secret and not table.get("callers"):
        table["callers"] = [{"name": "router", "secret": secret}]
    return build_dataclass(GateServiceConfig, table, "gate")


def load_gate_config(path: str | Path, environ: Mapping[str, str] | None = None
                     ) -> GateServiceConfig:
    """`gate_config` of the TOML file at `path`; ConfigError names the file and the key."""
    data = load_toml(path, "gate config")
    try:
        return gate_config(data, environ)
    except ConfigError as exc:
        raise ConfigError(f"gate config {path}: {exc}") from None


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


def _forbidden(exc: Forbidden) -> web.Response:
    return web.Response(status=exc.status, text=f"{exc}\n", headers={H_REASON: exc.reason})


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


class Forbidden(InputError):
    """The caller may not do this (bad secret: 401; a pool not served: 403)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


class GateService:
    """Request handlers around one asyncio Redis client and one `AsyncGate` per served pool."""

    def __init__(self, client: redis.asyncio.Redis, config: GateServiceConfig) -> None:
        self.client = client
        self.config = config
        self._gates = {pool: AsyncGate(client, pool, lease_ms=config.lease_ms,
                                       batch_priority=config.batch_priority)
                       for pool in config.pools}
        self._secrets = [(c.name, c.secret.encode()) for c in config.callers]

    def caller(self, request: web.Request) -> str:
        """The authenticated caller's name (Forbidden 401 when the secret does not match)."""
        if not self._secrets:
            return ANONYMOUS
        presented = request.headers.get(H_SECRET, "").encode()
        found = ""
        for name, secret in self._secrets:
            # Compare with every secret, so the time taken does not say which one matched.
            if hmac.compare_digest(presented, secret):
                found = name
        if not found:
            raise Forbidden(401, "unauthenticated", f"missing or wrong {H_SECRET}")
        return found

    def gate(self, pool: str) -> AsyncGate:
        """The gate of a served `pool` (Forbidden 403 for any other name)."""
        gate = self._gates.get(pool)
        if gate is None:
            raise Forbidden(403, "pool_not_served", f"pool {pool[:64]!r} is not served here")
        return gate

    def _pool(self, request: web.Request) -> str:
        return _header(request, H_POOL, self.config.default_pool)

    def _request_id(self, request: web.Request, caller: str) -> str:
        request_id = _header(request, H_REQUEST_ID)
        if len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isprintable():
            raise HeaderError(f"header {H_REQUEST_ID} must be at most {MAX_REQUEST_ID_CHARS} "
                              "printable characters")
        return f"{caller}/{request_id}"

    async def decide(self, request: web.Request) -> Admission:
        """The admission for one request (HeaderError on bad headers, Forbidden on access)."""
        caller = self.caller(request)
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
        request_id = self._request_id(request, caller)
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
            except Forbidden as exc:
                return _forbidden(exc)
            status = 200 if admission.admitted else deny_status(admission)
            return web.Response(status=status, headers=_decision_headers(admission))
        return handler

    async def release(self, request: web.Request) -> web.Response:
        """POST /release: free a finished request and refund its unused output tokens."""
        try:
            caller = self.caller(request)
            gate = self.gate(self._pool(request))
            request_id = self._request_id(request, caller)
            output = (_int_header(request, H_OUTPUT_TOKENS, 0)
                      if request.headers.get(H_OUTPUT_TOKENS) else None)
        except HeaderError as exc:
            return _bad_request(exc)
        except Forbidden as exc:
            return _forbidden(exc)
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
            caller = self.caller(request)
            gate = self.gate(self._pool(request))
            request_id = self._request_id(request, caller)
        except HeaderError as exc:
            return _bad_request(exc)
        except Forbidden as exc:
            return _forbidden(exc)
        try:
            renewed = await asyncio.wait_for(gate.renew(request_id),
                                             self.config.decision_timeout_s)
        except _REDIS_FAILURES as exc:
            log.warning("gate_redis_unavailable", pool=gate.pool, error=repr(exc))
            return web.json_response({"error": "redis_unavailable"}, status=503)
        return web.json_response({"renewed": renewed}, status=200 if renewed else 404)

    async def healthz(self, request: web.Request) -> web.Response:
        """GET /healthz: the service is up; says whether Redis serves each pool's keys (a read
        of the pool's budget key, so a node that does not own the pool's slot is `down`)."""
        pools = {}
        for pool, gate in self._gates.items():
            try:
                await asyncio.wait_for(self.client.exists(gate.keys.budget),
                                       self.config.decision_timeout_s)
                pools[pool] = "up"
            except _REDIS_FAILURES as exc:
                pools[pool] = f"down: {type(exc).__name__}"
        redis_ok = all(state == "up" for state in pools.values())
        return web.json_response({"status": "ok", "redis": "up" if redis_ok else "down",
                                  "pools": pools})

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
    url = resolve_redis_url(config.redis_url or None)
    if client is None:
        client = connect_async(url, connect_timeout_s=config.decision_timeout_s,
                               socket_timeout_s=config.decision_timeout_s)
    service = GateService(client, config)
    app = web.Application()
    app.router.add_routes(service.routes())

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        log.info("gate_started", redis=redact_url(url), pools=list(config.pools),
                 callers=[c.name for c in config.callers], listen=config.listen)
        if not config.callers:
            log.warning("gate_unauthenticated", listen=config.listen,
                        detail=f"no callers and no {SECRET_ENV}: any local process can admit")
        yield
        if owned:
            await client.aclose()

    app.cleanup_ctx.append(lifetime)
    return app


def run(config: GateServiceConfig) -> None:
    """Serve on `config.listen` until SIGINT/SIGTERM."""
    host, port = config.host_port()
    web.run_app(make_app(config), host=host, port=port, print=None, access_log=None)
