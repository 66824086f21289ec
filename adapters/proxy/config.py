"""The proxy's configuration: one frozen tree loaded from TOML, validated at start-up.

Every error names the key at fault (`admission.mode`, `tenants.etl.class`, ...). Fields carry
their unit in the name and a one-line help text in their metadata; `describe_fields()` lists
them for the docs. Example: `examples/proxy.toml`.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from models.errors import ConfigError
from models.priority import BATCH_PRIORITY


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
    """A tenant: its name (for logs) and the class its API keys map to."""

    name: str
    request_class: RequestClass


@dataclass(frozen=True)
class AdmissionConfig:
    """How batch requests pass the gate."""

    mode: AdmissionMode = field(
        default=AdmissionMode.REJECT,
        metadata={"help": "reject: 429 + Retry-After at once; queue: wait up to the deadline"},
    )
    queue_max_wait_s: float = field(
        default=30.0, metadata={"help": "longest a queued batch request waits for admission, s"}
    )
    queue_max_depth: int = field(
        default=1000, metadata={"help": "most batch requests waiting at once (more get 429)"}
    )
    queue_poll_min_s: float = field(
        default=0.05, metadata={"help": "shortest pause between admission retries in queue, s"}
    )
    default_batch_max_tokens: int = field(
        default=1024, metadata={"help": "max_tokens reserved for a batch request without one"}
    )
    lease_ms: int = field(
        default=30_000,
        metadata={"help": "admission lease; the proxy renews it every lease_ms / 3, ms"},
    )
    gate_timeout_s: float = field(
        default=0.5, metadata={"help": "longest one gate call may take before failing closed, s"}
    )
    unavailable_retry_after_s: float = field(
        default=1.0, metadata={"help": "Retry-After sent when the budget store is unreachable, s"}
    )


@dataclass(frozen=True)
class ProxyConfig:
    """Everything `borrowd proxy` needs."""

    listen_host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    listen_port: int = field(default=8000, metadata={"help": "TCP port to listen on"})
    pool: str = field(default="default", metadata={"help": "pool name (budget keys, metrics)"})
    upstreams: tuple[str, ...] = field(
        default=(), metadata={"help": "vLLM base URLs (http://host:port), least outstanding"}
    )
    upstream_api_key: str | None = field(
        default=None, metadata={"help": "bearer key sent to the upstreams (vLLM --api-key)"}
    )
    redis_url: str | None = field(
        default=None,
        metadata={"help": "Redis URL of the budget store (else BORROWD_REDIS_URL, then local)"},
    )
    max_body_bytes: int = field(
        default=4 * 1024 * 1024, metadata={"help": "largest request body accepted, bytes"}
    )
    upstream_connect_timeout_s: float = field(
        default=5.0, metadata={"help": "connect timeout to an upstream, s"}
    )
    upstream_read_timeout_s: float = field(
        default=600.0, metadata={"help": "longest silence from an upstream mid-request, s"}
    )
    interactive_priority: int = field(
        default=0, metadata={"help": "vLLM priority injected for interactive (lower first)"}
    )
    batch_priority: int = field(
        default=BATCH_PRIORITY, metadata={"help": "vLLM priority injected for batch (lower first)"}
    )
    inject_priority: bool = field(
        default=True,
        metadata={"help": "inject `priority` (needs vLLM --scheduling-policy priority)"},
    )
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    tenants_by_key: Mapping[str, Tenant] = field(
        default_factory=lambda: MappingProxyType({}),
        metadata={"help": "API key -> tenant (from [tenants.NAME] keys = [...])"},
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
    return rows


def load_config(path: str | Path) -> ProxyConfig:
    """Read and validate a proxy TOML file; `ConfigError` names the file and the bad key."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"proxy config {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"proxy config {path} is not valid TOML: {exc}") from None
    try:
        return parse_config(data)
    except ConfigError as exc:
        raise ConfigError(f"proxy config {path}: {exc}") from None


def parse_config(data: Mapping[str, Any]) -> ProxyConfig:
    """Build a `ProxyConfig` from parsed TOML tables; `ConfigError` names the bad key."""
    _reject_unknown(data, {"proxy", "admission", "tenants"}, "")
    proxy = _table(data, "proxy")
    admission = _table(data, "admission")
    scalar_fields = {f.name: f for f in dataclasses.fields(ProxyConfig)
                     if f.name not in ("admission", "tenants_by_key")}
    _reject_unknown(proxy, set(scalar_fields), "proxy.")
    _reject_unknown(admission, {f.name for f in dataclasses.fields(AdmissionConfig)}, "admission.")

    kwargs: dict[str, Any] = {}
    for name, value in proxy.items():
        kwargs[name] = _coerce(f"proxy.{name}", value, scalar_fields[name])
    adm_fields = {f.name: f for f in dataclasses.fields(AdmissionConfig)}
    adm_kwargs = {name: _coerce(f"admission.{name}", value, adm_fields[name])
                  for name, value in admission.items()}
    kwargs["admission"] = AdmissionConfig(**adm_kwargs)
    kwargs["tenants_by_key"] = MappingProxyType(_tenants(data.get("tenants", {})))
    config = ProxyConfig(**kwargs)
    _validate(config)
    return config


def _table(data: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = data.get(name, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a table, got {type(value).__name__}")
    return value


def _reject_unknown(table: Mapping[str, Any], known: set[str], prefix: str) -> None:
    for key in table:
        if key not in known:
            raise ConfigError(f"unknown key {prefix}{key} (known: {', '.join(sorted(known))})")


def _coerce(key: str, value: Any, spec: dataclasses.Field) -> Any:
    kind = spec.type
    if kind in ("str", "str | None"):
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if kind == "tuple[str, ...]":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key} must be a list of strings, got {value!r}")
        return tuple(value)
    if kind == "AdmissionMode":
        try:
            return AdmissionMode(value)
        except ValueError:
            raise ConfigError(f"{key} must be one of reject, queue; got {value!r}") from None
    raise ConfigError(f"{key}: unsupported type {kind}")


def _tenants(table: Any) -> dict[str, Tenant]:
    if not isinstance(table, dict):
        raise ConfigError("tenants must be a table of [tenants.NAME] tables")
    by_key: dict[str, Tenant] = {}
    for name, spec in table.items():
        prefix = f"tenants.{name}"
        if not isinstance(spec, dict):
            raise ConfigError(f"{prefix} must be a table with keys and class")
        _reject_unknown(spec, {"keys", "class"}, f"{prefix}.")
        klass = spec.get("class")
        try:
            request_class = RequestClass(klass)
        except ValueError:
            raise ConfigError(
                f"{prefix}.class must be interactive or batch, got {klass!r}"
            ) from None
        keys = spec.get("keys")
        if not isinstance(keys, list) or not keys or not all(
            isinstance(k, str) and k for k in keys
        ):
            raise ConfigError(f"{prefix}.keys must be a non-empty list of non-empty strings")
        tenant = Tenant(name=name, request_class=request_class)
        for key in keys:
            if key in by_key:
                raise ConfigError(
                    f"{prefix}.keys: a key is already used by tenant {by_key[key].name}"
                )
            by_key[key] = tenant
    return by_key


def _validate(config: ProxyConfig) -> None:
    if not config.upstreams:
        raise ConfigError("proxy.upstreams must list at least one vLLM base URL")
    for url in config.upstreams:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"proxy.upstreams: {url!r} is not an http(s)://host:port URL")
    if not 0 < config.listen_port < 65536:
        raise ConfigError(f"proxy.listen_port must be 1-65535, got {config.listen_port}")
    if not config.pool or "{" in config.pool or "}" in config.pool:
        raise ConfigError(
            f"proxy.pool must be a non-empty name without braces, got {config.pool!r}"
        )
    positive = {
        "proxy.max_body_bytes": config.max_body_bytes,
        "proxy.upstream_connect_timeout_s": config.upstream_connect_timeout_s,
        "proxy.upstream_read_timeout_s": config.upstream_read_timeout_s,
        "admission.queue_max_wait_s": config.admission.queue_max_wait_s,
        "admission.queue_max_depth": config.admission.queue_max_depth,
        "admission.queue_poll_min_s": config.admission.queue_poll_min_s,
        "admission.default_batch_max_tokens": config.admission.default_batch_max_tokens,
        "admission.gate_timeout_s": config.admission.gate_timeout_s,
        "admission.lease_ms": config.admission.lease_ms,
        "admission.unavailable_retry_after_s": config.admission.unavailable_retry_after_s,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key} must be > 0, got {value!r}")
    if not config.tenants_by_key:
        raise ConfigError("tenants: define at least one [tenants.NAME] with keys and class")
