"""`borrowd report`: a pool's rollout report from Prometheus, as one self-contained HTML file
and JSON.

Each figure is one PromQL expression over a window, evaluated by one range query whose step
is the window, so the report's per-window numbers are exactly what the same instant query at
a window's end returns. The figures and comparisons are `models.report`; the page is
`controller.report_render`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import requests
from borrowd.controller.cli.control import parse_time_s
from borrowd.controller.prom_source import PromClient, check_pool_name, connect_prometheus
from borrowd.models.batch.figures import CostModel
from borrowd.models.errors import InputError
from borrowd.models.report import ClassWindow, WindowSample, build_report, report_json
from borrowd.models.signals import Slo
from prometheus_api_client import PrometheusApiClientException

DEFAULT_PROMETHEUS = "http://127.0.0.1:9090"
PROMETHEUS_ENV = "BORROWD_PROMETHEUS_URL"
CLASS_FIELDS = ("prompt_tokens", "output_tokens", "succeeded", "failed", "revoked",
                "ttft_p95_s", "ttft_p99_s", "itl_p95_s", "itl_p99_s")


def add_prometheus_argument(parser: argparse.ArgumentParser) -> None:
    """`--prometheus URL`, defaulting to $BORROWD_PROMETHEUS_URL, then the local one."""
    parser.add_argument("--prometheus", metavar="URL", default=None,
                        help=f"Prometheus base URL (default ${PROMETHEUS_ENV}, then "
                             f"{DEFAULT_PROMETHEUS})")


def add_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    """`--pool`, `--redis` and `--prometheus`: what the rollout tools read and write."""
    parser.add_argument("--pool", required=True, help="pool name")
    parser.add_argument("--redis", default=None, metavar="URL",
                        help="Redis URL (default: $BORROWD_REDIS_URL, then "
                             "redis://127.0.0.1:6379/0)")
    add_prometheus_argument(parser)


@dataclass(frozen=True)
class Figure:
    """One per-window figure: its PromQL and the value of a window with no series."""

    expr: str
    missing: float


def class_figures(pool: str, klass: str, window: str) -> dict[str, Figure]:
    """The expressions behind one class's `ClassWindow` fields."""
    sel = f'pool="{pool}",class="{klass}"'

    def count(metric: str, extra: str) -> Figure:
        return Figure(f"sum(increase({metric}{{{sel}{extra}}}[{window}]))", 0.0)

    def quantile(q: float, metric: str) -> Figure:
        return Figure(f"histogram_quantile({q}, sum by (le) "
                      f"(increase({metric}_bucket{{{sel}}}[{window}])))", math.nan)

    return {
        "prompt_tokens": count("borrowd_proxy_tokens_total", ',kind="prompt"'),
        "output_tokens": count("borrowd_proxy_tokens_total", ',kind="output"'),
        "succeeded": count("borrowd_proxy_requests_total", ',outcome="success"'),
        "failed": count("borrowd_proxy_requests_total", ',outcome=~"error|truncated|timeout"'),
        "revoked": count("borrowd_proxy_requests_total", ',outcome="revoked"'),
        "ttft_p95_s": quantile(0.95, "borrowd_proxy_ttft_seconds"),
        "ttft_p99_s": quantile(0.99, "borrowd_proxy_ttft_seconds"),
        "itl_p95_s": quantile(0.95, "borrowd_proxy_itl_seconds"),
        "itl_p99_s": quantile(0.99, "borrowd_proxy_itl_seconds"),
    }


def fleet_figures(pool: str, window: str) -> dict[str, Figure]:
    """The expressions behind `WindowSample`'s pool-wide fields."""
    engine = f'pool="{pool}"'

    def vllm(name: str) -> str:
        return f'{{__name__=~"vllm[:_]{name}",{engine}}}'

    return {
        "revocations": Figure(
            f"sum(increase(borrowd_proxy_revocations_total{{{engine}}}[{window}]))", 0.0),
        "preemptions": Figure(
            f"sum(increase({vllm('num_preemptions_total')}[{window}]))", 0.0),
        "kv_usage_mean_frac": Figure(
            f"avg(avg_over_time({vllm('kv_cache_usage_perc')}[{window}]))", math.nan),
        "kv_usage_max_frac": Figure(
            f"max(max_over_time({vllm('kv_cache_usage_perc')}[{window}]))", math.nan),
        # vLLM exports no step time: busy is the share of evaluations at which an engine had
        # a running request, averaged over the pool's engines.
        "gpu_busy_frac": Figure(
            f"avg(avg_over_time(clamp_max({vllm('num_requests_running')}, 1)[{window}:]))",
            math.nan),
        # From `borrowd batch serve` when scraped (gauges of running totals), else NaN.
        "redone_tokens": Figure(
            f"sum(delta(borrowd_batch_tenant_redone_tokens[{window}]))", math.nan),
        "reprefill_tokens": Figure(
            f"sum(delta(borrowd_batch_job_reprefill_tokens[{window}]))", math.nan),
    }


def range_values(client: PromClient, expr: str, *, start_s: float, end_s: float,
                 step_s: float) -> dict[float, float]:
    """`expr` at start_s, start_s + step_s, ... <= end_s, keyed by evaluation time; several
    series combined by max. InputError naming the expression when Prometheus fails."""
    try:
        result = client.custom_query_range(
            expr, start_time=datetime.fromtimestamp(start_s, tz=UTC),
            end_time=datetime.fromtimestamp(end_s, tz=UTC), step=f"{step_s:g}s", timeout=30.0)
    except (requests.RequestException, OSError, PrometheusApiClientException,
            ValueError) as exc:
        raise InputError(f"Prometheus query {expr!r} failed: {exc}") from None
    values: dict[float, float] = {}
    for series in result:
        for stamp, text in series.get("values", []):
            value = float(text)
            key = round(float(stamp), 3)
            if key not in values or value > values[key] or math.isnan(values[key]):
                values[key] = value
    return values


def window_ends(start_s: float, end_s: float, window_s: float) -> list[float]:
    """Ends of the complete windows of [start_s, end_s]: start_s + k * window_s."""
    count = math.floor((end_s - start_s) / window_s + 1e-9)
    if count < 1:
        raise InputError(f"the period {start_s:.0f}..{end_s:.0f} is shorter than one window "
                         f"({window_s:g} s)")
    return [round(start_s + k * window_s, 3) for k in range(1, count + 1)]


def fetch_windows(client: PromClient, pool: str, *, start_s: float, end_s: float,
                  window_s: float) -> list[WindowSample]:
    """One `WindowSample` per complete window of [start_s, end_s], read from Prometheus."""
    check_pool_name(pool)
    ends = window_ends(start_s, end_s, window_s)
    window = f"{window_s:g}s"

    def fetch(figures: dict[str, Figure]) -> dict[str, dict[float, float]]:
        return {name: range_values(client, fig.expr, start_s=ends[0], end_s=ends[-1],
                                   step_s=window_s) for name, fig in figures.items()}

    specs = {klass: class_figures(pool, klass, window) for klass in ("interactive", "batch")}
    per_class = {klass: fetch(figures) for klass, figures in specs.items()}
    if not any(per_class["interactive"]["succeeded"].values()) and not any(
            per_class["interactive"]["prompt_tokens"].values()):
        raise InputError(f"pool {pool!r}: Prometheus holds no interactive borrowd_proxy series "
                         "in that period (is the proxy scraped, and is the pool right?)")
    fleet_specs = fleet_figures(pool, window)
    fleet = fetch(fleet_specs)

    def value(series: dict[str, dict[float, float]], spec: dict[str, Figure], name: str,
              at: float) -> float:
        return series[name].get(at, spec[name].missing)

    out = []
    for at in ends:
        classes = {
            klass: ClassWindow(**{name: value(per_class[klass], specs[klass], name, at)
                                  for name in CLASS_FIELDS})
            for klass in specs
        }
        out.append(WindowSample(
            end_s=at, window_s=window_s, interactive=classes["interactive"],
            batch=classes["batch"],
            **{name: value(fleet, fleet_specs, name, at) for name in fleet_specs},
        ))
    return out


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `report`."""
    report = subparsers.add_parser(
        "report", help="a pool's borrowing report from Prometheus (self-contained HTML + JSON)",
        description="Per window: interactive SLO compliance and goodput, batch items and tokens, "
        "waste, revocations, KV occupancy, GPU busy, cost per batch item; windows with "
        "borrowing against windows without at matched interactive load.")
    report.add_argument("--pool", required=True, help="pool name")
    report.add_argument("--from", dest="start", required=True,
                        help="period start: unix seconds or ISO 8601")
    report.add_argument("--to", dest="end", required=True,
                        help="period end: unix seconds or ISO 8601")
    add_prometheus_argument(report)
    report.add_argument("--out", type=Path, required=True, help="HTML file to write")
    report.add_argument("--json", dest="json_out", type=Path, help="JSON file to write")
    report.add_argument("--window-s", type=float, default=60.0,
                        help="SLO window, s (default 60; at least 4 scrape intervals)")
    report.add_argument("--bins", type=int, default=5,
                        help="interactive-load bins for the matched comparison (default 5)")
    report.add_argument("--slo-ttft-s", type=float, default=1.0, help="p95 TTFT SLO, s")
    report.add_argument("--slo-itl-s", type=float, default=0.05, help="p95 ITL SLO, s")
    report.add_argument("--slo-success", type=float, default=0.99, help="success-rate SLO")
    report.add_argument("--price-per-gpu-hour", type=float, default=2.0,
                        help="price of one GPU-hour (any currency; default 2.0)")
    report.add_argument("--prefill-tokens-per-gpu-s", type=float, default=20_000.0,
                        help="prompt tokens one GPU prefills per second (cost model)")
    report.add_argument("--decode-tokens-per-gpu-s", type=float, default=2_500.0,
                        help="output tokens one GPU generates per second, batched (cost model)")
    report.set_defaults(func=cmd_report)


def _check_args(args: argparse.Namespace) -> tuple[float, float]:
    start_s, end_s = parse_time_s(args.start, "from"), parse_time_s(args.end, "to")
    if end_s <= start_s:
        raise InputError(f"--to must be after --from, got {args.start} .. {args.end}")
    positive = ("window_s", "slo_ttft_s", "slo_itl_s", "price_per_gpu_hour",
                "prefill_tokens_per_gpu_s", "decode_tokens_per_gpu_s")
    for name in positive:
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise InputError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if not 0 < args.slo_success <= 1:
        raise InputError(f"--slo-success must be in (0, 1], got {args.slo_success}")
    if args.bins < 1:
        raise InputError(f"--bins must be >= 1, got {args.bins}")
    return start_s, end_s


def cmd_report(args: argparse.Namespace) -> int:
    """Query Prometheus, compute the report, write the HTML (and JSON), print a summary."""
    from borrowd.controller.report_render import render_html

    start_s, end_s = _check_args(args)
    url = args.prometheus or os.environ.get(PROMETHEUS_ENV) or DEFAULT_PROMETHEUS
    client = connect_prometheus(url, 30.0)
    windows = fetch_windows(client, args.pool, start_s=start_s, end_s=end_s,
                            window_s=args.window_s)
    slo = Slo(ttft_p95_s=args.slo_ttft_s, itl_p95_s=args.slo_itl_s,
              success_rate=args.slo_success)
    cost = CostModel(args.price_per_gpu_hour, args.prefill_tokens_per_gpu_s,
                     args.decode_tokens_per_gpu_s)
    report = build_report(args.pool, windows, slo, cost, bins=args.bins)
    args.out.write_text(render_html(report))
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(report_json(report), indent=1, sort_keys=True))
    c, b = report.compliance, report.batch_figures
    print(f"pool {report.pool}: {len(report.windows)} windows of {report.window_s:g} s; "
          f"interactive SLO met in {c.compliant} of {c.compliant + c.burning} "
          f"(goodput {c.goodput_tokens_per_s:.1f} tokens/s); batch {b.items_completed:g} items, "
          f"{b.tokens_completed:g} tokens, cost per item {b.cost_per_item:.4g}; "
          f"wrote {args.out}" + (f" and {args.json_out}" if args.json_out else ""))
    return 0
