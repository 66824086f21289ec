"""Operator commands on a pool's budget bus: `stop`, `resume`, `status`, and the `gate` service.

Every command takes `--redis URL` (default: env BORROWD_REDIS_URL, then
redis://127.0.0.1:6379/0).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Iterator
from typing import cast

import redis
from borrowd.adapters import gate_http
from borrowd.adapters.gate import BATCH_PRIORITY, DEFAULT_LEASE_MS, Gate
from borrowd.adapters.pool_registry import PoolRegistry
from borrowd.adapters.redis_conn import connect, redact_url, resolve_redis_url
from borrowd.adapters.store import BudgetStore, PoolKeys
from borrowd.models.config_loader import load_toml
from borrowd.models.errors import BorrowdError, ConfigError, InputError


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `stop`, `resume`, `status` and `gate`."""
    stop = subparsers.add_parser(
        "stop", help="stop batch borrowing in a pool now (outranks the controller)")
    _common(stop)
    _force(stop)
    stop.add_argument("--reason", required=True, help="why (kept with the stop switch)")
    stop.set_defaults(func=cmd_stop)

    resume = subparsers.add_parser("resume", help="clear a pool's stop switch")
    _common(resume)
    _force(resume)
    resume.set_defaults(func=cmd_resume)

    status = subparsers.add_parser(
        "status", help="show a pool's budget record, stop switch and batch work in flight")
    _common(status)
    _force(status)
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.set_defaults(func=cmd_status)

    gate = subparsers.add_parser(
        "gate", help="serve batch admission over HTTP (nginx auth_request, Envoy, routers)",
        description="Serve batch admission over HTTP. Settings come from --config (a [gate] "
        "table) and the flags, flags winning; callers authenticate with a shared secret "
        f"([[gate.callers]] or ${gate_http.SECRET_ENV}); without one the gate serves only on "
        "loopback.")
    gate.add_argument("--config", metavar="FILE", help="gate config (TOML, a [gate] table)")
    gate.add_argument("--pool", action="append", metavar="NAME",
                      help="pool served (repeat for several; the first is the default)")
    gate.add_argument("--redis", default=None, metavar="URL",
                      help="Redis URL (default: $BORROWD_REDIS_URL, then "
                           "redis://127.0.0.1:6379/0)")
    gate.add_argument("--listen", metavar="HOST:PORT",
                      help=f"address to serve on (default {gate_http.DEFAULT_LISTEN})")
    gate.add_argument("--lease-ms", type=int,
                      help=f"admission lease in ms unless renewed (default {DEFAULT_LEASE_MS})")
    gate.add_argument("--batch-priority", type=int,
                      help="vLLM priority injected for batch (lower is served first; "
                           f"default {BATCH_PRIORITY})")
    gate.add_argument("--decision-timeout-s", type=float,
                      help="longest wait on Redis before batch is denied, in seconds "
                           f"(default {gate_http.DEFAULT_DECISION_TIMEOUT_S})")
    gate.set_defaults(func=cmd_gate)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pool", required=True, help="pool name")
    parser.add_argument("--redis", default=None, metavar="URL",
                        help="Redis URL (default: $BORROWD_REDIS_URL, then "
                             "redis://127.0.0.1:6379/0)")


def _force(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--force", action="store_true",
                        help="act on a pool no daemon has registered (else refused, exit 2)")


def require_known_pool(client: redis.Redis, pool: str, force: bool) -> None:
    """Raise `BorrowdError` naming the known pools unless `pool` is registered or `force`."""
    PoolKeys(pool)  # a malformed name is an InputError of its own
    registry = PoolRegistry(client)
    if force or registry.exists(pool):
        return
    known = ", ".join(sorted(registry.known())) or "none"
    raise BorrowdError(f"pool {pool!r} is not known: no daemon has registered or led it "
                       f"(known pools: {known}); --force acts on it anyway")


@contextlib.contextmanager
def _redis_errors(url: str) -> Iterator[None]:
    try:
        yield
    except redis.RedisError as exc:
        raise BorrowdError(f"Redis at {redact_url(url)}: {exc}") from None


def cmd_stop(args: argparse.Namespace) -> int:
    """Set the stop switch and write a stopped record at once."""
    url = resolve_redis_url(args.redis)
    with _redis_errors(url):
        client = connect(url)
        require_known_pool(client, args.pool, args.force)
        record = BudgetStore(client, args.pool).stop(args.reason)
    print(f"pool {args.pool}: stopped (epoch {record.epoch}, seq {record.seq}): {args.reason}")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    """Clear the stop switch."""
    url = resolve_redis_url(args.redis)
    with _redis_errors(url):
        client = connect(url)
        require_known_pool(client, args.pool, args.force)
        was_set = BudgetStore(client, args.pool).resume()
    state = "resumed; the controller's next record takes over" if was_set else "was not stopped"
    print(f"pool {args.pool}: {state}")
    return 0


def pool_status(client: redis.Redis, pool: str, now_s: float) -> dict:
    """Everything `status` shows, as a JSON-ready dict."""
    keys = PoolKeys(pool)
    store = BudgetStore(client, pool)
    read = store.read_record(now_s)
    fields = cast(dict[str, str], client.hgetall(keys.budget))
    inflight = Gate(client, pool).inflight()
    record = None
    if fields:
        issued_at = _float_or_none(fields.get("issued_at"))
        record = {
            **fields,
            "age_s": None if issued_at is None else round(now_s - issued_at, 3),
            "lease_left_ms": max(client.pttl(keys.budget), 0),
        }
    return {
        "pool": pool,
        "usable": read.budget is not None and read.budget.admits_batch,
        "read_status": read.status.value,
        "read_detail": read.detail,
        "record": record,
        "epoch_counter": int(client.get(keys.epoch) or 0),
        "leader": client.get(keys.leader),
        "stop_switch": store.stop_reason(),
        "inflight": {"batch_seqs": inflight.seqs, "batch_kv_tokens": inflight.kv_tokens,
                     "bucket_tokens": inflight.bucket_tokens},
        "revocations_kept": client.xlen(keys.revoke),
    }


def _float_or_none(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def cmd_status(args: argparse.Namespace) -> int:
    """Print the pool's record, its age, mode, epoch, seq, stop switch and in-flight work."""
    url = resolve_redis_url(args.redis)
    with _redis_errors(url):
        client = connect(url)
        require_known_pool(client, args.pool, args.force)
        status = pool_status(client, args.pool, time.time())
    if args.json:
        print(json.dumps(status, sort_keys=True))
        return 0
    record = status["record"]
    print(f"pool          {status['pool']}")
    if record is None:
        print("record        none (no batch work admitted)")
    else:
        print(f"record        mode={record.get('mode')} epoch={record.get('epoch')} "
              f"seq={record.get('seq')} age={record['age_s']}s "
              f"lease_left={record['lease_left_ms']}ms")
        print(f"reason        {record.get('reason', '')}")
        print(f"budget        {record.get('batch_tokens_per_s')} tokens/s, "
              f"burst {record.get('batch_burst_tokens')}, "
              f"seqs <= {record.get('max_batch_seqs')}, "
              f"kv <= {record.get('max_batch_kv_tokens')}, "
              f"output <= {record.get('max_batch_output_tokens')}")
    detail = f" ({status['read_detail']})" if status["read_detail"] else ""
    print(f"read          {status['read_status']}{detail}; "
          f"admits batch: {'yes' if status['usable'] else 'no'}")
    print(f"epoch counter {status['epoch_counter']} (leader: {status['leader'] or 'none'})")
    print(f"stop switch   {status['stop_switch'] or 'off'}")
    inflight = status["inflight"]
    print(f"in flight     {inflight['batch_seqs']} batch seqs, "
          f"{inflight['batch_kv_tokens']} KV tokens reserved, "
          f"bucket {inflight['bucket_tokens']}")
    print(f"revocations   {status['revocations_kept']} kept on the stream")
    return 0


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InputError(f"--listen must be HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def gate_settings(args: argparse.Namespace) -> gate_http.GateServiceConfig:
    """The gate's config: the --config file's [gate] table with the flags given on top."""
    if args.listen is not None:
        _listen(args.listen)
    if args.lease_ms is not None and args.lease_ms <= 0:
        raise InputError(f"--lease-ms must be > 0, got {args.lease_ms}")
    if args.decision_timeout_s is not None and not args.decision_timeout_s > 0:
        raise InputError(f"--decision-timeout-s must be > 0, got {args.decision_timeout_s}")
    for pool in args.pool or ():
        PoolKeys(pool)  # raises InputError naming a bad pool name before serving
    data = load_toml(args.config, "gate config") if args.config else {}
    table = data.get("gate", {})
    if not isinstance(table, dict):
        raise InputError(f"gate config {args.config}: gate: must be a table")
    flags = {"pools": args.pool, "listen": args.listen, "redis_url": args.redis,
             "lease_ms": args.lease_ms, "batch_priority": args.batch_priority,
             "decision_timeout_s": args.decision_timeout_s}
    table = {**table, **{key: value for key, value in flags.items() if value is not None}}
    if "pools" not in table:
        raise InputError("--pool is required (or pools in the --config file's [gate] table)")
    try:
        return gate_http.gate_config({**data, "gate": table})
    except ConfigError as exc:
        where = f"gate config {args.config}: " if args.config else ""
        raise ConfigError(f"{where}{exc}") from None


def cmd_gate(args: argparse.Namespace) -> int:
    """Serve batch admission over HTTP until SIGTERM."""
    gate_http.run(gate_settings(args))
    return 0
