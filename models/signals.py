"""What the controller observes about one pool at one tick.

Produced by a `MetricsSource` (Prometheus in production, the simulator in tests and
benchmarks). A value of NaN means "not measured"; the supervisor treats it as not safe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

NAN = float("nan")
SLO_QUANTILE = 0.95  # the SLOs are on p95s


@dataclass(frozen=True)
class Slo:
    """Interactive service-level objectives of a pool."""

    ttft_p95_s: float = 1.0
    itl_p95_s: float = 0.050
    success_rate: float = 0.99


SPARSE_SAMPLES = 5.0  # fewer samples than this in a window that yields no p95: sparse traffic


def sparse(samples: float, interactive_requests: float) -> bool:
    """True when a p95 read as missing comes from too few samples rather than a broken
    signal: fewer than `SPARSE_SAMPLES` counted (the count is read over the burn window,
    which ends at the last scrape, later than the p95's rules window: a first token or two
    there while the p95's window held none is sparse traffic), or, with no count read, no
    interactive request in the window. A NaN count with traffic is missing."""
    if math.isfinite(samples):
        return samples < SPARSE_SAMPLES
    return interactive_requests == 0


@dataclass(frozen=True)
class Observation:
    """Signals of one pool over the controller's sliding window, ending at `now_s`.

    Latencies are interactive-class quantiles in seconds; `*_norm` helpers divide by the SLO
    so that 1.0 is the SLO line. `age_s` is how old the freshest sample behind these numbers
    is (staleness); a source that could not answer returns NaN fields. `*_over_slo_frac` is
    the share of interactive inter-token gaps (first tokens) in the window above the SLO: p95
    <= SLO exactly when that share is <= 5%, and unlike the p95 it moves smoothly with load.

    Windowed estimates know how much they know: `window_s` is the window behind them and
    `itl_samples` / `ttft_samples` how many gaps / first tokens it held (0: no interactive
    traffic, a safe reading; NaN: not counted). Attribution to batch: `itl_over_slo_batch_frac`
    is the share of the gaps above the SLO that fell in steps carrying batch tokens, and
    `interactive_wait_batch_frac` the share of interactive queue wait spent in steps carrying
    batch tokens (NaN: nothing to attribute, or not measured). `kv_capacity_tokens` is the KV
    cache of the pool's engines that are up, in tokens (batch KV caps are fractions of it).
    `interactive_late_waiters` counts the interactive requests that have waited longer than
    the TTFT SLO and still have no first token: first tokens certain to be late, which no
    TTFT sample counts yet (NaN: not exported).
    """

    now_s: float
    age_s: float
    ttft_p95_s: float = NAN
    itl_p95_s: float = NAN
    success_rate: float = NAN
    kv_usage_frac: float = NAN
    interactive_queue_depth: float = NAN
    interactive_oldest_wait_s: float = NAN
    preemptions_per_s: float = NAN
    interactive_tokens_per_s: float = NAN
    batch_tokens_per_s: float = NAN
    batch_running_seqs: float = NAN
    interactive_requests: float = NAN
    itl_over_slo_frac: float = NAN
    ttft_over_slo_frac: float = NAN
    window_s: float = NAN
    itl_samples: float = NAN
    ttft_samples: float = NAN
    itl_over_slo_batch_frac: float = NAN
    interactive_wait_batch_frac: float = NAN
    kv_capacity_tokens: float = NAN
    interactive_late_waiters: float = NAN

    def missing(self) -> list[str]:
        """Names of the fields that are NaN (not measured)."""
        return [
            f.name
            for f in fields(self)
            if isinstance(getattr(self, f.name), float) and math.isnan(getattr(self, f.name))
        ]

    def ttft_norm(self, slo: Slo) -> float:
        """p95 TTFT divided by its SLO."""
        return self.ttft_p95_s / slo.ttft_p95_s

    def itl_norm(self, slo: Slo) -> float:
        """p95 ITL divided by its SLO."""
        return self.itl_p95_s / slo.itl_p95_s

    def itl_idle(self) -> bool:
        """True when a missing p95 ITL means sparse traffic, not a broken signal: the
        gaps counted are fewer than `SPARSE_SAMPLES` (see `sparse`)."""
        return sparse(self.itl_samples, self.interactive_requests)

    def ttft_idle(self) -> bool:
        """True when a missing p95 TTFT means sparse traffic, not a broken signal: the
        first tokens counted are fewer than `SPARSE_SAMPLES` (see `sparse`)."""
        return sparse(self.ttft_samples, self.interactive_requests)

    def itl_burn(self) -> float:
        """Share of inter-token gaps above the ITL SLO over the share the p95 allows (1.0: edge)."""
        return self.itl_over_slo_frac / (1.0 - SLO_QUANTILE)

    def ttft_burn(self) -> float:
        """Share of first tokens above the TTFT SLO over the share the p95 allows (1.0: edge)."""
        return self.ttft_over_slo_frac / (1.0 - SLO_QUANTILE)
