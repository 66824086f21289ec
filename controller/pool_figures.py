"""Interactive figures of a pool asked of Prometheus now, for drills and rollouts.

Over a trailing range: p95 and p99 TTFT and ITL from the proxy's histograms (of the
replicas that may take batch, as the recording rules read them), success share,
sample counts, highest KV usage, preemptions, oldest interactive wait, batch token rate
(`figures_over`); the recorded short-window p95s with their evaluation time (`recorded_p95s`);
and how many first tokens and token gaps arrive per second (`sample_rates`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import requests
from borrowd.controller.prom_source import PromClient, check_pool_name, check_window
from borrowd.models.errors import InputError
from borrowd.models.rollout import StepFigures
from prometheus_api_client import PrometheusApiClientException


def instant(client: PromClient, expr: str) -> float:
    """The largest value of an instant query at Prometheus's now; NaN with no series.

    InputError naming the expression when Prometheus fails.
    """
    try:
        result = client.custom_query(expr, timeout=10.0)
    except (requests.RequestException, OSError, PrometheusApiClientException,
            ValueError) as exc:
        raise InputError(f"Prometheus query {expr!r} failed: {exc}") from None
    values = [float(series["value"][1]) for series in result]
    finite = [v for v in values if not math.isnan(v)]
    return max(finite) if finite else math.nan


def _range(range_s: float) -> str:
    return f"{max(1, round(range_s))}s"


def figures_over(client: PromClient, pool: str, range_s: float) -> StepFigures:
    """The pool's interactive figures over the last `range_s` seconds."""
    check_pool_name(pool)
    window = _range(range_s)
    inter = f'pool="{pool}",class="interactive"'
    # Latency of the replicas batch may use (all unless the proxy restricts it), as the rules.
    latency = f'{inter},batch_eligible!="false"'

    def quantile(q: float, metric: str) -> float:
        return instant(client, f"histogram_quantile({q}, sum by (le) "
                               f"(increase({metric}_bucket{{{latency}}}[{window}])))")

    def total(expr: str) -> float:
        value = instant(client, expr)
        return 0.0 if math.isnan(value) else value

    succeeded = total(f'sum(increase(borrowd_proxy_requests_total{{{inter},outcome="success"}}'
                      f"[{window}]))")
    failed = total(f"sum(increase(borrowd_proxy_requests_total{{{inter},"
                   f'outcome=~"error|truncated|timeout"}}[{window}]))')
    return StepFigures(
        ttft_p95_s=quantile(0.95, "borrowd_proxy_ttft_seconds"),
        ttft_p99_s=quantile(0.99, "borrowd_proxy_ttft_seconds"),
        itl_p95_s=quantile(0.95, "borrowd_proxy_itl_seconds"),
        itl_p99_s=quantile(0.99, "borrowd_proxy_itl_seconds"),
        success_frac=succeeded / (succeeded + failed) if succeeded + failed > 0 else 1.0,
        ttft_samples=total(f"sum(increase(borrowd_proxy_ttft_seconds_count{{{latency}}}"
                           f"[{window}]))"),
        itl_samples=total(f"sum(increase(borrowd_proxy_itl_seconds_count{{{latency}}}"
                          f"[{window}]))"),
        kv_usage_max_frac=instant(client, 'max(max_over_time({__name__=~"vllm[:_]'
                                          f'kv_cache_usage_perc",pool="{pool}"}}[{window}]))'),
        preemptions=total('sum(increase({__name__=~"vllm[:_]num_preemptions_total",'
                          f'pool="{pool}"}}[{window}]))'),
        oldest_wait_max_s=instant(client, "max(max_over_time(borrowd_proxy_oldest_wait_seconds"
                                          f"{{{inter}}}[{window}]))"),
        batch_tokens_per_s=total(f'sum(rate(borrowd_proxy_tokens_total{{pool="{pool}",'
                                 f'class="batch"}}[{window}]))'),
    )


@dataclass(frozen=True)
class RecordedP95s:
    """The recorded short-window interactive p95s and when Prometheus evaluated them."""

    ttft_p95_s: float
    itl_p95_s: float
    evaluated_at_s: float


def recorded_p95s(client: PromClient, pool: str, window: str) -> RecordedP95s:
    """The `window` recording rules' interactive p95s (deploy/prometheus/borrowd.rules.yml)."""
    check_pool_name(pool)
    check_window(window)
    inter = f'{{pool="{pool}",class="interactive"}}'
    ttft = f"pool_class:borrowd_proxy_ttft_seconds:p95_rate{window}{inter}"
    itl = f"pool_class:borrowd_proxy_itl_seconds:p95_rate{window}{inter}"
    return RecordedP95s(
        ttft_p95_s=instant(client, ttft),
        itl_p95_s=instant(client, itl),
        evaluated_at_s=min(instant(client, f"timestamp({ttft})"),
                           instant(client, f"timestamp({itl})")),
    )


def sample_rates(client: PromClient, pool: str, range_s: float) -> tuple[float, float]:
    """Interactive first tokens and token gaps per second over the last `range_s`, on the
    replicas that may take batch (the samples a step's p95 and p99 rest on)."""
    check_pool_name(pool)
    inter = f'pool="{pool}",class="interactive",batch_eligible!="false"'
    window = _range(range_s)
    rates = []
    for metric in ("borrowd_proxy_ttft_seconds_count", "borrowd_proxy_itl_seconds_count"):
        value = instant(client, f"sum(rate({metric}{{{inter}}}[{window}]))")
        rates.append(0.0 if math.isnan(value) else value)
    return rates[0], rates[1]
