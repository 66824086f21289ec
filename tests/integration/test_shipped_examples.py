"""The shipped examples, started together as the README says, admit batch within a minute.

`borrowd emulate` (the vLLM stand-in), `borrowd proxy --config examples/proxy.toml`,
`borrowd run --config examples/borrowd.toml`, Prometheus with
`deploy/prometheus/prometheus.example.yml` and its rules, a real redis-server, and
`borrowd loadgen` with the example tenants' keys. The files are used as shipped; only their
loopback ports move to free ones (this machine's 6379, 8000... belong to others): the proxy
and Prometheus files by substituting each `127.0.0.1:PORT` (and `listen_port`), the daemon's
through its documented environment overrides.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from borrowd.models.errors import InputError
from borrowd.models.sim.trace import traces_dir

from tests.support.daemon_harness import REAL_PROMETHEUS_AND_REDIS, borrowd_command
from tests.support.servers import (
    ServerProcess,
    free_port,
    start_process,
    start_redis,
    wait_until,
)

pytestmark = REAL_PROMETHEUS_AND_REDIS
REPO = Path(__file__).resolve().parents[2]
PROXY_TOML = REPO / "examples" / "proxy.toml"
DAEMON_TOML = REPO / "examples" / "borrowd.toml"
PROMETHEUS_YML = REPO / "deploy" / "prometheus" / "prometheus.example.yml"
RULES_YML = REPO / "deploy" / "prometheus" / "borrowd.rules.yml"
# The one-host layout every shipped example agrees on (prometheus.example.yml's header).
PORTS = {"proxy": 8000, "engine": 8100, "daemon": 9105, "prometheus": 9090, "redis": 6379}
LOAD_S = 75.0
ADMIT_WITHIN_S = 60.0


def relocate(text: str, ports: dict[str, int]) -> str:
    """`text` with each shipped `127.0.0.1:PORT` (and `listen_port = PORT`) moved to `ports`."""
    for name, shipped in PORTS.items():
        text = text.replace(f"127.0.0.1:{shipped}", f"127.0.0.1:{ports[name]}")
        text = text.replace(f"listen_port = {shipped}", f"listen_port = {ports[name]}")
    return text


def test_examples_agree_on_pool_and_ports() -> None:
    """One pool name and one set of ports across the proxy, daemon and Prometheus examples."""
    proxy = tomllib.loads(PROXY_TOML.read_text())
    daemon = tomllib.loads(DAEMON_TOML.read_text())
    prometheus = PROMETHEUS_YML.read_text()
    assert [pool["name"] for pool in daemon["pools"]] == [proxy["proxy"]["pool"]] == ["chat"]
    assert proxy["proxy"]["listen_port"] == PORTS["proxy"]
    assert proxy["proxy"]["upstreams"] == [f"http://127.0.0.1:{PORTS['engine']}"]
    assert daemon["daemon"]["metrics_listen"] == f"127.0.0.1:{PORTS['daemon']}"
    assert daemon["prometheus"]["url"] == f"http://127.0.0.1:{PORTS['prometheus']}"
    for name in ("proxy", "engine", "daemon"):
        assert f'"127.0.0.1:{PORTS[name]}"' in prometheus, name
    assert "pool: chat" in prometheus
    assert "rule_files:\n  - borrowd.rules.yml" in prometheus


def _post(url: str, key: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST",
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _env(**overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BORROWD_")}
    env.update(overrides)
    return env


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[dict]:
    """Every shipped piece running on free ports; yields the ports and the processes."""
    try:
        traces_dir()
    except InputError as exc:
        pytest.skip(str(exc))
    cli = borrowd_command()
    servers: list[ServerProcess] = []
    try:
        redis_proc = start_redis()
        servers.append(redis_proc)
        ports = {"proxy": free_port(), "engine": free_port(), "daemon": free_port(),
                 "prometheus": free_port(), "redis": redis_proc.port}
        redis_url = f"redis://127.0.0.1:{ports['redis']}/0"
        servers.append(start_process("emulator", [
            cli, "emulate", "--listen", f"127.0.0.1:{ports['engine']}"], ports["engine"],
            env=_env(), timeout_s=30))
        proxy_toml = tmp_path / "proxy.toml"
        proxy_toml.write_text(relocate(PROXY_TOML.read_text(), ports))
        servers.append(start_process("proxy", [cli, "proxy", "--config", str(proxy_toml)],
                                     ports["proxy"], env=_env(BORROWD_REDIS_URL=redis_url),
                                     timeout_s=30))
        prom_dir = tmp_path / "prometheus"
        prom_dir.mkdir()
        (prom_dir / "prometheus.yml").write_text(relocate(PROMETHEUS_YML.read_text(), ports))
        shutil.copyfile(RULES_YML, prom_dir / RULES_YML.name)
        servers.append(start_process("prometheus", [
            shutil.which("prometheus") or "prometheus",
            f"--config.file={prom_dir / 'prometheus.yml'}",
            f"--storage.tsdb.path={prom_dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{ports['prometheus']}", "--log.level=warn",
        ], ports["prometheus"], workdir=prom_dir, timeout_s=30))
        servers.append(start_process("daemon", [cli, "run", "--config", str(DAEMON_TOML)],
                                     ports["daemon"], env=_env(
            BORROWD_REDIS_URL=redis_url,
            BORROWD_PROMETHEUS_URL=f"http://127.0.0.1:{ports['prometheus']}",
            BORROWD_DAEMON_METRICS_LISTEN=f"127.0.0.1:{ports['daemon']}"), timeout_s=30))
        yield {"ports": ports, "redis_url": redis_url, "cli": cli, "servers": servers}
    finally:
        for server in reversed(servers):
            server.stop()


def test_shipped_examples_admit_batch_under_load(stack: dict) -> None:
    """Before the daemon's first open budget a batch request is refused naming the pool; with
    interactive and batch load from loadgen, batch is admitted within a minute, and the
    operator commands know the pool (and refuse another name)."""
    ports, cli = stack["ports"], stack["cli"]
    tenants = tomllib.loads(PROXY_TOML.read_text())["tenants"]
    chat_key, etl_key = tenants["chat"]["keys"][0], tenants["etl"]["keys"][0]
    proxy_url = f"http://127.0.0.1:{ports['proxy']}"
    status, body = _post(f"{proxy_url}/v1/chat/completions", etl_key, {
        "model": "emulated-llama-3-8b", "max_tokens": 4,
        "messages": [{"role": "user", "content": "hello"}]})
    assert status == 429
    assert "pool 'chat'" in body["error"]["message"]

    started = time.monotonic()
    loadgen = subprocess.Popen(
        [cli, "loadgen", "--proxy", proxy_url, "--interactive-key", chat_key,
         "--batch-key", etl_key, "--duration-s", str(LOAD_S), "--batch-workers", "4",
         "--batch-max-output-tokens", "64", "--out", "/dev/null"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        def batch_admitted() -> bool:
            with urllib.request.urlopen(f"{proxy_url}/metrics", timeout=5) as response:
                text = response.read().decode()
            return any(line.startswith("borrowd_proxy_requests_total{")
                       and 'class="batch"' in line and 'outcome="success"' in line
                       and float(line.rsplit(" ", 1)[1]) > 0 for line in text.splitlines())

        wait_until(batch_admitted, ADMIT_WITHIN_S, "a batch request admitted and completed",
                   interval_s=1.0)
        admitted_after_s = time.monotonic() - started
        stdout, stderr = loadgen.communicate(timeout=LOAD_S + 120)
    finally:
        if loadgen.poll() is None:
            loadgen.kill()
            loadgen.wait(timeout=10)
    assert loadgen.returncode == 0, stderr[-2000:]
    summary = json.loads(stdout.strip().splitlines()[-1])
    print(f"batch first completed {admitted_after_s:.1f} s after load start; {summary}")
    assert summary["batch_completed"] > 0
    assert summary["interactive_success_rate"] >= 0.99

    env = _env(BORROWD_REDIS_URL=stack["redis_url"])
    known = subprocess.run([cli, "status", "--pool", "chat", "--json"], capture_output=True,
                           text=True, timeout=30, env=env, check=False)
    assert known.returncode == 0, known.stderr
    unknown = subprocess.run([cli, "stop", "--pool", "chat-8b", "--reason", "typo"],
                             capture_output=True, text=True, timeout=30, env=env, check=False)
    assert unknown.returncode == 2
    assert "known pools: chat" in unknown.stderr
