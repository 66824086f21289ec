"""vLLM's histogram bucket boundaries, so borrowd's histograms line up with vLLM's own.

Copied from vLLM's V1 Prometheus logger (`vllm/v1/metrics/loggers.py`,
`PrometheusStatLogger.__init__`): the same boundaries let one PromQL query or recording rule
compare the proxy's per-class view with the engine's view. `with_slo_bounds` adds a bound at
each SLO of the pool, so the share of samples above the SLO is counted exactly, whatever it is.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

TTFT_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
"""`vllm:time_to_first_token_seconds`."""

ITL_BUCKETS_S: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)
"""`vllm:inter_token_latency_seconds` (and the deprecated `time_per_output_token`)."""

REQUEST_LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)
"""`vllm:e2e_request_latency_seconds`, `..._queue_time_...`, `..._prefill_...`, `..._decode_...`."""


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count histogram buckets)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


def with_slo_bounds(buckets_s: Iterable[float], slos_s: Iterable[float]) -> tuple[float, ...]:
    """`buckets_s` with a bound at each of `slos_s` (seconds), sorted, each bound once.

    Raises ValueError for an SLO that is not a finite number above 0 (callers name the key)."""
    slos = tuple(slos_s)
    for slo_s in slos:
        if not (math.isfinite(slo_s) and slo_s > 0):
            raise ValueError(f"an SLO bound must be a finite number of seconds above 0, "
                             f"got {slo_s!r}")
    return tuple(sorted({*buckets_s, *slos}))
