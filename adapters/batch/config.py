"""Configuration of `borrowd batch serve` and `borrowd batch worker`: one TOML file.

```toml
[batch]                    # serve: API, storage, figures
listen_host = "127.0.0.1"
listen_port = 8200
data_dir = "/var/lib/borrowd/batch"
[worker]                   # worker: how items run through the proxy
proxy_url = "http://127.0.0.1:8000"
concurrency = 16
[tenants.etl]              # API keys the Batch API accepts; the worker sends them on to the
keys = ["sk-etl"]          # proxy, which must map them to a batch tenant
weight = 2.0
```

Every error names the key at fault (`worker.concurrency`, `tenants.etl.weight`).
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from borrowd.models.batch.figures import CostModel
from borrowd.models.batch.input import InputLimits
from borrowd.models.errors import ConfigError


@dataclass(frozen=True)
class ServeConfig:
    """The Files + Batches API server."""

    listen_host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    listen_port: int = field(default=8200, metadata={"help": "TCP port to listen on"})
    data_dir: str = field(default="./borrowd-batch",
                          metadata={"help": "directory of input, output and error files"})
    redis_url: str | None = field(
        default=None, metadata={"help": "Redis URL (else BORROWD_REDIS_URL, then local)"})
    max_file_bytes: int = field(default=200 * 1024 * 1024,
                                metadata={"help": "largest input file accepted, bytes"})
    max_lines: int = field(default=50_000, metadata={"help": "most requests in one input file"})
    max_line_bytes: int = field(default=4 * 1024 * 1024,
                                metadata={"help": "largest input line, bytes"})
    monitor_interval_s: float = field(
        default=0.5, metadata={"help": "how often jobs are finalized, expired and measured, s"})
    rate_window_s: float = field(
        default=60.0, metadata={"help": "window of the carried rate behind lateness, s"})
    cancel_grace_s: float = field(
        default=30.0, metadata={"help": "longest a cancel waits for items in flight, s"})
    done_ttl_s: int = field(
        default=7 * 86400,
        metadata={"help": "how long completed custom_ids are remembered per job key, s"})
    price_per_gpu_hour: float = field(default=2.0,
                                      metadata={"help": "price of one GPU-hour (any currency)"})
    prefill_tokens_per_gpu_s: float = field(
        default=20_000.0, metadata={"help": "prompt tokens one GPU prefills per second"})
    decode_tokens_per_gpu_s: float = field(
        default=2_500.0, metadata={"help": "output tokens one GPU generates per second (batched)"})

    def limits(self) -> InputLimits:
        """The input file limits."""
        return InputLimits(self.max_file_bytes, self.max_lines, self.max_line_bytes)

    def cost_model(self) -> CostModel:
        """The GPU cost model."""
        return CostModel(self.price_per_gpu_hour, self.prefill_tokens_per_gpu_s,
                         self.decode_tokens_per_gpu_s)


@dataclass(frozen=True)
class WorkerConfig:
    """How a worker runs items through the proxy."""

    proxy_url: str = field(default="http://127.0.0.1:8000",
                           metadata={"help": "base URL of the borrowd proxy"})
    concurrency: int = field(default=16, metadata={"help": "items in flight per worker"})
    claim_idle_s: float = field(
        default=30.0, metadata={"help": "an item silent this long is reclaimed from its worker, s"})
    heartbeat_s: float = field(
        default=5.0, metadata={"help": "how often a worker marks its items alive, s"})
    checkpoint_tokens: int = field(
        default=32, metadata={"help": "progress saved to Redis every this many tokens"})
    retry_after_max_s: float = field(
        default=30.0, metadata={"help": "longest wait honoured from a 429 Retry-After, s"})
    max_failures: int = field(
        default=8, metadata={"help": "failed attempts (5xx, no answer) before an item errors"})
    request_timeout_s: float = field(
        default=600.0, metadata={"help": "longest silence from the proxy mid-request, s"})
    poll_s: float = field(default=0.2, metadata={"help": "pause when there is no work, s"})


@dataclass(frozen=True)
class TenantConfig:
    """A batch tenant: its name, weight and API keys."""

    name: str
    weight: float
    keys: tuple[str, ...]


@dataclass(frozen=True)
class BatchConfig:
    """Everything `borrowd batch` needs."""

    serve: ServeConfig = field(default_factory=ServeConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    tenants: Mapping[str, TenantConfig] = field(default_factory=lambda: MappingProxyType({}))

    def tenant_of_key(self, key: str) -> TenantConfig | None:
        """The tenant owning API key `key`."""
        for tenant in self.tenants.values():
            if key in tenant.keys:
                return tenant
        return None


def load_batch_config(path: str | Path) -> BatchConfig:
    """Read and validate a batch TOML file; `ConfigError` names the file and the key."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"batch config {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"batch config {path} is not valid TOML: {exc}") from None
    try:
        return parse_batch_config(data)
    except ConfigError as exc:
        raise ConfigError(f"batch config {path}: {exc}") from None


def parse_batch_config(data: Mapping[str, Any]) -> BatchConfig:
    """Build a `BatchConfig` from parsed TOML; `ConfigError` names the bad key."""
    _known(data, {"batch", "worker", "tenants"}, "")
    serve = _section(ServeConfig, data.get("batch", {}), "batch")
    worker = _section(WorkerConfig, data.get("worker", {}), "worker")
    tenants = _tenants(data.get("tenants", {}))
    for name, value in {**dataclasses.asdict(serve), **dataclasses.asdict(worker)}.items():
        if isinstance(value, int | float) and not isinstance(value, bool) and value <= 0:
            raise ConfigError(f"{name} must be > 0, got {value!r}")
    return BatchConfig(serve=serve, worker=worker, tenants=MappingProxyType(tenants))


def _known(table: Mapping[str, Any], known: set[str], prefix: str) -> None:
    for key in table:
        if key not in known:
            raise ConfigError(f"unknown key {prefix}{key} (known: {', '.join(sorted(known))})")


def _section(kind: type, table: Any, name: str) -> Any:
    if not isinstance(table, dict):
        raise ConfigError(f"{name} must be a table")
    fields = {f.name: f for f in dataclasses.fields(kind)}
    _known(table, set(fields), f"{name}.")
    kwargs = {key: _coerce(f"{name}.{key}", value, fields[key].type)
              for key, value in table.items()}
    return kind(**kwargs)


def _coerce(key: str, value: Any, kind: Any) -> Any:
    if kind in ("str", "str | None"):
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{key} must be a non-empty string, got {value!r}")
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{key} must be a number, got {value!r}")
    return float(value)


def _tenants(table: Any) -> dict[str, TenantConfig]:
    if not isinstance(table, dict) or not table:
        raise ConfigError("tenants: define at least one [tenants.NAME] with keys and weight")
    tenants: dict[str, TenantConfig] = {}
    owners: dict[str, str] = {}
    for name, spec in table.items():
        prefix = f"tenants.{name}"
        if not isinstance(spec, dict):
            raise ConfigError(f"{prefix} must be a table with keys and weight")
        _known(spec, {"keys", "weight"}, f"{prefix}.")
        keys = spec.get("keys")
        if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k
                                                             for k in keys):
            raise ConfigError(f"{prefix}.keys must be a non-empty list of non-empty strings")
        weight = spec.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or weight <= 0:
            raise ConfigError(f"{prefix}.weight must be a number > 0, got {weight!r}")
        for key in keys:
            if key in owners:
                raise ConfigError(f"{prefix}.keys: a key is already used by tenant {owners[key]}")
            owners[key] = name
        tenants[name] = TenantConfig(name, float(weight), tuple(keys))
    return tenants
