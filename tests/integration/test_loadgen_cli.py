"""`borrowd loadgen` against a real proxy and emulator fails loudly on a wrong URL, key or
model (exit 2, one line naming the flag) instead of reporting success 0.0 with NaNs."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from borrowd.models.errors import InputError
from borrowd.models.sim.trace import traces_dir

from tests.support.daemon_harness import REAL_PROMETHEUS_AND_REDIS, borrowd_command, to_toml
from tests.support.servers import ServerProcess, free_port, start_process, start_redis

pytestmark = REAL_PROMETHEUS_AND_REDIS
CHAT_KEY = "sk-chat"
ETL_KEY = "sk-etl"


@pytest.fixture(scope="module")
def proxy_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A proxy (pool chat, no budget published) in front of one emulator."""
    try:
        traces_dir()
    except InputError as exc:
        pytest.skip(str(exc))
    cli = borrowd_command()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BORROWD_")}
    servers: list[ServerProcess] = []
    try:
        servers.append(redis_proc := start_redis())
        engine_port, proxy_port = free_port(), free_port()
        servers.append(start_process("emulator", [cli, "emulate", "--listen",
                                                  f"127.0.0.1:{engine_port}"], engine_port,
                                     env=env, timeout_s=30))
        config = Path(tmp_path_factory.mktemp("proxy")) / "proxy.toml"
        config.write_text(to_toml({
            "proxy": {"listen_port": proxy_port, "pool": "chat",
                      "upstreams": [f"http://127.0.0.1:{engine_port}"],
                      "redis_url": redis_proc.extra["url"]},
            "tenants": {"chat": {"keys": [CHAT_KEY], "class": "interactive"},
                        "etl": {"keys": [ETL_KEY], "class": "batch"}},
        }))
        servers.append(start_process("proxy", [cli, "proxy", "--config", str(config)],
                                     proxy_port, env=env, timeout_s=30))
        yield f"http://127.0.0.1:{proxy_port}"
    finally:
        for server in reversed(servers):
            server.stop()


def _loadgen(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([borrowd_command(), "loadgen", "--duration-s", "3",
                           "--batch-workers", "1", *argv],
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--proxy", "http://127.0.0.1:{dead}", "--interactive-key", CHAT_KEY,
       "--batch-key", ETL_KEY], "--proxy http://127.0.0.1:{dead} cannot be reached"),
     (["--proxy", "{url}", "--interactive-key", "sk-wrong", "--batch-key", ETL_KEY],
      "--interactive-key is refused by the proxy at {url} (HTTP 401)"),
     (["--proxy", "{url}", "--interactive-key", CHAT_KEY, "--batch-key", "sk-wrong"],
      "--batch-key is refused by the proxy at {url} (HTTP 401)"),
     (["--proxy", "{url}", "--interactive-key", CHAT_KEY, "--batch-key", ETL_KEY,
       "--model", "llama-70b"],
      "--model 'llama-70b' is not served at {url} (models: emulated-llama-3-8b)")],
    ids=["dead-url", "wrong-interactive-key", "wrong-batch-key", "wrong-model"],
)
def test_wrong_target_is_one_line_exit_2(proxy_url: str, args: list[str], message: str) -> None:
    """Each mistake is named on one stderr line, exit 2, before any load is sent."""
    fill = {"url": proxy_url, "dead": str(free_port())}
    done = _loadgen(*[a.format(**fill) for a in args])
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"borrowd: error: {message.format(**fill)}")
    assert done.stderr.count("\n") == 1
    assert done.stdout == ""


def test_summary_is_strict_json_with_errors_by_status(proxy_url: str) -> None:
    """A run with no budget published: batch refused (counted as rejected, not as errors),
    interactive served; the summary is strict JSON and the run exits 0."""
    done = _loadgen("--proxy", proxy_url, "--interactive-key", CHAT_KEY, "--batch-key", ETL_KEY)
    assert done.returncode == 0, done.stderr
    assert "NaN" not in done.stdout
    summary = json.loads(done.stdout, parse_constant=lambda name: pytest.fail(name))
    assert summary["batch_rejected"] > 0 and summary["batch_completed"] == 0
    assert summary["batch_errors_by_status"] == {}
    assert summary["interactive_errors_by_status"] == {}
