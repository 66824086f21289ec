"""The rollout report as one self-contained HTML page: summary tables, the matched-load
comparison, and plots embedded as base64 PNG (matplotlib, Agg). No script, no external file.
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Sequence
from datetime import UTC, datetime

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from borrowd.models.report import (
    LoadBin,
    Report,
    Verdict,
    borrowing,
    interactive_rate_tokens_per_s,
)
from matplotlib.figure import Figure

STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #1d1d1f; max-width: 1200px; }
h1 { font-size: 24px; margin-bottom: 4px; } h2 { font-size: 18px; margin-top: 28px; }
.meta { color: #555; margin-bottom: 16px; }
table { border-collapse: collapse; margin: 8px 0 16px; font-size: 14px; }
th, td { border: 1px solid #ccc; padding: 4px 10px; text-align: right; }
th { background: #f2f2f2; } td.l, th.l { text-align: left; }
.cards { display: flex; gap: 12px; flex-wrap: wrap; }
.card { border: 1px solid #ccc; border-radius: 6px; padding: 10px 14px; min-width: 170px; }
.card .v { font-size: 22px; font-weight: 600; } .card .k { color: #555; font-size: 13px; }
img { max-width: 100%; border: 1px solid #eee; }
p.note { color: #555; font-size: 13px; max-width: 900px; }
"""


def _fmt(value: float, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def _when(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _png(fig: Figure) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    data = base64.b64encode(buffer.getvalue()).decode()
    return f'<img alt="plot" src="data:image/png;base64,{data}">'


def timeline_plot(report: Report) -> str:
    """Load, latency against SLO and fleet occupancy per window, compliance shaded."""
    ends = [(w.end_s - report.start_s) / 60.0 for w in report.windows]
    width = report.window_s / 60.0
    fig, axes = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    load, latency, fleet = axes
    load.plot(ends, [interactive_rate_tokens_per_s(w) for w in report.windows],
              label="interactive tokens/s", color="tab:blue")
    load.plot(ends, [w.batch.tokens / w.window_s for w in report.windows],
              label="batch tokens/s", color="tab:orange")
    load.set_ylabel("tokens/s")
    load.legend(loc="upper left")
    latency.plot(ends, [w.interactive.ttft_p95_s / report.slo.ttft_p95_s
                        for w in report.windows], marker=".", label="p95 TTFT / SLO")
    latency.plot(ends, [w.interactive.itl_p95_s / report.slo.itl_p95_s
                        for w in report.windows], marker=".", label="p95 ITL / SLO")
    latency.axhline(1.0, color="black", linewidth=1, linestyle="--")
    for end, verdict in zip(ends, report.verdicts, strict=True):
        if verdict is Verdict.BURNING:
            latency.axvspan(end - width, end, color="tab:red", alpha=0.15, linewidth=0)
    latency.set_ylabel("x SLO")
    latency.set_title("interactive p95 over its SLO (red: a burning window)", fontsize=10)
    latency.legend(loc="upper left")
    fleet.plot(ends, [w.kv_usage_max_frac for w in report.windows], label="KV usage (max)")
    fleet.plot(ends, [w.gpu_busy_frac for w in report.windows], label="GPU busy")
    fleet.set_ylim(0, 1.05)
    fleet.set_ylabel("fraction")
    fleet.set_xlabel(f"minutes since {_when(report.start_s)}")
    fleet.legend(loc="upper left")
    fig.tight_layout()
    return _png(fig)


def matched_plot(report: Report) -> str:
    """Per load bin: SLO compliance and goodput with and without borrowing."""
    bins = report.bins
    labels = [f"{b.low_tokens_per_s:.0f}-{b.high_tokens_per_s:.0f}" for b in bins]
    x = list(range(len(bins)))
    fig, (comp, good) = plt.subplots(1, 2, figsize=(11, 3.8))
    for axis, get, title in ((comp, lambda s: s.compliant_frac, "SLO-compliant windows"),
                             (good, lambda s: s.goodput_tokens_per_s,
                              "goodput (interactive tokens/s)")):
        axis.bar([i - 0.2 for i in x], [_nan0(get(b.without)) for b in bins], width=0.4,
                 label="without borrowing", color="tab:blue")
        axis.bar([i + 0.2 for i in x], [_nan0(get(b.borrowing)) for b in bins], width=0.4,
                 label="with borrowing", color="tab:orange")
        axis.set_xticks(x, labels, rotation=20)
        axis.set_xlabel("interactive tokens/s (bin)")
        axis.set_title(title)
    comp.set_ylim(0, 1.05)
    comp.legend(loc="lower left")
    fig.tight_layout()
    return _png(fig)


def _nan0(value: float) -> float:
    return value if math.isfinite(value) else 0.0


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f'<th class="{"l" if i == 0 else ""}">{html.escape(h)}</th>'
                   for i, h in enumerate(header))
    body = "".join(
        "<tr>" + "".join(f'<td class="{"l" if i == 0 else ""}">{html.escape(c)}</td>'
                         for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _bins_table(bins: Sequence[LoadBin]) -> str:
    rows = []
    for b in bins:
        for name, side in (("without", b.without), ("with", b.borrowing)):
            rows.append([
                f"{b.low_tokens_per_s:.0f}-{b.high_tokens_per_s:.0f}", name, str(side.windows),
                _fmt(side.compliant_frac), _fmt(side.goodput_tokens_per_s),
                _fmt(side.interactive_tokens_per_s), _fmt(side.batch_tokens_per_s),
                _fmt(side.ttft_p95_s_median), _fmt(side.itl_p95_s_median)])
    return _table(["interactive tokens/s", "borrowing", "windows", "SLO met", "goodput tok/s",
                   "interactive tok/s", "batch tok/s", "p95 TTFT s (median)",
                   "p95 ITL s (median)"], rows)


def _card(key: str, value: str) -> str:
    return f'<div class="card"><div class="v">{html.escape(value)}</div>' \
           f'<div class="k">{html.escape(key)}</div></div>'


def render_html(report: Report) -> str:
    """The whole page."""
    c, b, f, m = report.compliance, report.batch_figures, report.fleet, report.matched
    inter, batch = report.interactive, report.batch
    cards = "".join([
        _card("interactive windows meeting SLO", f"{c.compliant}/{c.compliant + c.burning}"),
        _card("SLO-compliant goodput, tokens/s", _fmt(c.goodput_tokens_per_s)),
        _card("batch items completed", _fmt(b.items_completed)),
        _card("batch tokens completed", _fmt(b.tokens_completed)),
        _card("cost per batch item", _fmt(b.cost_per_item)),
        _card("GPU busy", _fmt(f.gpu_busy_frac)),
    ])
    class_rows = [
        [name, _fmt(s.succeeded), _fmt(s.failed), _fmt(s.revoked), _fmt(s.prompt_tokens),
         _fmt(s.output_tokens), _fmt(s.tokens_per_s), _fmt(s.ttft_p95_s_median),
         _fmt(s.ttft_p95_s_worst), _fmt(s.itl_p95_s_median), _fmt(s.itl_p95_s_worst)]
        for name, s in (("interactive", inter), ("batch", batch))]
    batch_rows = [
        ["items completed", _fmt(b.items_completed)],
        ["tokens completed (prompt + output)", _fmt(b.tokens_completed)],
        ["revocations", _fmt(b.revocations)],
        ["redone output tokens (batch service)", _fmt(b.redone_tokens)],
        ["re-prefilled tokens (batch service)", _fmt(b.reprefill_tokens)],
        ["engine preemptions (each recomputes a request)", _fmt(b.preemptions)],
        ["GPU-hours of batch work", _fmt(b.gpu_hours)],
        ["cost", _fmt(b.cost)],
        ["cost per completed item", _fmt(b.cost_per_item)],
        ["KV usage, mean / max", f"{_fmt(f.kv_usage_mean_frac)} / {_fmt(f.kv_usage_max_frac)}"],
        ["GPU busy (share of time an engine ran a request)", _fmt(f.gpu_busy_frac)],
    ]
    matched_rows = [[
        str(m.bins_compared), str(m.windows_weight), _fmt(m.compliant_frac_delta),
        _fmt(m.goodput_tokens_per_s_delta), _fmt(m.batch_tokens_per_s_gained)]]
    borrowed = sum(borrowing(w) for w in report.windows)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>borrowd report: {html.escape(report.pool)}</title><style>{STYLE}</style></head>
<body>
<h1>borrowd report: pool {html.escape(report.pool)}</h1>
<div class="meta">{_when(report.start_s)} to {_when(report.end_s)};
{len(report.windows)} windows of {report.window_s:g} s ({borrowed} with borrowing, {c.idle} idle);
SLOs: p95 TTFT &le; {report.slo.ttft_p95_s:g} s, p95 ITL &le; {report.slo.itl_p95_s:g} s,
success &ge; {report.slo.success_rate:g}</div>
<div class="cards">{cards}</div>
<h2>Per class</h2>
{_table(["class", "succeeded", "failed", "revoked", "prompt tokens", "output tokens",
         "tokens/s", "p95 TTFT s (median)", "p95 TTFT s (worst)", "p95 ITL s (median)",
         "p95 ITL s (worst)"], class_rows)}
<h2>Batch work and its cost</h2>
{_table(["figure", "value"], batch_rows)}
<h2>Borrowing against no borrowing at matched interactive load</h2>
<p class="note">Windows are binned by their interactive token rate; within a bin, windows that
carried batch work are compared with windows that did not. The deltas are borrowing minus no
borrowing over the bins holding both, weighted by the smaller count.</p>
{_table(["bins compared", "window weight", "SLO-met share delta", "goodput delta tok/s",
         "batch tokens/s gained"], matched_rows)}
{_bins_table(report.bins)}
{matched_plot(report) if report.bins else ""}
<h2>Over time</h2>
{timeline_plot(report)}
</body></html>
"""
