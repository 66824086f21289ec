"""`borrowd report` against a real Prometheus scraping a pool whose series follow set phases.

The report's per-window figures must equal the same numbers asked of Prometheus by hand
(instant queries written here, at each window's end), its totals the sums of those, and the
matched-load comparison must set the borrowing windows beside non-borrowing ones of the
same interactive load.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from borrowd.controller.prom_source import connect_prometheus

from tests.support.daemon_harness import borrowd_command
from tests.support.report_exporter import Phase, PhasedPool
from tests.support.servers import ServerProcess, start_prometheus

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("prometheus") is None,
                       reason="needs prometheus (Debian package prometheus)"),
]
POOL = "chat"
WINDOW_S = 4.0
PHASE_S = 8.0
PHASES = (
    Phase(interactive_per_s=20, batch_per_s=0, ttft_s=0.2, itl_s=0.02, kv_usage_frac=0.2),
    Phase(interactive_per_s=20, batch_per_s=5, ttft_s=0.3, itl_s=0.03, kv_usage_frac=0.6,
          revocations_per_s=1),
    Phase(interactive_per_s=60, batch_per_s=0, ttft_s=0.4, itl_s=0.04, kv_usage_frac=0.3),
    Phase(interactive_per_s=60, batch_per_s=5, ttft_s=2.0, itl_s=0.08, kv_usage_frac=0.9),
)


def _hand(prom, expr: str, at: float, missing: float = 0.0) -> float:
    """An instant query at `at`; `missing` when no series answers (the report's convention:
    no increase is 0, no latency sample is NaN)."""
    result = prom.custom_query(expr, params={"time": f"{at:.3f}"})
    return float(result[0]["value"][1]) if result else missing


def _same(a: float | None, b: float) -> bool:
    if a is None:
        return math.isnan(b)
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def test_report_matches_prometheus_by_hand(tmp_path: Path) -> None:
    """Per-window figures equal hand-written instant queries; totals and verdicts follow."""
    pool = PhasedPool(POOL, PHASES[0]).start()
    prometheus: ServerProcess | None = None
    try:
        prometheus = start_prometheus(
            {"proxy": [pool.proxy_target], "vllm": [pool.vllm_target]},
            scrape_interval_s=0.5, target_labels={"vllm": {"pool": POOL}})
        time.sleep(3.0)  # a few scrapes before the period begins
        start_s = float(math.ceil(time.time()))
        time.sleep(start_s - time.time())
        for phase in PHASES:
            pool.phase = phase
            time.sleep(PHASE_S)
        end_s = time.time() - 0.5
        time.sleep(1.5)
        html_path, json_path = tmp_path / "report.html", tmp_path / "report.json"
        run = subprocess.run(
            [borrowd_command(), "report", "--pool", POOL, "--from", f"{start_s}",
             "--to", f"{end_s:.3f}", "--prometheus", prometheus.extra["url"],
             "--out", str(html_path), "--json", str(json_path), "--window-s", str(WINDOW_S),
             "--bins", "2", "--slo-ttft-s", "1.0", "--slo-itl-s", "0.05"],
            capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr[-2000:]
        report = json.loads(json_path.read_text())
        prom = connect_prometheus(prometheus.extra["url"], 10.0)
        sel = f'pool="{POOL}"'
        by_hand = []
        for window in report["windows"]:
            at = window["end_s"]
            figures = {
                "batch_items": _hand(prom, "sum(increase(borrowd_proxy_requests_total"
                                     f'{{{sel},class="batch",outcome="success"}}[4s]))', at),
                "batch_tokens": _hand(prom, "sum(increase(borrowd_proxy_tokens_total"
                                      f'{{{sel},class="batch"}}[4s]))', at),
                "interactive_tokens": _hand(prom, "sum(increase(borrowd_proxy_tokens_total"
                                            f'{{{sel},class="interactive"}}[4s]))', at),
                "ttft_p95_s": _hand(prom, "histogram_quantile(0.95, sum by (le) (increase("
                                    f'borrowd_proxy_ttft_seconds_bucket{{{sel},'
                                    'class="interactive"}[4s])))', at, math.nan),
                "itl_p95_s": _hand(prom, "histogram_quantile(0.95, sum by (le) (increase("
                                   f'borrowd_proxy_itl_seconds_bucket{{{sel},'
                                   'class="interactive"}[4s])))', at, math.nan),
                "revocations": _hand(prom, "sum(increase(borrowd_proxy_revocations_total"
                                     f"{{{sel}}}[4s]))", at),
                # Prometheus 2.x stores prometheus_client's `vllm:` names as `vllm_`.
                "kv_max": _hand(prom, f"max(max_over_time(vllm_kv_cache_usage_perc{{{sel}}}"
                                "[4s]))", at, math.nan),
            }
            by_hand.append(figures)
            batch, inter = window["batch"], window["interactive"]
            pairs = [
                (batch["succeeded"], figures["batch_items"]),
                (batch["prompt_tokens"] + batch["output_tokens"], figures["batch_tokens"]),
                (inter["prompt_tokens"] + inter["output_tokens"], figures["interactive_tokens"]),
                (inter["ttft_p95_s"], figures["ttft_p95_s"]),
                (inter["itl_p95_s"], figures["itl_p95_s"]),
                (window["revocations"], figures["revocations"]),
                (window["kv_usage_max_frac"], figures["kv_max"]),
            ]
            assert all(_same(a, b) for a, b in pairs), (at, pairs)
            burning = figures["ttft_p95_s"] > 1.0 or figures["itl_p95_s"] > 0.05
            assert window["verdict"] == ("burning" if burning else "compliant"), window
    finally:
        pool.stop()
        if prometheus is not None:
            prometheus.kill()

    assert len(report["windows"]) == math.floor((end_s - start_s) / WINDOW_S)
    batch = report["batch_figures"]
    assert math.isclose(batch["items_completed"], sum(f["batch_items"] for f in by_hand))
    assert math.isclose(batch["tokens_completed"], sum(f["batch_tokens"] for f in by_hand))
    assert batch["items_completed"] > 0 and batch["cost_per_item"] > 0
    compliant = [w for w in report["windows"] if w["verdict"] == "compliant"]
    assert report["compliance"]["compliant"] == len(compliant)
    goodput = sum(f["interactive_tokens"] for f, w in zip(by_hand, report["windows"],
                                                          strict=True)
                  if w["verdict"] == "compliant") / (report["end_s"] - report["start_s"])
    assert math.isclose(report["compliance"]["goodput_tokens_per_s"], goodput)
    # The last phase (high load with batch) burns; high load without batch does not: the
    # matched comparison sets them side by side in the high-load bin.
    high = report["bins"][-1]
    assert high["borrowing"]["windows"] >= 1 and high["without"]["windows"] >= 1
    assert high["borrowing"]["compliant_frac"] < high["without"]["compliant_frac"]
    assert report["matched"]["bins_compared"] >= 1
    assert "<img" in html_path.read_text()
