"""An emulated pool for rollout and drill tests: real redis-server, `borrowd emulate` engines,
the proxy, Prometheus (with borrowd's rules) and one daemon, plus `borrowd loadgen` runs.

The engines run 4x slower than their H100 profile (`--time-scale 4`) so that the streams fit
on two shared CPU cores; the SLOs passed to the daemon are in that wall-clock time.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tests.support.daemon_harness import RULES, borrowd_command, start_daemon, to_toml
from tests.support.servers import (
    ServerProcess,
    free_port,
    start_process,
    start_prometheus,
    start_redis,
)

POOL = "chat"
INTERACTIVE_KEY = "fleet-chat-key"
BATCH_KEY = "fleet-batch-key"
SLO_TTFT_S = 2.0
SLO_ITL_S = 0.2


@dataclass
class Fleet:
    """The running pool: URLs, a Redis client, and every process to stop."""

    redis_url: str
    prometheus_url: str
    proxy_url: str
    client: redis.Redis
    servers: list[ServerProcess] = field(default_factory=list)
    loadgens: list[subprocess.Popen] = field(default_factory=list)

    def loadgen(self, duration_s: float, burst: tuple[float, float, float] | None = None,
                batch_workers: int = 8) -> subprocess.Popen:
        """Start `borrowd loadgen` (the Azure chat trace at its rate, a batch backlog)."""
        argv = [borrowd_command(), "loadgen", "--proxy", self.proxy_url,
                "--interactive-key", INTERACTIVE_KEY, "--batch-key", BATCH_KEY,
                "--duration-s", str(duration_s), "--rate-scale", "1.0",
                "--interactive-max-output-tokens", "32", "--batch-workers", str(batch_workers),
                "--batch-prompt-scale", "1.0", "--batch-max-output-tokens", "128"]
        if burst is not None:
            argv += ["--burst", ":".join(str(x) for x in burst)]
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
        self.loadgens.append(proc)
        return proc

    def stop(self) -> None:
        """Stop every load generator and server, newest first, by PID."""
        for proc in self.loadgens:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        for server in reversed(self.servers):
            server.kill()


def start_fleet(workdir: Path, *, engines: int = 2, tick_s: float = 0.5,
                u_max_tokens_per_s: float = 16000.0) -> Fleet:
    """Start the whole pool; the caller must `stop()` it."""
    cli = borrowd_command()
    servers: list[ServerProcess] = []
    try:
        redis_proc = start_redis()
        servers.append(redis_proc)
        redis_url = redis_proc.extra["url"]
        emulators = []
        for index in range(engines):
            port = free_port()
            emulators.append(start_process(f"emulator-{index}", [
                cli, "emulate", "--listen", f"127.0.0.1:{port}", "--engine-index", str(index),
                "--time-scale", "4", "--max-num-batched-tokens", "2048",
                "--long-prefill-token-threshold", "512", "--kv-capacity-tokens", "200000",
                "--slo-itl-s", str(SLO_ITL_S),
            ], port, timeout_s=30))
            servers.append(emulators[-1])
        proxy_port = free_port()
        proxy_toml = workdir / "proxy.toml"
        proxy_toml.write_text(to_toml({
            "proxy": {"pool": POOL, "listen_host": "127.0.0.1", "listen_port": proxy_port,
                      "upstreams": [f"http://127.0.0.1:{e.port}" for e in emulators],
                      "redis_url": redis_url,
                      "slo_ttft_s": [SLO_TTFT_S], "slo_itl_s": [SLO_ITL_S]},
            "admission": {"mode": "queue", "queue_max_wait_s": 10.0, "lease_ms": 30000},
            "tenants": {"chat": {"keys": [INTERACTIVE_KEY], "class": "interactive"},
                        "etl": {"keys": [BATCH_KEY], "class": "batch"}},
        }))
        servers.append(start_process("proxy", [cli, "proxy", "--config", str(proxy_toml)],
                                     proxy_port, timeout_s=30))
        daemon_port = free_port()
        prometheus = start_prometheus(
            {"proxy": [f"127.0.0.1:{proxy_port}"],
             "vllm": [f"127.0.0.1:{e.port}" for e in emulators],
             "borrowd": [f"127.0.0.1:{daemon_port}"]},
            scrape_interval_s=0.5, rule_files=[RULES], target_labels={"vllm": {"pool": POOL}})
        servers.append(prometheus)
        config = {
            "redis": {"url": redis_url},
            "prometheus": {"url": prometheus.extra["url"], "timeout_s": 0.5, "window": "15s"},
            "pools": [{
                "name": POOL, "leader_lease_ms": 3000, "budget_ttl_ms": 3000,
                "controller": {
                    "tick_s": tick_s, "slo_ttft_p95_s": SLO_TTFT_S, "slo_itl_p95_s": SLO_ITL_S,
                    "u_max_tokens_per_s": u_max_tokens_per_s,
                    "supervisor": {"quiet_s": 2.0, "max_age_s": 5.0,
                                   "ramp_slew_tokens_per_s2": 4000.0,
                                   "ramp_cap_tokens_per_s": u_max_tokens_per_s},
                    "caps": {"min_burst_tokens": 8192, "tokens_per_s_per_seq": 1000.0,
                             "max_output_tokens": 128},
                },
            }],
        }
        servers.append(start_daemon(config, holder_id="a", metrics_port=daemon_port))
    except BaseException:
        for server in reversed(servers):
            server.kill()
        raise
    return Fleet(redis_url=redis_url, prometheus_url=prometheus.extra["url"],
                 proxy_url=f"http://127.0.0.1:{proxy_port}",
                 client=redis.Redis.from_url(redis_url, decode_responses=True), servers=servers)
