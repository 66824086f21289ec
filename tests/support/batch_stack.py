"""A batch-job stack of real processes for tests and benchmarks.

redis-server, `borrowd emulate` replicas, `borrowd proxy` in front of them, `borrowd batch
serve`, and as many `borrowd batch worker` processes as a test starts; every process on a
free loopback port, stopped by its PID. The budget is published with the real budget store.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from borrowd.adapters.store import BudgetStore
from borrowd.models.budget import Budget, Mode

from tests.support.daemon_harness import borrowd_command, to_toml
from tests.support.servers import (
    ServerProcess,
    free_port,
    start_process,
    start_redis,
    wait_until,
)

POOL = "batchpool"
MODEL = "emulated-llama-3-8b"
TERMINAL = ("completed", "failed", "expired", "cancelled")


@dataclass
class BatchStack:
    """The running processes and how to reach them."""

    workdir: Path
    redis: ServerProcess
    emulators: list[ServerProcess]
    proxy: ServerProcess
    serve: ServerProcess
    config_path: Path
    tenants: dict[str, tuple[str, float]]
    workers: list[ServerProcess] = field(default_factory=list)

    @property
    def api_url(self) -> str:
        """Base URL of the batch API (`/v1` included, as the openai SDK wants it)."""
        return f"http://127.0.0.1:{self.serve.port}/v1"

    def redis_client(self) -> redis.Redis:
        """A client of the stack's Redis (decoded replies)."""
        return redis.Redis.from_url(self.redis.extra["url"], decode_responses=True)

    def publish_open(self, **overrides: Any) -> None:
        """Publish an open budget for a long lease."""
        fields: dict[str, Any] = dict(
            pool=POOL, mode=Mode.OPEN, reason="test", batch_tokens_per_s=1e7,
            batch_burst_tokens=10_000_000, max_batch_seqs=256, max_batch_kv_tokens=10_000_000,
            max_batch_output_tokens=8192)
        fields.update(overrides)
        client = self.redis_client()
        try:
            BudgetStore(client, POOL).publish(Budget(**fields), epoch=1, ttl_ms=3_600_000,
                                              now_s=time.time())
        finally:
            client.close()

    def cut_budget(self) -> None:
        """The operator's stop switch (`borrowd stop`): zero budget, in-flight revoked."""
        client = self.redis_client()
        try:
            BudgetStore(client, POOL).stop("test cut")
        finally:
            client.close()

    def restore_budget(self) -> None:
        """`borrowd resume`, then an open budget again (no controller runs here)."""
        client = self.redis_client()
        try:
            BudgetStore(client, POOL).resume()
        finally:
            client.close()
        self.publish_open()

    def start_worker(self, name: str, concurrency: int | None = None) -> ServerProcess:
        """A `borrowd batch worker` process named `name`."""
        argv = [borrowd_command(), "batch", "worker", "--config", str(self.config_path),
                "--id", name]
        if concurrency is not None:
            argv += ["--concurrency", str(concurrency)]
        # A worker listens on nothing: it is ready once it logs its start line.
        log_dir = self.workdir / name
        log_dir.mkdir(exist_ok=True)
        log_path = log_dir / f"{name}.log"
        worker = start_process(name, argv, 0, workdir=log_dir, timeout_s=30,
                               ready=lambda: "borrowd batch worker" in _read(log_path))
        self.workers.append(worker)
        return worker

    def restart_proxy(self) -> None:
        """SIGKILL the proxy (streams break mid-item) and start it again on its port."""
        argv = list(self.proxy.proc.args)
        self.proxy.kill()
        self.proxy = start_process("proxy", argv, self.proxy.port, timeout_s=30)

    def restart_redis(self) -> None:
        """SIGKILL redis-server and start it again on its port and directory (an AOF
        there is replayed)."""
        argv = list(self.redis.proc.args)
        self.redis.kill()
        url = self.redis.extra["url"]
        self.redis = start_process("redis", argv, self.redis.port, workdir=self.redis.workdir)
        self.redis.extra["url"] = url

    def stop(self) -> None:
        """Stop every process, workers first."""
        for server in [*self.workers, self.serve, self.proxy, *self.emulators, self.redis]:
            server.stop()


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=0.5) as resp:
            return resp.status == 200
    except OSError:
        return False


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def chat_lines(count: int, max_tokens: int, prefix: str = "item") -> bytes:
    """An input file of `count` chat requests of `max_tokens` each."""
    return "\n".join(json.dumps({
        "custom_id": f"{prefix}-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": MODEL, "max_tokens": max_tokens,
                 "messages": [{"role": "user", "content": f"summarize document number {i}"}]},
    }) for i in range(count)).encode()


def result_ids(lines: Sequence[str]) -> list[str]:
    """custom_ids of the JSONL lines given."""
    return [json.loads(line)["custom_id"] for line in lines if line.strip()]


@contextmanager
def batch_stack(workdir: Path, *, replicas: int = 1, time_scale: float = 0.1,
                tenants: dict[str, tuple[str, float]] | None = None,
                redis_args: Sequence[str] = (),
                serve_overrides: dict[str, Any] | None = None,
                worker_overrides: dict[str, Any] | None = None) -> Iterator[BatchStack]:
    """Start the stack; `tenants` maps a name to (API key, weight)."""
    tenants = tenants or {"etl": ("sk-etl", 1.0)}
    workdir.mkdir(parents=True, exist_ok=True)
    cli = borrowd_command()
    started: list[ServerProcess] = []
    try:
        redis_proc = start_redis(extra_args=redis_args)
        started.append(redis_proc)
        url = redis_proc.extra["url"]
        emulators = []
        for index in range(replicas):
            port = free_port()
            emulators.append(start_process(f"emulator-{index}", [
                cli, "emulate", "--listen", f"127.0.0.1:{port}", "--engine-index", str(index),
                "--time-scale", str(time_scale), "--kv-capacity-tokens", "400000",
            ], port, timeout_s=30))
            started.append(emulators[-1])
        proxy_port = free_port()
        proxy_toml = workdir / "proxy.toml"
        proxy_toml.write_text(to_toml({
            "proxy": {"listen_port": proxy_port, "pool": POOL, "redis_url": url,
                      "upstreams": [f"http://127.0.0.1:{e.port}" for e in emulators]},
            "admission": {"lease_ms": 10_000},
            "tenants": {name: {"keys": [key], "class": "batch"}
                        for name, (key, _w) in tenants.items()},
        }))
        proxy = start_process("proxy", [cli, "proxy", "--config", str(proxy_toml)], proxy_port,
                              timeout_s=30)
        started.append(proxy)
        serve_port = free_port()
        config_path = workdir / "batch.toml"
        config_path.write_text(to_toml({
            "batch": {"listen_port": serve_port, "redis_url": url,
                      "data_dir": str(workdir / "data"), "monitor_interval_s": 0.2,
                      "cancel_grace_s": 3.0, **(serve_overrides or {})},
            "worker": {"proxy_url": f"http://127.0.0.1:{proxy_port}", "concurrency": 8,
                       "claim_idle_s": 1.5, "heartbeat_s": 0.3, "checkpoint_tokens": 16,
                       "retry_after_max_s": 1.0, **(worker_overrides or {})},
            "tenants": {name: {"keys": [key], "weight": weight}
                        for name, (key, weight) in tenants.items()},
        }))
        serve = start_process("serve", [cli, "batch", "serve", "--config", str(config_path)],
                              serve_port, timeout_s=30,
                              ready=lambda: _healthy(serve_port))
        started.append(serve)
    except BaseException:
        for server in reversed(started):
            server.stop()
        raise
    stack = BatchStack(workdir, redis_proc, emulators, proxy, serve, config_path, tenants)
    stack.publish_open()
    try:
        yield stack
    finally:
        stack.stop()


def wait_terminal(client: Any, batch_id: str, timeout_s: float) -> Any:
    """Poll the openai SDK until the batch reaches a terminal status; the batch."""
    return wait_until(lambda: _terminal(client, batch_id), timeout_s,
                      f"batch {batch_id} to finish", interval_s=0.2)


def _terminal(client: Any, batch_id: str) -> Any:
    import openai  # the SDK is optional (vllm extra); only its users get here

    try:
        batch = client.batches.retrieve(batch_id)
    except openai.InternalServerError:  # 503 while its Redis restarts: ask again
        return None
    return batch if batch.status in TERMINAL else None
