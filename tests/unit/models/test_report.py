"""Report figures: window verdicts, goodput, batch cost, load bins and the matched comparison."""

from __future__ import annotations

import json
import math

import pytest
from borrowd.models.batch.figures import CostModel
from borrowd.models.errors import InputError
from borrowd.models.report import (
    ClassWindow,
    Verdict,
    WindowSample,
    bin_edges,
    build_report,
    report_json,
    window_verdict,
)
from borrowd.models.signals import Slo

SLO = Slo(ttft_p95_s=1.0, itl_p95_s=0.05, success_rate=0.99)
COST = CostModel(price_per_gpu_hour=3.6, prefill_tokens_per_gpu_s=1000.0,
                 decode_tokens_per_gpu_s=100.0)
NAN = math.nan


def klass(tokens: float = 0.0, succeeded: float = 0.0, failed: float = 0.0,
          ttft: float = NAN, itl: float = NAN) -> ClassWindow:
    return ClassWindow(prompt_tokens=tokens * 0.9, output_tokens=tokens * 0.1,
                       succeeded=succeeded, failed=failed, revoked=0.0, ttft_p95_s=ttft,
                       ttft_p99_s=ttft, itl_p95_s=itl, itl_p99_s=itl)


def window(end_s: float, inter: ClassWindow, batch: ClassWindow | None = None,
           redone: float = NAN) -> WindowSample:
    return WindowSample(end_s=end_s, window_s=10.0, interactive=inter, batch=batch or klass(),
                        revocations=1.0, preemptions=0.0, kv_usage_mean_frac=0.2,
                        kv_usage_max_frac=0.4, gpu_busy_frac=0.5, redone_tokens=redone,
                        reprefill_tokens=NAN)


@pytest.mark.parametrize(("inter", "verdict"), [
    (klass(100, 10, 0, 0.5, 0.02), Verdict.COMPLIANT),
    (klass(100, 10, 0, 1.5, 0.02), Verdict.BURNING),
    (klass(100, 10, 0, 0.5, 0.06), Verdict.BURNING),
    (klass(100, 98, 2, 0.5, 0.02), Verdict.BURNING),
    (klass(100, 10, 0, NAN, 0.02), Verdict.COMPLIANT),
    (klass(0, 0, 0), Verdict.IDLE),
], ids=["ok", "ttft", "itl", "success", "unmeasured-ttft-not-judged", "idle"])
def test_window_verdict(inter: ClassWindow, verdict: Verdict) -> None:
    """A window burns on either p95 past its SLO or success under it; no traffic is idle."""
    assert window_verdict(window(10, inter), SLO) is verdict


def test_goodput_counts_only_compliant_windows() -> None:
    """Goodput = interactive tokens of compliant windows over the period; idle not judged."""
    windows = [window(10, klass(1000, 10, 0, 0.5, 0.02)),
               window(20, klass(3000, 10, 0, 2.0, 0.02)),
               window(30, klass(0))]
    report = build_report("p", windows, SLO, COST)
    assert report.compliance.compliant == 1 and report.compliance.burning == 1
    assert report.compliance.idle == 1
    assert report.compliance.compliant_frac == 0.5
    assert report.compliance.goodput_tokens_per_s == pytest.approx(1000 / 30)
    assert report.compliance.goodput_frac == pytest.approx(0.25)
    assert report.interactive.ttft_p95_s_worst == 2.0


def test_batch_cost_per_item_includes_redone_work() -> None:
    """GPU time covers proxy batch tokens plus redone output; cost per completed item."""
    windows = [window(10, klass(100, 1, 0, 0.1, 0.01), klass(1000, 2), redone=50.0),
               window(20, klass(100, 1, 0, 0.1, 0.01), klass(1000, 2))]
    figures = build_report("p", windows, SLO, COST).batch_figures
    # prompt 1800 / 1000 + (output 200 + redone 50) / 100 = 4.3 GPU s; 3.6 per GPU-hour.
    assert figures.gpu_hours == pytest.approx(4.3 / 3600)
    assert figures.cost == pytest.approx(4.3 * 3.6 / 3600)
    assert figures.cost_per_item == pytest.approx(4.3 * 3.6 / 3600 / 4)
    assert figures.items_completed == 4 and figures.tokens_completed == pytest.approx(2000)
    assert figures.revocations == 2 and figures.redone_tokens == 50.0
    assert math.isnan(figures.reprefill_tokens)


@pytest.mark.parametrize(("rates", "bins", "edges"), [
    ([0, 10, 20], 2, (0, 10, 20)),
    ([5, 5], 3, (5, 5)),
    ([], 2, ()),
], ids=["even", "constant", "empty"])
def test_bin_edges(rates: list[float], bins: int, edges: tuple) -> None:
    """Equal-width edges over the observed range; one bin when the load never moved."""
    assert bin_edges(rates, bins) == pytest.approx(edges)


def test_matched_comparison_compares_like_with_like() -> None:
    """Borrowing is judged within each load bin, not against windows at another load."""
    low, high = 1000.0, 5000.0
    windows = [
        window(10, klass(low, 5, 0, 0.2, 0.02)),                       # low, no batch, ok
        window(20, klass(low, 5, 0, 0.2, 0.02), klass(8000, 2)),       # low, batch, ok
        window(30, klass(high, 5, 0, 2.0, 0.02)),                      # high, no batch, burn
        window(40, klass(high, 5, 0, 0.3, 0.02), klass(2000, 1)),      # high, batch, ok
    ]
    report = build_report("p", windows, SLO, COST, bins=2)
    assert [b.without.windows for b in report.bins] == [1, 1]
    assert [b.borrowing.windows for b in report.bins] == [1, 1]
    assert report.bins[1].without.compliant_frac == 0.0
    assert report.bins[1].borrowing.compliant_frac == 1.0
    assert report.matched.bins_compared == 2
    assert report.matched.compliant_frac_delta == pytest.approx(0.5)
    assert report.matched.batch_tokens_per_s_gained == pytest.approx((800 + 200) / 2)


def test_report_json_is_strict_and_carries_verdicts() -> None:
    """NaN becomes null and every window names its verdict and whether it borrowed."""
    report = build_report("p", [window(10, klass(100, 1, 0, NAN, 0.01))], SLO, COST)
    data = json.loads(json.dumps(report_json(report), allow_nan=False))
    assert data["windows"][0]["verdict"] == "compliant"
    assert data["windows"][0]["borrowing"] is False
    assert data["windows"][0]["interactive"]["ttft_p95_s"] is None


def test_empty_period_is_an_input_error() -> None:
    """No window at all is the operator's mistake, named."""
    with pytest.raises(InputError, match="no complete window"):
        build_report("p", [], SLO, COST)
