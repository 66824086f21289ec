"""Figures of a rollout report: per-window SLO compliance, goodput and batch work of a pool,
and windows with borrowing compared with windows without it at matched interactive load.

Input is one `WindowSample` per window (read from Prometheus at the edge); all here is pure.
A window complies when the interactive p95 TTFT <= SLO, p95 ITL <= SLO and success >= SLO
(a p95 with no sample is not judged); a window with no interactive request is idle and counts
neither way. SLO-compliant goodput = interactive tokens of compliant windows / period seconds.
Matched load: non-idle windows are binned by interactive token rate (equal-width bins), and
within a bin windows that carried batch work are compared with windows that did not.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum

from borrowd.models.batch.figures import CostModel
from borrowd.models.errors import InputError
from borrowd.models.signals import Slo


@dataclass(frozen=True)
class ClassWindow:
    """One class's figures over one window (counts are increases; NaN: not measured)."""

    prompt_tokens: float
    output_tokens: float
    succeeded: float
    failed: float
    revoked: float
    ttft_p95_s: float
    ttft_p99_s: float
    itl_p95_s: float
    itl_p99_s: float

    @property
    def tokens(self) -> float:
        """Prompt + output tokens."""
        return self.prompt_tokens + self.output_tokens

    @property
    def finished(self) -> float:
        """Requests that succeeded or failed (rejections and revocations not counted)."""
        return self.succeeded + self.failed

    @property
    def success_frac(self) -> float:
        """succeeded / finished; 1 when nothing finished."""
        return self.succeeded / self.finished if self.finished > 0 else 1.0


@dataclass(frozen=True)
class WindowSample:
    """A pool over the window (end_s - window_s, end_s]: both classes and the fleet."""

    end_s: float
    window_s: float
    interactive: ClassWindow
    batch: ClassWindow
    revocations: float
    preemptions: float
    kv_usage_mean_frac: float
    kv_usage_max_frac: float
    gpu_busy_frac: float
    redone_tokens: float
    reprefill_tokens: float


class Verdict(StrEnum):
    """How a window fared against the interactive SLOs."""

    COMPLIANT = "compliant"
    BURNING = "burning"
    IDLE = "idle"


def window_verdict(window: WindowSample, slo: Slo) -> Verdict:
    """COMPLIANT, BURNING, or IDLE (no interactive request finished and no latency sample)."""
    inter = window.interactive
    if inter.finished <= 0 and math.isnan(inter.ttft_p95_s) and math.isnan(inter.itl_p95_s):
        return Verdict.IDLE
    burning = (
        inter.ttft_p95_s > slo.ttft_p95_s
        or inter.itl_p95_s > slo.itl_p95_s
        or inter.success_frac < slo.success_rate
    )
    return Verdict.BURNING if burning else Verdict.COMPLIANT


def borrowing(window: WindowSample) -> bool:
    """True when the window carried batch work (batch tokens or completions)."""
    return window.batch.tokens > 0 or window.batch.succeeded > 0


@dataclass(frozen=True)
class ClassSummary:
    """One class over the period."""

    succeeded: float
    failed: float
    revoked: float
    prompt_tokens: float
    output_tokens: float
    tokens_per_s: float
    ttft_p95_s_median: float
    ttft_p95_s_worst: float
    itl_p95_s_median: float
    itl_p95_s_worst: float


@dataclass(frozen=True)
class Compliance:
    """Interactive SLO compliance over the period's windows."""

    windows: int
    compliant: int
    burning: int
    idle: int
    compliant_frac: float
    goodput_tokens_per_s: float
    goodput_frac: float


@dataclass(frozen=True)
class BatchFigures:
    """Batch work done and wasted over the period, and its GPU cost."""

    items_completed: float
    tokens_completed: float
    revocations: float
    redone_tokens: float
    reprefill_tokens: float
    preemptions: float
    gpu_hours: float
    cost: float
    cost_per_item: float


@dataclass(frozen=True)
class FleetFigures:
    """The engines over the period."""

    kv_usage_mean_frac: float
    kv_usage_max_frac: float
    gpu_busy_frac: float


@dataclass(frozen=True)
class BinSide:
    """Windows of one load bin, with or without borrowing."""

    windows: int
    compliant_frac: float
    goodput_tokens_per_s: float
    interactive_tokens_per_s: float
    batch_tokens_per_s: float
    ttft_p95_s_median: float
    itl_p95_s_median: float


@dataclass(frozen=True)
class LoadBin:
    """Windows whose interactive token rate lies in [low, high)."""

    low_tokens_per_s: float
    high_tokens_per_s: float
    borrowing: BinSide
    without: BinSide


@dataclass(frozen=True)
class Matched:
    """Borrowing minus no borrowing over the bins holding both, weighted by min(n_b, n_w)."""

    bins_compared: int
    windows_weight: int
    compliant_frac_delta: float
    goodput_tokens_per_s_delta: float
    batch_tokens_per_s_gained: float


@dataclass(frozen=True)
class Report:
    """Everything `borrowd report` shows."""

    pool: str
    start_s: float
    end_s: float
    window_s: float
    slo: Slo
    windows: tuple[WindowSample, ...]
    verdicts: tuple[Verdict, ...]
    interactive: ClassSummary
    batch: ClassSummary
    compliance: Compliance
    batch_figures: BatchFigures
    fleet: FleetFigures
    bins: tuple[LoadBin, ...]
    matched: Matched


def _nan_sum(values: Sequence[float]) -> float:
    """Sum of the finite values; NaN when none is finite."""
    finite = [v for v in values if math.isfinite(v)]
    return math.fsum(finite) if finite else math.nan


def _median(values: Sequence[float]) -> float:
    finite = sorted(v for v in values if math.isfinite(v))
    if not finite:
        return math.nan
    mid = len(finite) // 2
    return finite[mid] if len(finite) % 2 else (finite[mid - 1] + finite[mid]) / 2


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return math.fsum(finite) / len(finite) if finite else math.nan


def _max(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return max(finite) if finite else math.nan


def summarise_class(windows: Sequence[ClassWindow], period_s: float) -> ClassSummary:
    """One class's totals and latency figures over `windows` spanning `period_s`."""
    prompt = _nan_sum([w.prompt_tokens for w in windows])
    output = _nan_sum([w.output_tokens for w in windows])
    return ClassSummary(
        succeeded=_nan_sum([w.succeeded for w in windows]),
        failed=_nan_sum([w.failed for w in windows]),
        revoked=_nan_sum([w.revoked for w in windows]),
        prompt_tokens=prompt,
        output_tokens=output,
        tokens_per_s=_nan_sum([prompt, output]) / period_s,
        ttft_p95_s_median=_median([w.ttft_p95_s for w in windows]),
        ttft_p95_s_worst=_max([w.ttft_p95_s for w in windows]),
        itl_p95_s_median=_median([w.itl_p95_s for w in windows]),
        itl_p95_s_worst=_max([w.itl_p95_s for w in windows]),
    )


def compliance(windows: Sequence[WindowSample], verdicts: Sequence[Verdict],
               period_s: float) -> Compliance:
    """Share of non-idle windows that comply, and SLO-compliant goodput."""
    judged = [(w, v) for w, v in zip(windows, verdicts, strict=True) if v is not Verdict.IDLE]
    good = [w for w, v in judged if v is Verdict.COMPLIANT]
    good_tokens = math.fsum(w.interactive.tokens for w in good)
    all_tokens = math.fsum(w.interactive.tokens for w, _ in judged)
    return Compliance(
        windows=len(windows),
        compliant=len(good),
        burning=len(judged) - len(good),
        idle=len(windows) - len(judged),
        compliant_frac=len(good) / len(judged) if judged else math.nan,
        goodput_tokens_per_s=good_tokens / period_s,
        goodput_frac=good_tokens / all_tokens if all_tokens > 0 else math.nan,
    )


def batch_figures(windows: Sequence[WindowSample], cost: CostModel) -> BatchFigures:
    """Batch items and tokens completed, revocations, waste, and GPU cost per item.

    GPU time follows `CostModel.gpu_s` over every batch token the engines processed: the
    proxy's prompt and output tokens plus redone output and re-prefilled partials when the
    batch service reports them (NaN there: not scraped, counted as 0 in the cost).
    """
    items = _nan_sum([w.batch.succeeded for w in windows])
    prompt = _nan_sum([w.batch.prompt_tokens for w in windows])
    output = _nan_sum([w.batch.output_tokens for w in windows])
    redone = _nan_sum([w.redone_tokens for w in windows])
    reprefill = _nan_sum([w.reprefill_tokens for w in windows])
    paid_prompt = _zero_nan(prompt) + _zero_nan(reprefill)
    paid_output = _zero_nan(output) + _zero_nan(redone)
    gpu_s = cost.gpu_s(round(paid_prompt), round(paid_output))
    money = cost.price_per_gpu_hour * gpu_s / 3600.0
    per_item = cost.cost_per_item(round(paid_prompt), round(paid_output), round(_zero_nan(items)))
    return BatchFigures(
        items_completed=items,
        tokens_completed=_nan_sum([prompt, output]),
        revocations=_nan_sum([w.revocations for w in windows]),
        redone_tokens=redone,
        reprefill_tokens=reprefill,
        preemptions=_nan_sum([w.preemptions for w in windows]),
        gpu_hours=gpu_s / 3600.0,
        cost=money,
        cost_per_item=math.nan if per_item is None else per_item,
    )


def _zero_nan(value: float) -> float:
    return value if math.isfinite(value) else 0.0


def fleet_figures(windows: Sequence[WindowSample]) -> FleetFigures:
    """KV occupancy (mean of window means, highest max) and GPU busy share."""
    return FleetFigures(
        kv_usage_mean_frac=_mean([w.kv_usage_mean_frac for w in windows]),
        kv_usage_max_frac=_max([w.kv_usage_max_frac for w in windows]),
        gpu_busy_frac=_mean([w.gpu_busy_frac for w in windows]),
    )


def interactive_rate_tokens_per_s(window: WindowSample) -> float:
    """Offered interactive load of a window: its interactive tokens per second."""
    return window.interactive.tokens / window.window_s


def bin_edges(rates: Sequence[float], bins: int) -> tuple[float, ...]:
    """`bins` + 1 equal-width edges over [min, max] of `rates` (one bin when all are equal)."""
    if bins < 1:
        raise InputError(f"bins must be >= 1, got {bins}")
    finite = [r for r in rates if math.isfinite(r)]
    if not finite:
        return ()
    low, high = min(finite), max(finite)
    if high <= low:
        return (low, high)
    width = (high - low) / bins
    return (*(low + i * width for i in range(bins)), high)


def _bin_index(rate: float, edges: Sequence[float]) -> int:
    """Index of the bin holding `rate`; the top edge belongs to the last bin."""
    for index in range(len(edges) - 1):
        if rate < edges[index + 1]:
            return index
    return len(edges) - 2


def _side(windows: Sequence[WindowSample], verdicts: Sequence[Verdict]) -> BinSide:
    if not windows:
        return BinSide(0, math.nan, math.nan, math.nan, math.nan, math.nan, math.nan)
    good = [v is Verdict.COMPLIANT for v in verdicts]
    return BinSide(
        windows=len(windows),
        compliant_frac=sum(good) / len(windows),
        goodput_tokens_per_s=math.fsum(
            interactive_rate_tokens_per_s(w) for w, ok in zip(windows, good, strict=True) if ok
        ) / len(windows),
        interactive_tokens_per_s=_mean([interactive_rate_tokens_per_s(w) for w in windows]),
        batch_tokens_per_s=_mean([w.batch.tokens / w.window_s for w in windows]),
        ttft_p95_s_median=_median([w.interactive.ttft_p95_s for w in windows]),
        itl_p95_s_median=_median([w.interactive.itl_p95_s for w in windows]),
    )


def load_bins(windows: Sequence[WindowSample], verdicts: Sequence[Verdict],
              bins: int) -> tuple[LoadBin, ...]:
    """Non-idle windows binned by interactive token rate, each bin split by borrowing."""
    judged = [(w, v) for w, v in zip(windows, verdicts, strict=True) if v is not Verdict.IDLE]
    edges = bin_edges([interactive_rate_tokens_per_s(w) for w, _ in judged], bins)
    if not edges:
        return ()
    members: list[list[tuple[WindowSample, Verdict]]] = [[] for _ in range(len(edges) - 1)]
    for window, verdict in judged:
        members[_bin_index(interactive_rate_tokens_per_s(window), edges)].append(
            (window, verdict))
    out = []
    for index, items in enumerate(members):
        with_b = [(w, v) for w, v in items if borrowing(w)]
        without = [(w, v) for w, v in items if not borrowing(w)]
        out.append(LoadBin(
            low_tokens_per_s=edges[index],
            high_tokens_per_s=edges[index + 1],
            borrowing=_side([w for w, _ in with_b], [v for _, v in with_b]),
            without=_side([w for w, _ in without], [v for _, v in without]),
        ))
    return tuple(out)


def matched(bins: Sequence[LoadBin]) -> Matched:
    """Borrowing minus no borrowing over bins holding both (weights min(n_b, n_w))."""
    both = [b for b in bins if b.borrowing.windows and b.without.windows]
    weights = [min(b.borrowing.windows, b.without.windows) for b in both]
    total = sum(weights)

    def delta(get) -> float:
        if not total:
            return math.nan
        return math.fsum(w * (get(b.borrowing) - get(b.without))
                         for b, w in zip(both, weights, strict=True)) / total

    return Matched(
        bins_compared=len(both),
        windows_weight=total,
        compliant_frac_delta=delta(lambda s: s.compliant_frac),
        goodput_tokens_per_s_delta=delta(lambda s: s.goodput_tokens_per_s),
        batch_tokens_per_s_gained=delta(lambda s: s.batch_tokens_per_s),
    )


def build_report(pool: str, windows: Sequence[WindowSample], slo: Slo, cost: CostModel,
                 *, bins: int = 5) -> Report:
    """The report over `windows` (consecutive, equal length, oldest first)."""
    if not windows:
        raise InputError(f"pool {pool!r}: no complete window in the period")
    window_s = windows[0].window_s
    start_s = windows[0].end_s - window_s
    end_s = windows[-1].end_s
    period_s = end_s - start_s
    verdicts = tuple(window_verdict(w, slo) for w in windows)
    load = load_bins(windows, verdicts, bins)
    return Report(
        pool=pool,
        start_s=start_s,
        end_s=end_s,
        window_s=window_s,
        slo=slo,
        windows=tuple(windows),
        verdicts=verdicts,
        interactive=summarise_class([w.interactive for w in windows], period_s),
        batch=summarise_class([w.batch for w in windows], period_s),
        compliance=compliance(windows, verdicts, period_s),
        batch_figures=batch_figures(windows, cost),
        fleet=fleet_figures(windows),
        bins=load,
        matched=matched(load),
    )


def json_safe(value: object) -> object:
    """NaN and infinities as None, recursively (strict JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def report_json(report: Report) -> dict:
    """The report as strict JSON (NaN as null); windows carry their verdict and borrowing."""
    data = asdict(report)
    data["windows"] = [
        {**asdict(w), "verdict": v.value, "borrowing": borrowing(w),
         "interactive_tokens_per_s": interactive_rate_tokens_per_s(w)}
        for w, v in zip(report.windows, report.verdicts, strict=True)
    ]
    del data["verdicts"]
    safe = json_safe(data)
    assert isinstance(safe, dict)
    return safe
