"""Start real servers (redis-server, prometheus, nginx, any borrowd process) for tests.

Each server listens on a free loopback port, runs in a temporary directory, and is stopped
by its own PID (never by name), so the machine's own Redis on 6379 is left alone.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago and that this process has not
    handed out before: the probe socket is closed before the caller binds, so two calls in a
    row (`free_port(), free_port()`) could get the same port, and a server failing to bind
    it would pass a readiness check answered by the other one."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    """True when something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def wait_until(
    predicate: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.02
) -> T:
    """Poll `predicate` every `interval_s` until it returns a true value, and return that
    value; raise TimeoutError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")


@dataclass
class ServerProcess:
    """A running server: its process, port and working directory."""

    name: str
    proc: subprocess.Popen
    port: int
    workdir: Path
    log_path: Path
    extra: dict = field(default_factory=dict)

    @property
    def pid(self) -> int:
        """The server's process id."""
        return self.proc.pid

    def log(self) -> str:
        """Everything the server wrote so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to this server's PID and reap it."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it lingers."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


def start_process(
    name: str,
    argv: Sequence[str],
    port: int,
    *,
    workdir: Path | None = None,
    env: dict[str, str] | None = None,
    ready: Callable[[], bool] | None = None,
    timeout_s: float = 20.0,
) -> ServerProcess:
    """Start `argv` and wait until `ready()` (default: the port accepts connections)."""
    workdir = workdir or Path(tempfile.mkdtemp(prefix=f"borrowd-{name}-"))
    log_path = workdir / f"{name}.log"
    log = open(log_path, "wb")  # noqa: SIM115 - closed when the process ends
    proc = subprocess.Popen(
        list(argv), cwd=workdir, stdout=log, stderr=subprocess.STDOUT, env=env,
        start_new_session=True,
    )
    server = ServerProcess(name=name, proc=proc, port=port, workdir=workdir, log_path=log_path)
    check = ready or (lambda: port_open(port))
    try:
        wait_until(lambda: proc.poll() is not None or check(), timeout_s, f"{name} on :{port}")
    except TimeoutError:
        server.kill()
        raise
    if proc.poll() is not None:
        raise RuntimeError(f"{name} exited with {proc.returncode}: {server.log()[-2000:]}")
    return server


def start_redis(port: int | None = None, extra_args: Sequence[str] = ()) -> ServerProcess:
    """A throw-away redis-server on a free loopback port, keeping nothing on disk."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (Debian package redis-server)")
    port = port or free_port()
    argv = [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
            "--appendonly", "no", *extra_args]
    server = start_process("redis", argv, port)
    server.extra["url"] = f"redis://127.0.0.1:{port}/0"
    return server


@contextmanager
def redis_server(extra_args: Sequence[str] = ()) -> Iterator[ServerProcess]:
    """Context manager around `start_redis`."""
    server = start_redis(extra_args=extra_args)
    try:
        yield server
    finally:
        server.stop()


def start_prometheus(
    scrape_targets: dict[str, Sequence[str]],
    scrape_interval_s: float = 1.0,
    rule_files: Sequence[Path] = (),
    target_labels: dict[str, dict[str, str]] | None = None,
) -> ServerProcess:
    """A throw-away Prometheus on a free loopback port scraping `scrape_targets`.

    `scrape_targets` maps a job name to `host:port` targets; `target_labels` optionally maps a
    job name to labels attached to its targets (e.g. the `pool` of vLLM engines). Rule files
    are copied into the temporary directory; the TSDB lives there too. `--web.enable-lifecycle`
    lets a test reload it.
    """
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError("prometheus is not installed (Debian package prometheus)")
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="borrowd-prometheus-"))
    rules = []
    for index, rule_file in enumerate(rule_files):
        copy = workdir / f"rules-{index}-{Path(rule_file).name}"
        shutil.copyfile(rule_file, copy)
        rules.append(str(copy))
    interval = f"{round(scrape_interval_s * 1000)}ms"
    lines = [
        "global:",
        f"  scrape_interval: {interval}",
        f"  evaluation_interval: {interval}",
        f"  scrape_timeout: {interval}",
        "rule_files:",
        *[f"  - {path!r}" for path in rules],
        "scrape_configs:",
    ]
    for job, targets in scrape_targets.items():
        lines += [
            f"  - job_name: {job!r}",
            "    static_configs:",
            f"      - targets: [{', '.join(repr(t) for t in targets)}]",
        ]
        labels = (target_labels or {}).get(job)
        if labels:
            lines.append("        labels:")
            lines += [f"          {key}: {value!r}" for key, value in labels.items()]
    config_path = workdir / "prometheus.yml"
    config_path.write_text("\n".join(lines) + "\n")
    argv = [
        binary,
        f"--config.file={config_path}",
        f"--storage.tsdb.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--web.enable-lifecycle",
        "--storage.tsdb.retention.time=1h",
        "--log.level=warn",
    ]
    server = start_process(
        "prometheus", argv, port, workdir=workdir, timeout_s=30.0,
        ready=lambda: _http_ok(f"http://127.0.0.1:{port}/-/ready"),
    )
    server.extra["url"] = f"http://127.0.0.1:{port}"
    server.extra["config_path"] = config_path
    return server


def _http_ok(url: str) -> bool:
    """True when GET `url` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=0.5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def start_nginx(server_blocks: str, port: int, worker_connections: int = 256) -> ServerProcess:
    """A throw-away nginx (foreground, own prefix and temp dirs) serving `server_blocks`.

    `server_blocks` is the text inside `http { }`; it must listen on 127.0.0.1:`port`.
    """
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(binary).exists():
        raise RuntimeError("nginx is not installed (Debian package nginx-light)")
    workdir = Path(tempfile.mkdtemp(prefix="borrowd-nginx-"))
    for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (workdir / sub).mkdir()
    conf = workdir / "nginx.conf"
    conf.write_text(
        f"""daemon off;
master_process on;
worker_processes 1;
pid {workdir}/nginx.pid;
error_log {workdir}/error.log info;
events {{ worker_connections {worker_connections}; }}
http {{
    access_log {workdir}/access.log;
    client_body_temp_path {workdir}/body;
    proxy_temp_path {workdir}/proxy;
    fastcgi_temp_path {workdir}/fastcgi;
    uwsgi_temp_path {workdir}/uwsgi;
    scgi_temp_path {workdir}/scgi;
{server_blocks}
}}
"""
    )
    return start_process("nginx", [binary, "-p", str(workdir), "-c", str(conf)], port,
                         workdir=workdir)
