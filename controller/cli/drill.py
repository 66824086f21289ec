"""`borrowd drill stop|burst|failure`: prove that stopping, an interactive burst or a failed replica
takes batch out of the way and the interactive SLOs come back, and how fast.

stop: sets the pool's stop switch, then measures from that moment: until the gate admits no
batch request (probed), until the batch work in flight has drained or been revoked (the
gate's reservations, then the proxies' in-flight gauge in Prometheus), and until the
interactive p95s recorded after the drain are within their SLOs (Prometheus). Then it
resumes.

burst: while batch is admitted, sends extra interactive chat through the proxy (the chat
trace replayed at --rate-scale for --duration-s) and measures from the burst's start: until
the controller's budget admits no batch, until the batch in flight is gone (gate), the
highest recorded interactive p95s, and from the burst's end until the recorded p95s are
within SLO again.

failure: while batch is admitted, runs --fail-command (what takes a replica down: `systemctl
stop ...`, or `kill -STOP PID` of an emulated engine), holds it --down-s, runs
--restore-command, and measures from the failure: until batch is no longer admitted (if the
controller cuts at all), the drain, the highest recorded p95s, the interactive errors; and
from the restore: until the recorded p95s are within SLO and batch is admitted again.

Each drill prints its times, writes them as JSON (`--out`) and keeps them at
`borrowd:{POOL}:drill:{stop|burst|failure}`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import redis
from borrowd.adapters.ceiling import drill_key, write_record
from borrowd.adapters.gate import Gate
from borrowd.adapters.loadgen import LoadgenConfig, run_load, summarize
from borrowd.adapters.redis_conn import connect, redact_url, resolve_redis_url
from borrowd.adapters.store import BudgetStore
from borrowd.controller.cli.ops import require_known_pool
from borrowd.controller.cli.report import (
    DEFAULT_PROMETHEUS,
    PROMETHEUS_ENV,
    add_fleet_arguments,
)
from borrowd.controller.pool_figures import instant, recorded_p95s
from borrowd.controller.prom_source import PromClient, check_window, connect_prometheus
from borrowd.models.errors import BorrowdError, InputError
from borrowd.models.report import json_safe
from borrowd.models.sim.trace import Lengths, Trace, load_trace, resolve_trace

POLL_GATE_S = 0.02
POLL_PROMETHEUS_S = 0.25
# The burst sends interactive requests only (no batch workers draw from this).
NO_BATCH = Lengths(Path("none"), np.zeros(0, dtype=int), np.zeros(0, dtype=int))


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


def _common(parser: argparse.ArgumentParser) -> None:
    add_fleet_arguments(parser)
    parser.add_argument("--window", default="15s",
                        help="recording-rule window of the p95s read (15s or 1m; default 15s)")
    parser.add_argument("--slo-ttft-s", type=float, default=1.0, help="p95 TTFT SLO, s")
    parser.add_argument("--slo-itl-s", type=float, default=0.05, help="p95 ITL SLO, s")
    parser.add_argument("--timeout-s", type=float, default=120.0,
                        help="longest wait for each milestone, s (default 120)")
    parser.add_argument("--out", type=Path, help="write the times here as JSON")
    parser.add_argument("--force", action="store_true",
                        help="drill a pool no daemon has registered (else refused, exit 2)")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `drill` with its `stop`, `burst` and `failure` drills."""
    drill = subparsers.add_parser("drill", help="rollout drills on a live pool")
    kinds = drill.add_subparsers(dest="drill", metavar="DRILL", required=True)
    stop = kinds.add_parser(
        "stop", help="set the stop switch, time batch closing and the SLOs' return, resume")
    _common(stop)
    stop.set_defaults(func=cmd_drill_stop)
    burst = kinds.add_parser(
        "burst", help="send an interactive burst while batch runs; time the cut and recovery")
    _common(burst)
    burst.add_argument("--proxy", required=True, metavar="URL", help="proxy base URL")
    burst.add_argument("--interactive-key", required=True, help="API key of an interactive "
                                                                "tenant")
    burst.add_argument("--model", default="emulated-llama-3-8b", help="model name to request")
    burst.add_argument("--rate-scale", type=float, default=3.0,
                       help="burst rate: trace seconds per wall second (default 3)")
    burst.add_argument("--duration-s", type=float, default=30.0,
                       help="burst length, s (default 30)")
    burst.add_argument("--max-output-tokens", type=int, default=64,
                       help="clip of the trace's output lengths (default 64)")
    burst.add_argument("--trace", default="azure2023_conv.csv", help="interactive trace")
    burst.set_defaults(func=cmd_drill_burst)
    failure = kinds.add_parser(
        "failure", help="take a replica down while batch runs (your command); time the "
                        "reaction and the recovery")
    _common(failure)
    failure.add_argument("--fail-command", required=True,
                         help="command that takes a replica down (run without a shell)")
    failure.add_argument("--restore-command", required=True,
                         help="command that brings it back (run without a shell)")
    failure.add_argument("--down-s", type=float, default=30.0,
                         help="how long the replica stays down, s (default 30)")
    failure.set_defaults(func=cmd_drill_failure)


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


@dataclass(frozen=True)
class BurstDrill:
    """Seconds from the burst's start to the cut and drain, from its end to the SLOs' return
    (None: not within the limit); the highest recorded p95s; the burst's own requests."""

    pool: str
    started_at_s: float
    duration_s: float
    rate_scale: float
    no_admission_s: float | None
    drained_gate_s: float | None
    slo_restored_after_end_s: float | None
    ttft_p95_peak_s: float
    itl_p95_peak_s: float
    slo_ttft_p95_s: float
    slo_itl_p95_s: float
    burst_requests: int
    burst_success_rate: float | None
    burst_ttft_p95_s: float | None

    @property
    def passed(self) -> bool:
        """True when batch was cut, drained, and the SLOs came back."""
        return None not in (self.no_admission_s, self.drained_gate_s,
                            self.slo_restored_after_end_s)


def _burst_in_thread(config: LoadgenConfig, trace: Trace) -> tuple[threading.Thread, list]:
    """Run the burst's requests (no batch workers) in a thread; its records land in the
    returned list."""
    out: list = []

    def run() -> None:
        try:
            out.extend(asyncio.run(run_load(config, trace, NO_BATCH)))
        except Exception as exc:  # re-raised by the caller, from `out`
            out.append(exc)

    thread = threading.Thread(target=run, name="drill-burst", daemon=True)
    thread.start()
    return thread, out


def run_burst_drill(client: redis.Redis, prom: PromClient, pool: str, config: LoadgenConfig,
                    trace: Trace, *, window: str, slo_ttft_s: float, slo_itl_s: float,
                    timeout_s: float, report: Callable[[str], None]) -> BurstDrill:
    """Send the burst, watch the budget, the gate and the recorded p95s; the times."""
    store = BudgetStore(client, pool)
    gate = Gate(client, pool)
    started_at_s = time.time()
    start = time.monotonic()
    thread, records = _burst_in_thread(config, trace)
    report(f"burst of {config.rate_scale:g}x the trace for {config.duration_s:g} s started")
    cut_s = drained_s = restored_s = None
    peaks = [0.0, 0.0]
    next_prom = start
    while time.monotonic() - start < config.duration_s + timeout_s:
        now = time.monotonic()
        if cut_s is None:
            budget = store.read(time.time())
            if budget is None or not budget.admits_batch:
                cut_s = now - start
                why = f"{budget.mode.value}: {budget.reason}" if budget else "no record"
                report(f"no batch admitted after {cut_s:.3f} s ({why})")
        if cut_s is not None and drained_s is None and gate.inflight().seqs == 0:
            drained_s = now - start
            report(f"in-flight batch drained or revoked (gate) after {drained_s:.3f} s")
        if now >= next_prom:
            next_prom = now + POLL_PROMETHEUS_S
            p95s = recorded_p95s(prom, pool, window)
            peaks = [max(peaks[0], _finite(p95s.ttft_p95_s)),
                     max(peaks[1], _finite(p95s.itl_p95_s))]
            ended_at_s = started_at_s + config.duration_s
            if (restored_s is None and p95s.evaluated_at_s >= ended_at_s
                    and not p95s.ttft_p95_s > slo_ttft_s and not p95s.itl_p95_s > slo_itl_s):
                restored_s = p95s.evaluated_at_s - ended_at_s
                report(f"interactive p95s within SLO {restored_s:.3f} s after the burst ended "
                       f"(TTFT {p95s.ttft_p95_s:.3g} s, ITL {p95s.itl_p95_s:.3g} s)")
        # Restored SLOs end the watch only once the cut's drain is timed too: a cut by the
        # law (admission stopped, nothing revoked) drains as its in-flight requests finish.
        if restored_s is not None and (cut_s is None or drained_s is not None):
            break
        time.sleep(POLL_GATE_S)
    thread.join(timeout=config.request_timeout_s)
    failure = next((r for r in records if isinstance(r, Exception)), None)
    if failure is not None:
        raise failure
    summary = summarize(records)
    report(f"burst: {summary['interactive_requests']} requests, success rate "
           f"{summary['interactive_success_rate']}, client p95 TTFT "
           f"{summary['interactive_ttft_p95_s']}")
    return BurstDrill(
        pool=pool, started_at_s=started_at_s, duration_s=config.duration_s,
        rate_scale=config.rate_scale, no_admission_s=cut_s, drained_gate_s=drained_s,
        slo_restored_after_end_s=restored_s, ttft_p95_peak_s=peaks[0], itl_p95_peak_s=peaks[1],
        slo_ttft_p95_s=slo_ttft_s, slo_itl_p95_s=slo_itl_s,
        burst_requests=summary["interactive_requests"],
        burst_success_rate=summary["interactive_success_rate"],
        burst_ttft_p95_s=summary["interactive_ttft_p95_s"])


@dataclass(frozen=True)
class FailureDrill:
    """Seconds from the failure to the cut and drain (None: no cut, or not drained), from the
    restore to the SLOs' return and to batch admitted again; peaks and interactive errors."""

    pool: str
    started_at_s: float
    down_s: float
    fail_command: str
    restore_command: str
    no_admission_s: float | None
    drained_gate_s: float | None
    ttft_p95_peak_s: float
    itl_p95_peak_s: float
    oldest_wait_peak_s: float
    interactive_errors: float
    slo_restored_after_restore_s: float | None
    batch_admitted_after_restore_s: float | None
    slo_ttft_p95_s: float
    slo_itl_p95_s: float

    @property
    def passed(self) -> bool:
        """True when the SLOs came back after the restore."""
        return self.slo_restored_after_restore_s is not None


def _run_command(command: str, what: str) -> None:
    """Run an operator's command without a shell; BorrowdError naming it when it fails."""
    try:
        done = subprocess.run(shlex.split(command), capture_output=True, text=True,
                              timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BorrowdError(f"{what} {command!r} failed: {exc}") from None
    if done.returncode != 0:
        raise BorrowdError(f"{what} {command!r} exited {done.returncode}: "
                           f"{done.stderr.strip()[-300:]}")


def run_failure_drill(client: redis.Redis, prom: PromClient, pool: str, *, fail_command: str,
                      restore_command: str, down_s: float, window: str, slo_ttft_s: float,
                      slo_itl_s: float, timeout_s: float,
                      report: Callable[[str], None]) -> FailureDrill:
    """Fail, watch, restore (always), watch the recovery; the times."""
    store = BudgetStore(client, pool)
    gate = Gate(client, pool)
    started_at_s = time.time()
    start = time.monotonic()
    cut_s = drained_s = None
    peaks = [0.0, 0.0, 0.0]
    oldest_wait = ("pool_class:borrowd_proxy_oldest_wait_seconds:max"
                   f'{{pool="{pool}",class="interactive"}}')

    def watch(until: float) -> None:
        nonlocal cut_s, drained_s
        next_prom = time.monotonic()
        while time.monotonic() < until:
            now = time.monotonic()
            if cut_s is None:
                budget = store.read(time.time())
                if budget is None or not budget.admits_batch:
                    cut_s = now - start
                    report(f"no batch admitted after {cut_s:.3f} s")
            if cut_s is not None and drained_s is None and gate.inflight().seqs == 0:
                drained_s = now - start
                report(f"in-flight batch drained or revoked (gate) after {drained_s:.3f} s")
            if now >= next_prom:
                next_prom = now + POLL_PROMETHEUS_S
                p95s = recorded_p95s(prom, pool, window)
                # A stalled stream yields no token gap until it moves again; the oldest
                # interactive wait for a first token shows the stall meanwhile.
                peaks[:] = [max(peaks[0], _finite(p95s.ttft_p95_s)),
                            max(peaks[1], _finite(p95s.itl_p95_s)),
                            max(peaks[2], _finite(instant(prom, oldest_wait)))]
            time.sleep(POLL_GATE_S)

    try:
        _run_command(fail_command, "--fail-command")
        report(f"replica down ({fail_command}); holding {down_s:g} s")
        watch(start + down_s)
    finally:
        _run_command(restore_command, "--restore-command")
    restored_at_s = time.time()
    restore = time.monotonic()
    report(f"replica restored ({restore_command}) after {restore - start:.1f} s")

    def within_slo() -> bool:
        p95s = recorded_p95s(prom, pool, window)
        return (p95s.evaluated_at_s >= restored_at_s and not p95s.ttft_p95_s > slo_ttft_s
                and not p95s.itl_p95_s > slo_itl_s)

    restored_s = _until(within_slo, restore, timeout_s, POLL_PROMETHEUS_S)
    report(f"interactive p95s within SLO {_secs(restored_s)} after the restore")
    reopened_s = _until(lambda: bool((b := store.read(time.time())) and b.admits_batch),
                        restore, timeout_s, POLL_PROMETHEUS_S)
    report(f"batch admitted again {_secs(reopened_s)} after the restore")
    errors = instant(prom, "sum(increase(borrowd_proxy_requests_total{"
                           f'pool="{pool}",class="interactive",'
                           'outcome=~"error|truncated|timeout"}'
                           f"[{max(1, round(time.time() - started_at_s))}s]))")
    return FailureDrill(
        pool=pool, started_at_s=started_at_s, down_s=down_s, fail_command=fail_command,
        restore_command=restore_command, no_admission_s=cut_s, drained_gate_s=drained_s,
        ttft_p95_peak_s=peaks[0], itl_p95_peak_s=peaks[1], oldest_wait_peak_s=peaks[2],
        interactive_errors=0.0 if math.isnan(errors) else errors,
        slo_restored_after_restore_s=restored_s, batch_admitted_after_restore_s=reopened_s,
        slo_ttft_p95_s=slo_ttft_s, slo_itl_p95_s=slo_itl_s)


def cmd_drill_failure(args: argparse.Namespace) -> int:
    """Run the failure drill; exit 0 when the SLOs came back after the restore, 1 otherwise."""
    _check_common(args)
    if not (math.isfinite(args.down_s) and args.down_s > 0):
        raise InputError(f"--down-s must be > 0, got {args.down_s}")
    for flag, command in (("--fail-command", args.fail_command),
                          ("--restore-command", args.restore_command)):
        if not shlex.split(command):
            raise InputError(f"{flag} is empty")
    url = resolve_redis_url(args.redis)
    prom = connect_prometheus(args.prometheus or os.environ.get(PROMETHEUS_ENV)
                              or DEFAULT_PROMETHEUS, 10.0)
    try:
        client = connect(url)
        require_known_pool(client, args.pool, args.force)
        budget = BudgetStore(client, args.pool).read(time.time())
        if budget is None or not budget.admits_batch:
            raise BorrowdError(f"pool {args.pool!r} admits no batch now; a failure drill "
                               "measures borrowing under a failure, so run it while batch is "
                               "admitted")
        drill = run_failure_drill(
            client, prom, args.pool, fail_command=args.fail_command,
            restore_command=args.restore_command, down_s=args.down_s, window=args.window,
            slo_ttft_s=args.slo_ttft_s, slo_itl_s=args.slo_itl_s, timeout_s=args.timeout_s,
            report=lambda line: print(f"drill failure: {line}", flush=True))
        _finish(client, args.pool, "failure", _drill_json(drill), args.out)
    except redis.RedisError as exc:
        raise BorrowdError(f"Redis at {redact_url(url)}: {exc}") from None
    return 0 if drill.passed else 1


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0


def _check_common(args: argparse.Namespace) -> None:
    check_window(args.window)
    for name in ("slo_ttft_s", "slo_itl_s", "timeout_s"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise InputError(f"--{name.replace('_', '-')} must be > 0, got {value}")


def _finish(client: redis.Redis, pool: str, kind: str, record: dict, out: Path | None) -> None:
    write_record(client, drill_key(pool, kind), record)
    text = json.dumps(record, indent=1, sort_keys=True)
    if out is not None:
        out.write_text(text)
    print(text)


def cmd_drill_burst(args: argparse.Namespace) -> int:
    """Run the burst drill; exit 0 when batch was cut and the SLOs came back, 1 otherwise."""
    _check_common(args)
    config = LoadgenConfig(
        proxy_url=args.proxy.rstrip("/"), interactive_key=args.interactive_key,
        batch_key=args.interactive_key, model=args.model, duration_s=args.duration_s,
        rate_scale=args.rate_scale, interactive_max_output_tokens=args.max_output_tokens,
        batch_workers=0)
    trace = load_trace(resolve_trace(args.trace))
    url = resolve_redis_url(args.redis)
    prom = connect_prometheus(args.prometheus or os.environ.get(PROMETHEUS_ENV)
                              or DEFAULT_PROMETHEUS, 10.0)
    try:
        client = connect(url)
        require_known_pool(client, args.pool, args.force)
        budget = BudgetStore(client, args.pool).read(time.time())
        if budget is None or not budget.admits_batch:
            raise BorrowdError(f"pool {args.pool!r} admits no batch now; a burst drill "
                               "measures how borrowing gets out of the way, so run it while "
                               "batch is admitted")
        drill = run_burst_drill(client, prom, args.pool, config, trace, window=args.window,
                                slo_ttft_s=args.slo_ttft_s, slo_itl_s=args.slo_itl_s,
                                timeout_s=args.timeout_s,
                                report=lambda line: print(f"drill burst: {line}", flush=True))
        _finish(client, args.pool, "burst", _drill_json(drill), args.out)
    except redis.RedisError as exc:
        raise BorrowdError(f"Redis at {redact_url(url)}: {exc}") from None
    return 0 if drill.passed else 1


def _drill_json(drill: StopDrill | BurstDrill | FailureDrill) -> dict:
    """A drill as strict JSON (NaN as null), with `passed`."""
    data = json_safe(asdict(drill))
    assert isinstance(data, dict)
    return {**data, "passed": drill.passed}


def cmd_drill_stop(args: argparse.Namespace) -> int:
    """Run the stop drill; exit 0 when every milestone was reached, 1 otherwise."""
    _check_common(args)
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
        _finish(client, args.pool, "stop", _drill_json(drill), args.out)
    except redis.RedisError as exc:
        raise BorrowdError(f"Redis at {redact_url(url)}: {exc}") from None
    return 0 if drill.passed else 1
