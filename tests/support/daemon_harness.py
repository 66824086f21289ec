"""Start `borrowd run` processes for integration tests, with a config written from a dict.

The daemon writes JSON log lines to its log file; `events()` parses them so tests can assert
on what it decided and why.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import urllib.request
from pathlib import Path

import pytest
from borrowd.controller.config import toml_value

from tests.support.servers import ServerProcess, free_port, start_process

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "borrowd.rules.yml"

# Marks of a test module that runs the daemon against real Prometheus and Redis.
REAL_PROMETHEUS_AND_REDIS = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("prometheus") is None or shutil.which("redis-server") is None,
        reason="needs prometheus and redis-server (Debian packages)",
    ),
]


def to_toml(data: dict, prefix: str = "") -> str:
    """A small TOML writer for config dicts (tables, arrays of tables, scalars, arrays)."""
    lines, tables = [], []
    for key, value in data.items():
        if isinstance(value, dict):
            tables.append((f"{prefix}{key}", value, False))
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            tables.extend((f"{prefix}{key}", item, True) for item in value)
        else:
            lines.append(f"{key} = {toml_value(value)}")
    text = "\n".join(lines) + "\n"
    for name, table, array in tables:
        text += f"\n[[{name}]]\n" if array else f"\n[{name}]\n"
        text += to_toml(table, f"{name}.")
    return text


def borrowd_command() -> str:
    """The `borrowd` command to run: `$BORROWD_TEST_CLI` when set, else the console script."""
    binary = os.environ.get("BORROWD_TEST_CLI") or shutil.which("borrowd")
    if binary is None:
        raise RuntimeError("the borrowd console script is not installed (pip install -e .)")
    return binary


def start_daemon(
    config: dict,
    *,
    holder_id: str,
    env: dict[str, str] | None = None,
    name: str = "borrowd-run",
    metrics_port: int | None = None,
) -> ServerProcess:
    """`borrowd run --config FILE` with `config`, serving /metrics on `metrics_port`
    (a free one when None)."""
    binary = borrowd_command()
    port = metrics_port or free_port()
    config = {**config, "daemon": {**config.get("daemon", {}),
                                   "metrics_listen": f"127.0.0.1:{port}",
                                   "holder_id": holder_id, "log_level": "info"}}
    workdir = Path(tempfile.mkdtemp(prefix=f"borrowd-{holder_id}-"))
    path = workdir / "borrowd.toml"
    path.write_text(to_toml(config))
    process_env = {k: v for k, v in os.environ.items() if not k.startswith("BORROWD_")}
    process_env.update(env or {})
    server = start_process(name, [binary, "run", "--config", str(path)], port, workdir=workdir,
                           env=process_env, timeout_s=30.0)
    server.extra["metrics_url"] = f"http://127.0.0.1:{port}/metrics"
    return server


def events(server: ServerProcess, event: str | None = None) -> list[dict]:
    """The daemon's JSON log lines so far (only `event` ones when given)."""
    out = []
    for line in server.log().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and (event is None or record.get("event") == event):
            out.append(record)
    return out


def metric_value(server: ServerProcess, sample: str) -> float | None:
    """The value of one exposition line starting with `sample` on the daemon's /metrics."""
    try:
        with urllib.request.urlopen(server.extra["metrics_url"], timeout=1) as response:
            text = response.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return None
