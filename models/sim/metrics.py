"""Run metrics: what a simulation records on its hot path, and the figures made from it.

Inter-token latency is aggregated per step: every interactive sequence that decodes in
back-to-back steps has that step's duration as its gap, so a step adds one (time, duration,
count) sample; other gaps (after a stall or preemption) are single samples. Quantiles are
weighted quantiles over those samples. Figures per 60 s window use the time a sample was
produced (first token, step end, outcome).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass

import numpy as np
from borrowd.models.signals import Slo

NAN = float("nan")


def weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """Smallest value whose cumulative weight reaches `q` of the total; NaN when empty."""
    if len(values) == 0:
        return NAN
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order])
    total = cum[-1]
    if total <= 0:
        return NAN
    idx = int(np.searchsorted(cum, q * total, side="left"))
    return float(values[order[min(idx, len(order) - 1)]])


def weighted_share_above(values: np.ndarray, weights: np.ndarray, threshold: float) -> float:
    """Share of the total weight on values above `threshold`; NaN when there is no weight."""
    total = float(np.sum(weights))
    if len(values) == 0 or total <= 0:
        return NAN
    return float(np.sum(weights[values > threshold])) / total


def quantile(values: np.ndarray, q: float) -> float:
    """Unweighted quantile (same rule as `weighted_quantile`); NaN when empty."""
    if len(values) == 0:
        return NAN
    s = np.sort(values)
    idx = max(0, math.ceil(q * len(s)) - 1)
    return float(s[min(idx, len(s) - 1)])


class Recorder:
    """Append-only samples of one run, in nondecreasing time order per series."""

    def __init__(self, duration_s: float) -> None:
        n = int(duration_s) + 2
        self.ttft_t: list[float] = []
        self.ttft_s: list[float] = []
        self.itl_t: list[float] = []
        self.itl_s: list[float] = []
        self.itl_w: list[int] = []
        self.itl_batch: list[bool] = []
        self.outcome_t: list[float] = []
        self.outcome_ok: list[bool] = []
        self.busy_s_per_s = [0.0] * n
        self.batch_tokens_per_s = [0] * n
        self.interactive_offered_per_s = [0] * n
        self.preemptions_per_s = [0] * n
        self.batch_done_tokens_per_s = [0] * n
        self.interactive_wait_s_per_s = [0.0] * n
        self.interactive_wait_batch_s_per_s = [0.0] * n

    def window_slice(self, t: list[float], t0: float, t1: float) -> tuple[int, int]:
        """Index range of samples with t0 < time <= t1."""
        return bisect_right(t, t0), bisect_right(t, t1)

    def interactive_figures(self, t0: float, t1: float) -> dict[str, float]:
        """Interactive TTFT/ITL quantiles, success rate and count over (t0, t1]."""
        a, b = self.window_slice(self.ttft_t, t0, t1)
        ttft = np.asarray(self.ttft_s[a:b])
        c, d = self.window_slice(self.itl_t, t0, t1)
        itl = np.asarray(self.itl_s[c:d])
        w = np.asarray(self.itl_w[c:d], dtype=float)
        e, f = self.window_slice(self.outcome_t, t0, t1)
        ok = self.outcome_ok[e:f]
        return {
            "requests": len(ok),
            "ttft_p50_s": quantile(ttft, 0.50),
            "ttft_p95_s": quantile(ttft, 0.95),
            "ttft_p99_s": quantile(ttft, 0.99),
            "itl_p50_s": weighted_quantile(itl, w, 0.50),
            "itl_p95_s": weighted_quantile(itl, w, 0.95),
            "itl_p99_s": weighted_quantile(itl, w, 0.99),
            "success_rate": (sum(ok) / len(ok)) if ok else NAN,
        }


    def slo_burn(self, t0: float, t1: float, slo: Slo) -> tuple[float, float]:
        """Shares (ITL gaps weighted per step, first tokens) above their SLO over (t0, t1]."""
        a, b = self.window_slice(self.ttft_t, t0, t1)
        ttft = np.asarray(self.ttft_s[a:b])
        c, d = self.window_slice(self.itl_t, t0, t1)
        itl = np.asarray(self.itl_s[c:d])
        w = np.asarray(self.itl_w[c:d], dtype=float)
        return (
            weighted_share_above(itl, w, slo.itl_p95_s),
            weighted_share_above(ttft, np.ones(len(ttft)), slo.ttft_p95_s),
        )


    def slo_samples(self, t0: float, t1: float, slo: Slo) -> tuple[float, float, float]:
        """(ITL gaps, first tokens, share of the gaps above the ITL SLO that fell in steps
        carrying batch tokens; NaN when none is above) over (t0, t1]."""
        a, b = self.window_slice(self.ttft_t, t0, t1)
        c, d = self.window_slice(self.itl_t, t0, t1)
        itl = np.asarray(self.itl_s[c:d])
        w = np.asarray(self.itl_w[c:d], dtype=float)
        over = itl > slo.itl_p95_s
        over_w = float(np.sum(w[over]))
        caused = float(np.sum(w[over & np.asarray(self.itl_batch[c:d], dtype=bool)]))
        return float(np.sum(w)), float(b - a), caused / over_w if over_w > 0 else NAN


def slo_met(fig: dict[str, float], slo: Slo) -> bool:
    """True when a window meets all three SLOs (a signal with no samples does not fail)."""
    ttft, itl, ok = fig["ttft_p95_s"], fig["itl_p95_s"], fig["success_rate"]
    return (
        (math.isnan(ttft) or ttft <= slo.ttft_p95_s)
        and (math.isnan(itl) or itl <= slo.itl_p95_s)
        and (math.isnan(ok) or ok >= slo.success_rate)
    )


@dataclass(frozen=True)
class WindowFigures:
    """Figures of one window: interactive SLO figures, busy fraction, batch tokens computed
    (`batch_tokens_per_s`) and batch tokens of jobs completed in it."""

    start_s: float
    interactive: dict[str, float]
    slo_met: bool
    gpu_busy_frac: float
    batch_tokens_per_s: float
    batch_completed_tokens_per_s: float

    def to_json(self) -> dict[str, object]:
        """The window as a JSON-ready dict."""
        out: dict[str, object] = {"start_s": self.start_s}
        out.update({k: json_number(v) for k, v in self.interactive.items()})
        out["slo_met"] = self.slo_met
        out["gpu_busy_frac"] = round(self.gpu_busy_frac, 4)
        out["batch_tokens_per_s"] = round(self.batch_tokens_per_s, 1)
        out["batch_completed_tokens_per_s"] = round(self.batch_completed_tokens_per_s, 1)
        return out


def windows(rec: Recorder, duration_s: float, window_s: float, replicas: int,
            slo: Slo) -> list[WindowFigures]:
    """Per-window figures of a run (the last, partial window is dropped unless it is alone)."""
    count = max(1, int(duration_s // window_s))
    out = []
    for i in range(count):
        t0, t1 = i * window_s, min(duration_s, (i + 1) * window_s)
        fig = rec.interactive_figures(t0, t1)
        busy = sum(rec.busy_s_per_s[int(t0):int(t1)]) / (replicas * (t1 - t0))
        batch = sum(rec.batch_tokens_per_s[int(t0):int(t1)]) / (t1 - t0)
        done = sum(rec.batch_done_tokens_per_s[int(t0):int(t1)]) / (t1 - t0)
        out.append(WindowFigures(t0, fig, slo_met(fig, slo), busy, batch, done))
    return out


def json_number(value: float | int) -> float | int | None:
    """A figure for JSON: NaN becomes null, floats are rounded to 6 decimals."""
    if isinstance(value, float):
        return None if math.isnan(value) else round(value, 6)
    return value
