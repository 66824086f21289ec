"""vLLM's histogram bucket boundaries, so borrowd's histograms line up with vLLM's own.

Copied from vLLM's V1 Prometheus logger (`vllm/v1/metrics/loggers.py`,
`PrometheusStatLogger.__init__`): the same boundaries let one PromQL query or recording rule
compare the proxy's per-class view with the engine's view.
"""

from __future__ import annotations

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
