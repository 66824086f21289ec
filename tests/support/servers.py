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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    """True when something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `predicate` until true or raise TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
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
