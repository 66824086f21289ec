"""The daemon's commands: `borrowd run --config FILE`, `borrowd config check FILE`, and
`borrowd config example` (the documented example config, generated from the fields).

This is the daemon's composition root: Redis clients, the Prometheus source, the metrics
server and the loops are wired here; `controller.loop` and `controller.daemon` only see
protocols.
"""

from __future__ import annotations

import argparse
import math
import signal
import threading
import time
from wsgiref.simple_server import WSGIServer

import redis
import structlog
from borrowd.adapters.pool_registry import register_pools
from borrowd.adapters.pool_store import RedisPoolElection, RedisPoolStore
from borrowd.adapters.redis_conn import connect, redact_url
from borrowd.adapters.store import BudgetStore, LeaderElection
from borrowd.controller.cli.logs import configure_logging
from borrowd.controller.config import BorrowdConfig, example_config, load_config
from borrowd.controller.daemon import Daemon
from borrowd.controller.loop import PoolLoop
from borrowd.controller.loop_metrics import DaemonMetrics
from borrowd.controller.pools import build_policies
from borrowd.controller.prom_source import PrometheusSource, connect_prometheus
from borrowd.controller.sdnotify import Notifier
from borrowd.models.errors import ConfigError
from prometheus_client import CollectorRegistry, start_http_server

QUERY_ERROR_LOG_PERIOD_S = 60.0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `run` and `config` subcommands."""
    run = subparsers.add_parser(
        "run", help="run the controller daemon (publishes budgets to Redis)",
        description="Tick every pool: read Prometheus, decide the batch budget, publish it to "
        "Redis while leader. SIGTERM stops cleanly and releases the leader lease.",
    )
    run.add_argument("--config", required=True, metavar="FILE", help="daemon config (TOML)")
    run.set_defaults(func=_run)

    config = subparsers.add_parser("config", help="check or print the daemon's configuration")
    actions = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    check = actions.add_parser(
        "check", help="validate a config file (and load its plant files); exit 2 on error"
    )
    check.add_argument("file", metavar="FILE", help="daemon config (TOML)")
    check.set_defaults(func=_check)
    example = actions.add_parser("example", help="print the documented example config")
    example.set_defaults(func=_example)


def _run(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    configure_logging(config.daemon.log_level)
    build_policies(config)  # plant files and law settings fail here, before Redis
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    run(config, stop, notifier=Notifier())
    return 0


def _check(args: argparse.Namespace) -> int:
    config = load_config(args.file)
    build_policies(config)
    pools = ", ".join(
        f"{pool.name} (law {pool.controller.law}, tick {pool.tick_s:g} s)" for pool in config.pools
    )
    print(f"{args.file}: ok; pools: {pools}")
    return 0


def _example(args: argparse.Namespace) -> int:
    print(example_config(), end="")
    return 0


def build_daemon(
    config: BorrowdConfig,
    *,
    redis_client: redis.Redis | None = None,
    notifier: Notifier | None = None,
) -> Daemon:
    """A `Daemon` for `config`: Prometheus source, Redis store and election, policies."""
    log = structlog.get_logger("borrowd.daemon")
    metrics = DaemonMetrics()
    client = redis_client or connect(
        config.redis.url,
        connect_timeout_s=config.redis.connect_timeout_s,
        socket_timeout_s=config.redis.socket_timeout_s,
    )
    prom = connect_prometheus(config.prometheus.url, config.prometheus.timeout_s)

    last_logged: dict[tuple[str, str, str], float] = {}

    def on_query_error(pool: str, field: str, kind: str, detail: str) -> None:
        metrics.errors.labels(pool, "prometheus", kind).inc()
        # Every failure is counted; a failure that repeats each tick is logged once a minute.
        key, now = (pool, field, kind), time.monotonic()
        if now - last_logged.get(key, -math.inf) >= QUERY_ERROR_LOG_PERIOD_S:
            last_logged[key] = now
            log.warning("prometheus_query_failed", pool=pool, field=field, kind=kind,
                        detail=detail)

    source = PrometheusSource(
        prom, window=config.prometheus.window, timeout_s=config.prometheus.timeout_s,
        on_error=on_query_error, slos={pool.name: pool.controller.slo() for pool in config.pools},
    )
    holder_id = config.daemon.resolved_holder_id()
    unregistered = register_pools(client, [p.name for p in config.pools], holder_id, time.time())
    if unregistered:
        log.warning("pool_registration_failed", error=unregistered)
    policies = build_policies(config)
    loops = {}
    for pool in config.pools:
        policy = policies[pool.name]
        loops[pool.name] = PoolLoop(
            pool.name,
            ttl_ms=pool.budget_ttl_ms,
            source=source,
            policy=policy,
            store=RedisPoolStore(BudgetStore(client, pool.name)),
            election=RedisPoolElection(
                LeaderElection(client, pool.name, holder_id, pool.leader_lease_ms)
            ),
            metrics=metrics,
            query_age_s=source.last_success_age_s,
            controller_state=policy.state,
            log=log.bind(pool=pool.name, holder_id=holder_id),
        )
    log.info(
        "daemon_configured",
        pools=[pool.name for pool in config.pools],
        holder_id=holder_id,
        redis=redact_url(config.redis.url),
        prometheus=config.prometheus.url,
        window=config.prometheus.window,
    )
    return Daemon(
        loops,
        {pool.name: pool.tick_s for pool in config.pools},
        metrics=metrics,
        notifier=notifier or Notifier(),
        log=log,
    )


def serve_metrics(listen: str, registry: CollectorRegistry) -> WSGIServer:
    """Serve `registry` at http://listen/metrics in a thread; the server (to shut down)."""
    host, _, port = listen.rpartition(":")
    try:
        server, _thread = start_http_server(int(port), addr=host.strip("[]") or "0.0.0.0",
                                            registry=registry)
    except OSError as exc:
        raise ConfigError(f"daemon.metrics_listen {listen}: {exc.strerror or exc}") from None
    return server


def run(config: BorrowdConfig, stop: threading.Event, *, notifier: Notifier | None = None) -> None:
    """Run the daemon for `config` until `stop` is set; /metrics served meanwhile."""
    daemon = build_daemon(config, notifier=notifier)
    server = None
    if config.daemon.metrics_listen:
        server = serve_metrics(config.daemon.metrics_listen, daemon.metrics.registry)
    try:
        daemon.run_until(stop)
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
