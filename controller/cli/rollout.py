"""`borrowd rollout`: raise a pool's batch budget ceiling in measured steps, keep the last good.

First an interactive-only baseline (ceiling 0: batch closed); then each step writes the
ceiling (`borrowd:{POOL}:ceiling`, which the daemon's store clamps every budget to), lets it
settle, and holds long enough for the p95 and p99 estimates at the current interactive rate
(`models.rollout.plan_hold`, printed). After each hold the interactive figures are judged
against the SLOs and the baseline (`models.rollout.burns`); a burn, or a recorded short-window
p95 past its SLO during the hold, ends the rollout at the last good step (0 when none was
good). The accepted ceiling stays in Redis; the run is kept at `borrowd:{POOL}:rollout`.
Start with a small set of replicas eligible for batch (the proxy's `batch_upstreams`, the
engines' `BORROWD_BATCH_ELIGIBLE`, the pool's `batch_replicas`) and widen it step by step.
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
from borrowd.adapters.ceiling import read_ceiling, rollout_key, write_ceiling, write_record
from borrowd.adapters.redis_conn import connect, redact_url, resolve_redis_url
from borrowd.controller.cli.ops import require_known_pool
from borrowd.controller.cli.report import (
    DEFAULT_PROMETHEUS,
    PROMETHEUS_ENV,
    add_fleet_arguments,
)
from borrowd.controller.pool_figures import figures_over, instant, recorded_p95s, sample_rates
from borrowd.controller.prom_source import PromClient, check_window, connect_prometheus
from borrowd.models.errors import BorrowdError, InputError
from borrowd.models.report import json_safe
from borrowd.models.rollout import (
    HoldPlan,
    StepFigures,
    Tolerance,
    burns,
    check_steps,
    plan_hold,
    step_schedule,
)
from borrowd.models.signals import Slo

Say = Callable[[str], None]


@dataclass(frozen=True)
class RolloutSettings:
    """How the rollout steps, holds and judges."""

    steps: tuple[float, ...]
    quantiles: tuple[float, ...]
    tail_error: float
    min_hold_s: float
    max_hold_s: float
    settle_s: float
    poll_s: float
    window: str
    slo: Slo
    tolerance: Tolerance


@dataclass(frozen=True)
class StepResult:
    """One hold: its ceiling, plan, figures and verdict."""

    ceiling_tokens_per_s: float
    plan: HoldPlan
    held_s: float
    figures: StepFigures
    burning: tuple[str, ...]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `rollout`."""
    parser = subparsers.add_parser(
        "rollout", help="raise a pool's batch budget ceiling in measured steps",
        description=" ".join(__doc__.split("\n\n")[1].split()) if __doc__ else None)
    add_fleet_arguments(parser)
    parser.add_argument("--steps", help="ceilings in tokens/s, comma-separated, increasing "
                                        "(else --first/--growth/--max)")
    parser.add_argument("--first-tokens-per-s", type=float, default=2000.0,
                        help="first ceiling, tokens/s (default 2000)")
    parser.add_argument("--growth", type=float, default=2.0,
                        help="each next ceiling = previous x this (default 2)")
    parser.add_argument("--max-tokens-per-s", type=float, default=64000.0,
                        help="last ceiling, tokens/s (default 64000)")
    parser.add_argument("--quantiles", default="0.95,0.99",
                        help="quantiles each hold must estimate (default 0.95,0.99)")
    parser.add_argument("--tail-error", type=float, default=0.2,
                        help="relative error allowed on the count above each quantile at 95%% "
                             "confidence (default 0.2)")
    parser.add_argument("--min-hold-s", type=float, default=60.0,
                        help="shortest hold, s (default 60)")
    parser.add_argument("--max-hold-s", type=float, default=1800.0,
                        help="longest hold, s; shorter than needed is reported (default 1800)")
    parser.add_argument("--settle-s", type=float, default=30.0,
                        help="wait after writing a ceiling before the hold, s (default 30)")
    parser.add_argument("--poll-s", type=float, default=5.0,
                        help="progress and early-burn check period, s (default 5)")
    parser.add_argument("--window", default="15s",
                        help="recording-rule window of the early-burn check (15s or 1m)")
    parser.add_argument("--slo-ttft-s", type=float, default=1.0, help="p95 TTFT SLO, s")
    parser.add_argument("--slo-itl-s", type=float, default=0.05, help="p95 ITL SLO, s")
    parser.add_argument("--slo-success", type=float, default=0.99, help="success-rate SLO")
    parser.add_argument("--tolerance", type=float, default=0.25,
                        help="a p95 may rise this much above the baseline (default 0.25)")
    parser.add_argument("--tail-tolerance", type=float, default=1.0,
                        help="a p99 may rise this much above the baseline (default 1.0)")
    parser.add_argument("--out", type=Path, help="write the run as JSON here")
    parser.add_argument("--force", action="store_true",
                        help="roll out on a pool no daemon has registered (else exit 2)")
    parser.set_defaults(func=cmd_rollout)


def _floats(text: str, flag: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise InputError(f"{flag} must be comma-separated numbers, got {text!r}") from None


def settings_from(args: argparse.Namespace) -> RolloutSettings:
    """Validated settings from the flags (InputError naming the flag)."""
    steps = (check_steps(_floats(args.steps, "--steps")) if args.steps else
             step_schedule(args.first_tokens_per_s, args.growth, args.max_tokens_per_s))
    quantiles = _floats(args.quantiles, "--quantiles")
    if not quantiles or not all(0 < q < 1 for q in quantiles):
        raise InputError(f"--quantiles must lie in (0, 1), got {args.quantiles!r}")
    for name in ("tail_error", "min_hold_s", "max_hold_s", "poll_s", "slo_ttft_s", "slo_itl_s"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise InputError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    for name in ("settle_s", "tolerance", "tail_tolerance"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value >= 0):
            raise InputError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    if args.max_hold_s < args.min_hold_s:
        raise InputError("--max-hold-s must be >= --min-hold-s")
    if not 0 < args.slo_success <= 1:
        raise InputError(f"--slo-success must be in (0, 1], got {args.slo_success}")
    return RolloutSettings(
        steps=steps, quantiles=quantiles, tail_error=args.tail_error,
        min_hold_s=args.min_hold_s, max_hold_s=args.max_hold_s, settle_s=args.settle_s,
        poll_s=args.poll_s, window=check_window(args.window),
        slo=Slo(args.slo_ttft_s, args.slo_itl_s, args.slo_success),
        tolerance=Tolerance(p95=args.tolerance, p99=args.tail_tolerance))


def _plan(prom: PromClient, pool: str, settings: RolloutSettings, say: Say) -> HoldPlan:
    ttft_rate, itl_rate = sample_rates(prom, pool, 60.0)
    plan = plan_hold(settings.quantiles, settings.tail_error, ttft_rate, itl_rate,
                     settings.min_hold_s, settings.max_hold_s)
    quantile = max(settings.quantiles)
    line = (f"interactive: {ttft_rate:.2f} first tokens/s, {itl_rate:.1f} gaps/s; "
            f"p{quantile * 100:g} within {settings.tail_error:g} needs {plan.needed_samples} "
            f"samples = {plan.needed_s:.1f} s; holding {plan.hold_s:.1f} s")
    if plan.capped:
        line += " (capped by --max-hold-s: the tail estimate rests on fewer samples)"
    say(line)
    return plan


def _hold(prom: PromClient, pool: str, label: str, plan: HoldPlan, settings: RolloutSettings,
          say: Say) -> tuple[float, str | None]:
    """Hold for `plan.hold_s`, printing progress; stop early on a recorded p95 past its SLO.
    Returns (seconds held, early-burn reason or None)."""
    start = time.monotonic()
    while True:
        held_s = time.monotonic() - start
        if held_s >= plan.hold_s:
            return held_s, None
        time.sleep(min(settings.poll_s, plan.hold_s - held_s))
        held_s = time.monotonic() - start
        now = recorded_p95s(prom, pool, settings.window)
        kv = instant(prom, f'pool:vllm_kv_cache_usage_perc:max{{pool="{pool}"}}')
        wait = instant(prom, "pool_class:borrowd_proxy_oldest_wait_seconds:max"
                             f'{{pool="{pool}",class="interactive"}}')
        preempt = instant(prom, f'pool:vllm_num_preemptions:rate{settings.window}'
                                f'{{pool="{pool}"}}')
        batch = instant(prom, f"pool_class:borrowd_proxy_tokens:rate{settings.window}"
                              f'{{pool="{pool}",class="batch"}}')
        say(f"{label}: {held_s:5.1f}/{plan.hold_s:.0f} s  p95 TTFT {now.ttft_p95_s:.3g} s  "
            f"ITL {now.itl_p95_s:.3g} s ({settings.window})  KV {kv:.2f}  oldest wait "
            f"{wait:.2f} s  preemptions {preempt:.2f}/s  batch {batch:.0f} tokens/s")
        if now.ttft_p95_s > settings.slo.ttft_p95_s:
            return held_s, f"recorded p95 TTFT {now.ttft_p95_s:.3g} s > SLO during the hold"
        if now.itl_p95_s > settings.slo.itl_p95_s:
            return held_s, f"recorded p95 ITL {now.itl_p95_s:.3g} s > SLO during the hold"


def _measure(client: redis.Redis, prom: PromClient, pool: str, ceiling: float, label: str,
             settings: RolloutSettings, say: Say) -> tuple[HoldPlan, float, StepFigures,
                                                           str | None]:
    write_ceiling(client, pool, ceiling)
    say(f"{label}: ceiling {ceiling:g} tokens/s written; settling {settings.settle_s:g} s")
    time.sleep(settings.settle_s)
    plan = _plan(prom, pool, settings, say)
    held_s, early = _hold(prom, pool, label, plan, settings, say)
    return plan, held_s, figures_over(prom, pool, held_s), early


def _figures_line(figures: StepFigures) -> str:
    return (f"p95/p99 TTFT {figures.ttft_p95_s:.3g}/{figures.ttft_p99_s:.3g} s, "
            f"p95/p99 ITL {figures.itl_p95_s:.3g}/{figures.itl_p99_s:.3g} s, success "
            f"{figures.success_frac:.4f}, {figures.ttft_samples:.0f} first tokens, "
            f"{figures.itl_samples:.0f} gaps, KV max {figures.kv_usage_max_frac:.2f}, "
            f"preemptions {figures.preemptions:.0f}, batch {figures.batch_tokens_per_s:.0f} "
            "tokens/s")


def run_rollout(client: redis.Redis, prom: PromClient, pool: str, settings: RolloutSettings,
                say: Say) -> dict:
    """Baseline, steps, verdicts; leaves the accepted ceiling in Redis and returns the run."""
    previous = read_ceiling(client, pool)
    started_at_s = time.time()
    last_good = 0.0
    results: list[StepResult] = []
    stopped_by: str | None = None
    baseline: StepResult | None = None
    finished = False
    try:
        plan, held_s, base, early = _measure(client, prom, pool, 0.0, "baseline", settings, say)
        baseline = StepResult(0.0, plan, held_s, base, ())
        say(f"baseline (no batch): {_figures_line(base)}")
        if early is not None or burns(base, base, settings.slo, settings.tolerance):
            stopped_by = "the interactive class burns without any batch: no step is safe"
            say(stopped_by)
        for index, ceiling in enumerate(settings.steps if stopped_by is None else ()):
            label = f"step {index + 1}/{len(settings.steps)} ({ceiling:g} tokens/s)"
            plan, held_s, figures, early = _measure(client, prom, pool, ceiling, label,
                                                    settings, say)
            burning = burns(figures, base, settings.slo, settings.tolerance)
            if early is not None:
                burning = (early, *burning)
            results.append(StepResult(ceiling, plan, held_s, figures, burning))
            say(f"{label}: {_figures_line(figures)}")
            if burning:
                stopped_by = f"{label} burns: {'; '.join(burning)}"
                say(f"{stopped_by}; reverting to {last_good:g} tokens/s")
                break
            last_good = ceiling
            say(f"{label}: good")
        finished = True
    finally:
        # A burn or the last step leaves the last step that held without burning (0: none
        # did); an error or Ctrl-C before any step held restores the ceiling found.
        keep = last_good if finished or last_good > 0 else previous
        write_ceiling(client, pool, keep)
        if not finished:
            say(f"interrupted: ceiling back to {'none' if keep is None else f'{keep:g}'}")
    say(f"accepted ceiling {last_good:g} tokens/s (was "
        f"{'none' if previous is None else f'{previous:g}'})")
    record = {
        "pool": pool,
        "started_at_s": started_at_s,
        "ended_at_s": time.time(),
        "previous_ceiling_tokens_per_s": previous,
        "accepted_ceiling_tokens_per_s": last_good,
        "stopped_by": stopped_by,
        "settings": asdict(settings),
        "baseline": None if baseline is None else asdict(baseline),
        "steps": [asdict(result) for result in results],
    }
    safe = json_safe(record)
    assert isinstance(safe, dict)
    write_record(client, rollout_key(pool), safe)
    return safe


def cmd_rollout(args: argparse.Namespace) -> int:
    """Run the rollout; exit 0 with the accepted ceiling written."""
    settings = settings_from(args)
    url = resolve_redis_url(args.redis)
    prom = connect_prometheus(args.prometheus or os.environ.get(PROMETHEUS_ENV)
                              or DEFAULT_PROMETHEUS, 10.0)
    try:
        client = connect(url)
        require_known_pool(client, args.pool, args.force)
        record = run_rollout(client, prom, args.pool, settings,
                             lambda line: print(f"rollout: {line}", flush=True))
    except redis.RedisError as exc:
        raise BorrowdError(f"Redis at {redact_url(url)}: {exc}") from None
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=1, sort_keys=True))
    return 0
