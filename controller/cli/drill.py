"""`borrowd drill stop`: prove that the stop switch restores the interactive SLOs, and how fast.

Sets the pool's stop switch, then measures from that moment: until the gate admits no batch
request (probed), until the batch work in flight has drained or been revoked (the gate's
reservations, then the proxies' in-flight gauge in Prometheus), and until the interactive
p95s recorded after the drain are within their SLOs (Prometheus). Then it resumes, prints the
times, writes them as JSON (`--out`) and keeps them at `borrowd:{POOL}:drill:stop`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import redis

from adapters.ceiling import drill_key, write_record
from adapters.gate import Gate
from adapters.redis_conn import connect, redact_url, resolve_redis_url
from adapters.store import BudgetStore
from controller.cli.ops import require_known_pool
from controller.cli.report import DEFAULT_PROMETHEUS, PROMETHEUS_ENV
from controller.pool_figures import instant, recorded_p95s
from controller.prom_source import PromClient, check_window, connect_prometheus
from models.errors import BorrowdError, InputError
from models.report import json_safe

POLL_GATE_S = 0.02
POLL_PROMETHEUS_S = 0.25


@dataclass(frozen=True)
class StopDrill:
    """Seconds from setting the stop switch to each milestone (None: not within the limit)."""

    pool: str
    started_at_s: float
    stop_written_s: float
    no_admission_s: float | None
    drained_gate_s: float | None
    drained_prometheus_s: float | None
    slo_restored_s: float | None
    batch_inflight_at_stop: int
    ttft_p95_at_stop_s: float
    itl_p95_at_stop_s: float
    ttft_p95_restored_s: float
    itl_p95_restored_s: float
    slo_ttft_p95_s: float
    slo_itl_p95_s: float
    resumed: bool

    @property
    def passed(self) -> bool:
        """True when every milestone was reached."""
        return None not in (self.no_admission_s, self.drained_gate_s,
                            self.drained_prometheus_s, self.slo_restored_s)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `drill` with its `stop` drill."""
    drill = subparsers.add_parser("drill", help="rollout drills on a live pool")
    kinds = drill.add_subparsers(dest="drill", metavar="DRILL", required=True)
    stop = kinds.add_parser(
        "stop", help="set the stop switch, time batch closing and the SLOs' return, resume",
        description=__doc__.split("\n\n")[1].replace("\n", " ") if __doc__ else None)
    stop.add_argument("--pool", required=True, help="pool name")
    stop.add_argument("--redis", default=None, metavar="URL",
                      help="Redis URL (default: $BORROWD_REDIS_URL, then "
                           "redis://127.0.0.1:6379/0)")
    stop.add_argument("--prometheus", metavar="URL", default=None,
                      help=f"Prometheus base URL (default ${PROMETHEUS_ENV}, then "
                           f"{DEFAULT_PROMETHEUS})")
    stop.add_argument("--window", default="15s",
                      help="recording-rule window of the p95s read (15s or 1m; default 15s)")
    stop.add_argument("--slo-ttft-s", type=float, default=1.0, help="p95 TTFT SLO, s")
    stop.add_argument("--slo-itl-s", type=float, default=0.05, help="p95 ITL SLO, s")
    stop.add_argument("--timeout-s", type=float, default=120.0,
                      help="longest wait for each milestone, s (default 120)")
    stop.add_argument("--out", type=Path, help="write the times here as JSON")
    stop.add_argument("--force", action="store_true",
                      help="drill a pool no daemon has registered (else refused, exit 2)")
    stop.set_defaults(func=cmd_drill_stop)


def _until(predicate: Callable[[], bool], start: float, timeout_s: float,
           interval_s: float) -> float | None:
    """Seconds from `start` (monotonic) until `predicate()` holds; None after `timeout_s`."""
    while True:
        if predicate():
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            return None
        time.sleep(interval_s)


def _probe(gate: Gate, counter: list[int]) -> bool:
    """True when the gate denies a one-token batch probe (released at once if admitted)."""
    counter[0] += 1
    request_id = f"borrowd-drill-probe-{os.getpid()}-{counter[0]}"
    admission = gate.admit(request_id, prompt_tokens=1, max_output_tokens=1)
    if admission.admitted:
        gate.release(request_id, output_tokens=0)
    return not admission.admitted


def _prometheus_drained(prom: PromClient, pool: str, after_s: float) -> bool:
    """True when the recorded batch in-flight sum, evaluated after `after_s`, is 0."""
    expr = f'pool_class:borrowd_proxy_inflight:sum{{pool="{pool}",class="batch"}}'
    stamp = instant(prom, f"timestamp({expr})")
    return stamp >= after_s and instant(prom, expr) == 0


def run_stop_drill(client: redis.Redis, prom: PromClient, pool: str, *, window: str,
                   slo_ttft_s: float, slo_itl_s: float, timeout_s: float,
                   report: Callable[[str], None]) -> StopDrill:
    """Stop, measure the milestones, resume (always); the times."""
    store = BudgetStore(client, pool)
    gate = Gate(client, pool)
    before = recorded_p95s(prom, pool, window)
    inflight = gate.inflight().seqs
    started_at_s = time.time()
    start = time.monotonic()
    store.stop(f"borrowd drill stop at {started_at_s:.0f}")
    resumed = False
    try:
        stop_written_s = time.monotonic() - start
        report(f"stop switch set ({stop_written_s * 1000:.1f} ms); {inflight} batch "
               f"sequences in flight; p95 TTFT {before.ttft_p95_s:.3g} s, "
               f"ITL {before.itl_p95_s:.3g} s")
        counter = [0]
        no_admission_s = _until(lambda: _probe(gate, counter), start, timeout_s, POLL_GATE_S)
        report(f"no batch admitted after {_secs(no_admission_s)}")
        drained_gate_s = _until(lambda: gate.inflight().seqs == 0, start, timeout_s,
                                POLL_GATE_S)
        report(f"in-flight batch drained or revoked (gate) after {_secs(drained_gate_s)}")
        drained_at_s = started_at_s + (drained_gate_s or 0.0)
        drained_prometheus_s = _until(lambda: _prometheus_drained(prom, pool, drained_at_s),
                                      start, timeout_s, POLL_PROMETHEUS_S)
        report(f"in-flight batch 0 in Prometheus after {_secs(drained_prometheus_s)}")
        latest = [before]

        def restored() -> bool:
            latest[0] = recorded_p95s(prom, pool, window)
            now = latest[0]
            return (now.evaluated_at_s >= drained_at_s
                    and not now.ttft_p95_s > slo_ttft_s and not now.itl_p95_s > slo_itl_s)

        slo_restored_s = _until(restored, start, timeout_s, POLL_PROMETHEUS_S)
        report(f"interactive p95s within SLO after {_secs(slo_restored_s)} (TTFT "
               f"{latest[0].ttft_p95_s:.3g} s, ITL {latest[0].itl_p95_s:.3g} s)")
    finally:
        resumed = store.resume()
        report("resumed" if resumed else "stop switch was already cleared by someone else")
    return StopDrill(
        pool=pool, started_at_s=started_at_s, stop_written_s=stop_written_s,
        no_admission_s=no_admission_s, drained_gate_s=drained_gate_s,
        drained_prometheus_s=drained_prometheus_s, slo_restored_s=slo_restored_s,
        batch_inflight_at_stop=inflight, ttft_p95_at_stop_s=before.ttft_p95_s,
        itl_p95_at_stop_s=before.itl_p95_s, ttft_p95_restored_s=latest[0].ttft_p95_s,
        itl_p95_restored_s=latest[0].itl_p95_s, slo_ttft_p95_s=slo_ttft_s,
        slo_itl_p95_s=slo_itl_s, resumed=resumed)


def _secs(value: float | None) -> str:
    return "NOT REACHED" if value is None else f"{value:.3f} s"


def drill_json(drill: StopDrill) -> dict:
    """The drill as strict JSON (NaN as null), with `passed`."""
    data = json_safe(asdict(drill))
    assert isinstance(data, dict)
    return {**data, "passed": drill.passed}


def cmd_drill_stop(args: argparse.Namespace) -> int:
    """Run the stop drill; exit 0 when every milestone was reached, 1 otherwise."""
    check_window(args.window)
    for name in ("slo_ttft_s", "slo_itl_s", "timeout_s"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise InputError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    url = resolve_redis_url(args.redis)
    prom = connect_prometheus(args.prometheus or os.environ.get(PROMETHEUS_ENV)
                              or DEFAULT_PROMETHEUS, 10.0)
    try:
        client = connect(url)
        require_known_pool(client, args.pool, args.force)
        reason = BudgetStore(client, args.pool).stop_reason()
        if reason is not None:
            raise BorrowdError(f"pool {args.pool!r} is already stopped ({reason}); a drill "
                               "stops and resumes the pool itself")
        drill = run_stop_drill(client, prom, args.pool, window=args.window,
                               slo_ttft_s=args.slo_ttft_s, slo_itl_s=args.slo_itl_s,
                               timeout_s=args.timeout_s,
                               report=lambda line: print(f"drill stop: {line}", flush=True))
        record = drill_json(drill)
        write_record(client, drill_key(args.pool, "stop"), record)
    except redis.RedisError as exc:
        raise BorrowdError(f"Redis at {redact_url(url)}: {exc}") from None
    text = json.dumps(record, indent=1, sort_keys=True)
    if args.out is not None:
        args.out.write_text(text)
    print(text)
    return 0 if drill.passed else 1
