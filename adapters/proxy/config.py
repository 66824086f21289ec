"""The proxy's configuration: one frozen tree loaded from TOML, validated at start-up.

Loaded through the one config loader of every borrowd process (`models.config_loader`): every
error is one line naming the key at fault and its value (`admission.mode`, `tenants.etl.class`,
...); numbers are finite and bounded by their field metadata (unit, one-line help, bounds);
`describe_fields()` lists them for the docs. Example: `examples/proxy.toml`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from borrowd.models.config_loader import (
    build_dataclass,
    construct,
    field_values,
    load_toml,
    meta,
    reject_unknown,
)
from borrowd.models.errors import ConfigError
from borrowd.models.priority import BATCH_PRIORITY, INTERACTIVE_PRIORITY


class RequestClass(StrEnum):
    """Traffic class of a request; decides priority, gating and revocation."""

    INTERACTIVE = "interactive"
    BATCH = "batch"


class AdmissionMode(StrEnum):
    """What the proxy does with a batch request the gate denies."""

    REJECT = "reject"
    QUEUE = "queue"


@dataclass(frozen=True)
class Tenant:
    """A tenant: its name (for logs), the class its API keys map to, and whether its revoked
    batch requests end with the resumable `preempted` finish reason (opt-in)."""

    name: str
    request_class: RequestClass
    resumable: bool = False


@dataclass(frozen=True)
class AdmissionConfig:
    """How batch requests pass the gate."""

    mode: AdmissionMode = field(
        default=AdmissionMode.REJECT,
        metadata=meta("reject|queue",
                      "reject: 429 + Retry-After at once; queue: wait up to the deadline"),
    )
    queue_max_wait_s: float = field(
        default=30.0,
        metadata=meta("s", "longest a queued batch request waits for admission", gt=0.0),
    )
    queue_max_depth: int = field(
        default=1000,
        metadata=meta("requests", "most batch requests waiting at once (more get 429)", min=1),
    )
    queue_poll_min_s: float = field(
        default=0.05,
        metadata=meta("s", "shortest pause between admission retries in queue", gt=0.0),
    )
    default_batch_max_tokens: int = field(
        default=1024,
        metadata=meta("tokens", "max_tokens reserved for a batch request without one", min=1),
    )
    lease_ms: int = field(
        default=30_000,
        metadata=meta("ms", "admission lease; the proxy renews it every lease_ms / 3", min=1),
    )
    gate_timeout_s: float = field(
        default=0.5,
        metadata=meta("s", "longest one gate call may take before failing closed", gt=0.0),
    )
    unavailable_retry_after_s: float = field(
        default=1.0,
        metadata=meta("s", "Retry-After sent when the budget store is unreachable", gt=0.0),
    )


@dataclass(frozen=True)
class ProxyConfig:
    """Everything `borrowd proxy` needs."""

    listen_host: str = field(default="127.0.0.1", metadata=meta("host", "address to listen on"))
    listen_port: int = field(
        default=8000, metadata=meta("port", "TCP port to listen on", min=1, max=65535)
    )
    pool: str = field(
        default="default",
        metadata=meta("name", "pool name (budget keys, metrics)", pattern=r"^[^{}\s]+$",
                      pattern_help="a non-empty name without braces or spaces"),
    )
    upstreams: tuple[str, ...] = field(
        default=(), metadata=meta("URLs", "vLLM base URLs (http://host:port), least outstanding")
    )
    batch_upstreams: tuple[str, ...] = field(
        default=(),
        metadata=meta("URLs", "the upstreams that may take batch, each one of `upstreams` "
                      "(empty: all); interactive keeps using every upstream"),
    )
    slo_ttft_s: tuple[float, ...] = field(
        default=(),
        metadata=meta("s", "the pool's p95 TTFT SLO (the daemon's slo_ttft_p95_s; several while "
                      "changing it): each is a bound of borrowd_proxy_ttft_seconds, where the "
                      "daemon reads its burn (vLLM's bounds hold 1 s, the default)", gt=0.0),
    )
    slo_itl_s: tuple[float, ...] = field(
        default=(),
        metadata=meta("s", "the pool's p95 ITL SLO (the daemon's slo_itl_p95_s; several while "
                      "changing it): each is a bound of borrowd_proxy_itl_seconds, where the "
                      "daemon reads its burn (vLLM's bounds hold 50 ms, the default)", gt=0.0),
    )
    upstream_api_key: str | None = field(
        default=None, metadata=meta("key", "bearer key sent to the upstreams (vLLM --api-key)")
    )
    redis_url: str | None = field(
        default=None,
        metadata=meta("URL", "Redis URL of the budget store (else BORROWD_REDIS_URL, then local)"),
    )
    max_body_bytes: int = field(
        default=4 * 1024 * 1024, metadata=meta("bytes", "largest request body accepted", min=1)
    )
    upstream_connect_timeout_s: float = field(
        default=5.0, metadata=meta("s", "connect timeout to an upstream", gt=0.0)
    )
    upstream_read_timeout_s: float = field(
        default=600.0, metadata=meta("s", "longest silence from an upstream mid-request", gt=0.0)
    )
    interactive_priority: int = field(
        default=INTERACTIVE_PRIORITY,
        metadata=meta("priority", "vLLM priority injected for interactive (lower first)"),
    )
    batch_priority: int = field(
        default=BATCH_PRIORITY,
        metadata=meta("priority", "vLLM priority injected for batch (lower first; must be "
                      "above interactive_priority)"),
    )
    inject_priority: bool = field(
        default=True,
        metadata=meta("bool", "inject `priority` (needs vLLM --scheduling-policy priority)"),
    )
    tokenizer_path: str | None = field(
        default=None,
        metadata=meta("path", "the model's tokenizer.json to count batch prompts with (else "
                      "UTF-8 bytes, an upper bound)"),
    )
    media_part_tokens: int = field(
        default=2048,
        metadata=meta("tokens", "prompt tokens charged per image, audio or video part", min=0),
    )
    max_header_bytes: int = field(
        default=65_536,
        metadata=meta("bytes", "largest request line + headers (more: 431)", min=1024),
    )
    max_headers: int = field(
        default=100, metadata=meta("fields", "most header fields per request (more: 431)", min=8)
    )
    header_timeout_s: float = field(
        default=10.0, metadata=meta("s", "longest a client may take to send its headers",
                                    gt=0.0)
    )
    body_timeout_s: float = field(
        default=60.0, metadata=meta("s", "longest a client may take to send its body", gt=0.0)
    )
    idle_timeout_s: float = field(
        default=60.0, metadata=meta("s", "how long an idle keep-alive connection stays open",
                                    gt=0.0)
    )
    max_connections: int = field(
        default=1024,
        metadata=meta("connections", "open client connections (idle ones are closed to make "
                      "room; about 2 file descriptors each with the upstream's)", min=2),
    )
    interactive_reserved_connections: int = field(
        default=64,
        metadata=meta("connections", "connections batch requests may not use (503 for batch "
                      "past max_connections minus these)", min=0),
    )
    shutdown_timeout_s: float = field(
        default=5.0,
        metadata=meta("s", "on SIGTERM, how long interactive requests may finish (batch ends "
                      "at once, resumably)", gt=0.0),
    )
    admission: AdmissionConfig = field(
        default_factory=AdmissionConfig, metadata=meta("table", "how batch passes the gate")
    )
    tenants_by_key: Mapping[str, Tenant] = field(
        default_factory=lambda: MappingProxyType({}),
        metadata=meta("table", "API key -> tenant (from [tenants.NAME] keys = [...])"),
    )


def describe_fields() -> list[tuple[str, str]]:
    """(TOML key, help text) of every field, for docs and `--help`."""
    rows = [(f"proxy.{f.name}", f.metadata.get("help", ""))
            for f in dataclasses.fields(ProxyConfig)
            if f.name not in ("admission", "tenants_by_key")]
    rows += [(f"admission.{f.name}", f.metadata["help"])
             for f in dataclasses.fields(AdmissionConfig)]
    rows.append(("tenants.NAME.keys", "API keys of tenant NAME"))
    rows.append(("tenants.NAME.class", "interactive | batch"))
    rows.append(("tenants.NAME.resumable", "end revoked batch requests with finish_reason "
                 "preempted (default false: an error event, or 503 + Retry-After)"))
    return rows


def load_config(path: str | Path) -> ProxyConfig:
    """Read and validate a proxy TOML file; `ConfigError` names the file and the bad key."""
    data = load_toml(path, "proxy config")
    try:
        return parse_config(data)
    except ConfigError as exc:
        raise ConfigError(f"proxy config {path}: {exc}") from None


_SECTIONS = frozenset({"proxy", "admission", "tenants"})
_NOT_IN_PROXY_TABLE = frozenset({"admission", "tenants_by_key"})


def parse_config(data: Mapping[str, Any]) -> ProxyConfig:
    """Build a `ProxyConfig` from parsed TOML tables (through the one config loader,
    `models.config_loader`); `ConfigError` names the bad key and value."""
    reject_unknown(data, _SECTIONS, "")
    values = field_values(ProxyConfig, data.get("proxy", {}), "proxy", skip=_NOT_IN_PROXY_TABLE)
    values["admission"] = build_dataclass(AdmissionConfig, data.get("admission", {}), "admission")
    values["tenants_by_key"] = MappingProxyType(_tenants(data.get("tenants", {})))
    config = construct(ProxyConfig, values, "proxy")
    _validate(config)
    return config


def _tenants(table: Any) -> dict[str, Tenant]:
    if not isinstance(table, dict):
        raise ConfigError("tenants: must be a table of [tenants.NAME] tables")
    by_key: dict[str, Tenant] = {}
    for name, spec in table.items():
        prefix = f"tenants.{name}"
        if not isinstance(spec, dict):
            raise ConfigError(f"{prefix}: must be a table with keys and class")
        reject_unknown(spec, {"keys", "class", "resumable"}, prefix)
        klass = spec.get("class", "")
        try:
            request_class = RequestClass(klass)
        except ValueError:
            raise ConfigError(
                f"{prefix}.class: bad value {klass!r} (one of 'interactive', 'batch')"
            ) from None
        keys = spec.get("keys")
        if not isinstance(keys, list) or not keys or not all(
            isinstance(k, str) and k for k in keys
        ):
            raise ConfigError(f"{prefix}.keys: must be a non-empty list of non-empty strings")
        resumable = spec.get("resumable", False)
        if not isinstance(resumable, bool):
            raise ConfigError(f"{prefix}.resumable: must be true or false, got {resumable!r}")
        tenant = Tenant(name=name, request_class=request_class, resumable=resumable)
        for key in keys:
            if key in by_key:
                raise ConfigError(
                    f"{prefix}.keys: a key is already used by tenant {by_key[key].name}"
                )
            by_key[key] = tenant
    return by_key


def _validate(config: ProxyConfig) -> None:
    if not config.upstreams:
        raise ConfigError("proxy.upstreams: must list at least one vLLM base URL")
    for index, url in enumerate(config.upstreams):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(
                f"proxy.upstreams[{index}]: bad value {url!r} (an http(s)://host:port URL)"
            )
    known = {url.rstrip("/") for url in config.upstreams}
    for index, url in enumerate(config.batch_upstreams):
        if url.rstrip("/") not in known:
            raise ConfigError(
                f"proxy.batch_upstreams[{index}]: {url!r} is not one of proxy.upstreams"
            )
    if len({url.rstrip("/") for url in config.batch_upstreams}) < len(config.batch_upstreams):
        raise ConfigError("proxy.batch_upstreams: names an upstream more than once")
    if config.batch_priority <= config.interactive_priority:
        raise ConfigError(
            f"proxy.batch_priority: {config.batch_priority} must be above "
            f"proxy.interactive_priority ({config.interactive_priority}): vLLM serves lower "
            "priorities first, so batch would run ahead of interactive"
        )
    if config.interactive_reserved_connections >= config.max_connections:
        raise ConfigError(
            f"proxy.interactive_reserved_connections: {config.interactive_reserved_connections}"
            f" must be below proxy.max_connections ({config.max_connections})"
        )
    if not config.tenants_by_key:
        raise ConfigError("tenants: define at least one [tenants.NAME] with keys and class")
