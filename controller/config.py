"""The daemon's configuration: one typed tree of frozen dataclasses, loaded from TOML.

Sections: `daemon` (metrics listener, log level, holder id), `redis` (URL: plain, TLS or
Sentinel), `prometheus` (URL, timeout, rule window) and `[[pools]]` (name, leases, plant, and
the controller's own tree from `controller.policy`: tick, SLOs, law, supervisor, caps). Every
field carries its unit and a one-line help text in its metadata; validation errors, the
documented example
(`borrowd config example`) and the environment overrides (`BORROWD_<SECTION>_<KEY>` for the
scalar keys of `daemon`, `redis` and `prometheus`) all come from those same fields.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import re
import socket
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from borrowd.controller.policy import ControllerConfig
from borrowd.models.config_loader import build_dataclass, load_toml, meta
from borrowd.models.errors import ConfigError, InputError

ENV_PREFIX = "BORROWD_"
ENV_SECTIONS = ("daemon", "redis", "prometheus")
LOG_LEVELS = ("debug", "info", "warning", "error")
POOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# The windows deploy/prometheus/borrowd.rules.yml records (groups borrowd-15s, borrowd-1m): a
# window without its rules would leave every query empty and the daemon in failsafe.
RULE_WINDOWS = ("15s", "1m")
# The host is required: binding every interface must be written out ("0.0.0.0:9105").
HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})$")


@dataclass(frozen=True)
class DaemonConfig:
    """The daemon process: its own metrics endpoint, logging and leader identity."""

    metrics_listen: str = field(
        default="127.0.0.1:9105",
        metadata=meta("host:port", "where the daemon serves its own /metrics ('' disables)",
                      pattern=HOST_PORT.pattern, allow_empty=True,
                      pattern_help="HOST:PORT with the host written out; every interface is "
                      "0.0.0.0:PORT, loopback 127.0.0.1:PORT"),
    )
    log_level: str = field(
        default="info", metadata=meta("level", "least severe log level written", choices=LOG_LEVELS)
    )
    holder_id: str = field(
        default="",
        metadata=meta("id", "this replica's name in leader election ('' = hostname:pid)"),
    )

    def resolved_holder_id(self) -> str:
        """`holder_id`, or hostname:pid when it is empty."""
        return self.holder_id or f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True)
class RedisConfig:
    """Where budgets are published (`redis://`, `rediss://` for TLS, `redis+sentinel://`,
    `redis+cluster://`)."""

    url: str = field(
        default="redis://127.0.0.1:6379/0",
        metadata=meta(
            "URL",
            "Redis URL; put a password in BORROWD_REDIS_URL (environment file), not here",
            pattern=r"^(redis|rediss|unix|rediss?\+sentinel|rediss?\+cluster)://",
        ),
    )
    connect_timeout_s: float = field(
        default=1.0, metadata=meta("s", "TCP connect timeout to Redis", min=0.01, max=30.0)
    )
    socket_timeout_s: float = field(
        default=1.0, metadata=meta("s", "timeout of one Redis command", min=0.01, max=30.0)
    )


@dataclass(frozen=True)
class PrometheusConfig:
    """Where the signals come from: Prometheus with borrowd's recording rules loaded."""

    url: str = field(
        default="http://127.0.0.1:9090",
        metadata=meta("URL", "Prometheus base URL", pattern=r"^https?://"),
    )
    timeout_s: float = field(
        default=0.5,
        metadata=meta("s", "timeout of one query; a query is tried once", min=0.01, max=30.0),
    )
    window: str = field(
        default="15s",
        metadata=meta(
            "duration",
            "window of the recording rules read (15s needs scrape <= 5 s, 1m needs <= 15 s)",
            pattern=f"^({'|'.join(RULE_WINDOWS)})$",
            pattern_help=f"deploy/prometheus/borrowd.rules.yml records only the windows "
            f"{' and '.join(RULE_WINDOWS)}: no rule pool_class:borrowd_proxy_ttft_seconds:"
            "p95_rate<window> (and the others the daemon reads) exists for another",
        ),
    )


@dataclass(frozen=True)
class PoolConfig:
    """One pool: the fleet one budget governs, its leases, and its controller (tick, SLOs)."""

    name: str = field(
        metadata=meta("name", "pool name (Redis keys, metric label `pool`)",
                      pattern=POOL_NAME.pattern, example="chat"),
    )
    leader_lease_ms: int = field(
        default=5000,
        metadata=meta("ms", "leader lease; a dead leader is replaced after at most this",
                      min=100, max=600_000),
    )
    budget_ttl_ms: int = field(
        default=5000,
        metadata=meta("ms", "lease of each published budget; adapters close batch after it",
                      min=100, max=600_000),
    )
    plant_file: str = field(
        default="",
        metadata=meta("path", "plant.json from `borrowd identify` ('' = the controller's default)"),
    )
    replicas: int = field(
        default=0,
        metadata=meta("replicas", "engine replicas serving the pool: u_max, the ramp cap and "
                      "the sequence cap scale by replicas / controller.limits_replicas (0: they "
                      "stand as written)", min=0, max=100_000),
    )
    batch_replicas: int = field(
        default=0,
        metadata=meta("replicas", "how many of them may take batch (0: all; name them in the "
                      "proxy's batch_upstreams and each engine's BORROWD_BATCH_ELIGIBLE); u_max, "
                      "the ramp cap and the sequence and KV caps scale by batch_replicas / "
                      "replicas", min=0, max=100_000),
    )
    controller: ControllerConfig = field(
        default_factory=ControllerConfig,
        metadata=meta("table", "the controller: tick, SLOs, law, gains, supervisor, caps"),
    )

    @property
    def tick_s(self) -> float:
        """The pool's control period (the controller's `tick_s`)."""
        return self.controller.tick_s

    def batch_share(self) -> float:
        """Share of the pool's replicas that may take batch (1 when not restricted)."""
        if self.replicas <= 0 or self.batch_replicas <= 0:
            return 1.0
        return self.batch_replicas / self.replicas


@dataclass(frozen=True)
class BorrowdConfig:
    """The whole daemon configuration."""

    daemon: DaemonConfig = field(
        default_factory=DaemonConfig, metadata=meta("table", "the daemon process")
    )
    redis: RedisConfig = field(
        default_factory=RedisConfig, metadata=meta("table", "budget store")
    )
    prometheus: PrometheusConfig = field(
        default_factory=PrometheusConfig, metadata=meta("table", "signal source")
    )
    pools: tuple[PoolConfig, ...] = field(
        default=(), metadata=meta("array", "pools this daemon controls, one [[pools]] each")
    )

    def __post_init__(self) -> None:
        if not self.pools:
            raise ConfigError("pools: at least one [[pools]] table is required")
        names = [pool.name for pool in self.pools]
        for name in names:
            if names.count(name) > 1:
                raise ConfigError(f"pools: pool name {name!r} appears more than once")
        for index, pool in enumerate(self.pools):
            if pool.batch_replicas > 0 and pool.replicas == 0:
                raise ConfigError(
                    f"pools[{index}].batch_replicas = {pool.batch_replicas}: needs "
                    f"pools[{index}].replicas (the pool's replica count) to size the caps by"
                )
            if pool.batch_replicas > pool.replicas:
                raise ConfigError(
                    f"pools[{index}].batch_replicas = {pool.batch_replicas}: more than the "
                    f"pool's replicas ({pool.replicas})"
                )
            if pool.budget_ttl_ms < 2 * pool.tick_s * 1000:
                raise ConfigError(
                    f"pools[{index}].budget_ttl_ms = {pool.budget_ttl_ms}: must cover at least "
                    f"two ticks ({2 * pool.tick_s * 1000:.0f} ms) so one slow tick does not "
                    "close batch"
                )
            if pool.leader_lease_ms < 2 * pool.tick_s * 1000:
                raise ConfigError(
                    f"pools[{index}].leader_lease_ms = {pool.leader_lease_ms}: must cover at "
                    f"least two ticks ({2 * pool.tick_s * 1000:.0f} ms), renewal happens once a "
                    "tick"
                )


    def pool_named(self, name: str | None) -> PoolConfig:
        """The pool `name` (None: the only pool); InputError naming the pools there when it
        is absent, or when None is given and there are several."""
        names = ", ".join(pool.name for pool in self.pools)
        if name is None:
            if len(self.pools) > 1:
                raise InputError(f"--pool is needed: the config has pools {names}")
            return self.pools[0]
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise InputError(f"--pool {name!r} is not in the config (pools: {names})")


# ---------------------------------------------------------------------------------------------
# Loading: TOML tables -> dataclasses, with every error naming the key path and the value.


def load_config(path: str | Path, environ: Mapping[str, str] | None = None) -> BorrowdConfig:
    """Read, override from the environment, and validate the config at `path`."""
    data = load_toml(path)
    try:
        return config_from_mapping(data, os.environ if environ is None else environ)
    except ConfigError as exc:
        raise ConfigError(f"config file {path}: {exc}") from None


def config_from_mapping(
    data: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> BorrowdConfig:
    """Build and validate the config from parsed TOML plus environment overrides."""
    merged = apply_env_overrides(data, environ or {})
    return build_dataclass(BorrowdConfig, merged, "")


def apply_env_overrides(data: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """`data` with `BORROWD_<SECTION>_<KEY>` values applied (parsed by the field's type)."""
    merged = {key: (dict(value) if isinstance(value, Mapping) else value)
              for key, value in data.items()}
    hints = typing.get_type_hints(BorrowdConfig)
    for section in ENV_SECTIONS:
        section_cls = hints[section]
        section_hints = typing.get_type_hints(section_cls)
        for item in dataclasses.fields(section_cls):
            name = f"{ENV_PREFIX}{section.upper()}_{item.name.upper()}"
            if name not in environ:
                continue
            text = environ[name]
            value = _parse_env_value(text, section_hints[item.name], name)
            table = merged.setdefault(section, {})
            if not isinstance(table, dict):
                raise ConfigError(f"{section}: must be a table, got {table!r}")
            table[item.name] = value
    return merged


def _parse_env_value(text: str, kind: Any, name: str) -> Any:
    if kind is str:
        return text
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        raise ConfigError(
            f"environment {name} = {text!r} is not a valid {getattr(kind, '__name__', kind)}"
        ) from None


# ---------------------------------------------------------------------------------------------
# The documented example, generated from the same fields.


def example_config(pool_example: str = "chat") -> str:
    """The documented example config: every field with its help, unit and default."""
    lines = [
        "# borrowd daemon configuration (`borrowd run --config FILE`).",
        "# Generated by `borrowd config example` from the config's own field metadata:",
        "# each key shows its default; `# help [unit]` above it says what it means.",
        f"# Scalar keys of {', '.join(ENV_SECTIONS)} can be overridden from the environment as",
        "# BORROWD_<SECTION>_<KEY>, e.g. BORROWD_REDIS_URL (keep secrets there, not here).",
        "",
    ]
    hints = typing.get_type_hints(BorrowdConfig)
    for item in dataclasses.fields(BorrowdConfig):
        if item.name == "pools":
            continue
        _emit_table(lines, hints[item.name], item.name, array=False, help=item.metadata["help"])
    _emit_table(lines, PoolConfig, "pools", array=True,
                help=BorrowdConfig.__dataclass_fields__["pools"].metadata["help"])
    return "\n".join(lines).rstrip() + "\n"


def _emit_table(lines: list[str], cls: type, path: str, *, array: bool, help: str) -> None:
    hints = typing.get_type_hints(cls)
    lines.append(f"# {help[0].upper()}{help[1:]}.")
    if cls.__doc__:
        lines.append(f"# {cls.__doc__.strip().splitlines()[0]}")
    lines.append(f"[[{path}]]" if array else f"[{path}]")
    nested = []
    for item in dataclasses.fields(cls):
        if not item.init:
            continue
        kind = hints[item.name]
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            nested.append((item, kind))
            continue
        value = _default_of(item)
        unit = item.metadata.get("unit", "")
        lines.append(f"# {item.metadata.get('help', item.name)}" + (f" [{unit}]" if unit else ""))
        if value is None:
            lines.append(f"# {item.name} =  (unset by default)")
        else:
            lines.append(f"{item.name} = {toml_value(value)}")
    lines.append("")
    for item, kind in nested:
        _emit_table(lines, kind, f"{path}.{item.name}", array=False,
                    help=item.metadata.get("help", item.name))


def _default_of(item: dataclasses.Field) -> Any:
    if item.default is not dataclasses.MISSING:
        return item.default
    if item.default_factory is not dataclasses.MISSING:
        return item.default_factory()
    return item.metadata.get("example")


def toml_value(value: Any) -> str:
    """`value` written as a TOML literal."""
    if isinstance(value, enum.Enum):
        return toml_value(value.value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}"'
    if isinstance(value, tuple | list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    raise ConfigError(f"cannot write {value!r} as TOML")
