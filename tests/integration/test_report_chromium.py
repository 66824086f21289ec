"""The report's HTML rendered by a real headless Chromium: a full, non-trivial page.

Set BORROWD_REPORT_SCREENSHOT to a path to keep the screenshot for a look.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from borrowd.controller.report_render import render_html
from borrowd.models.batch.figures import CostModel
from borrowd.models.report import ClassWindow, WindowSample, build_report
from borrowd.models.signals import Slo
from PIL import Image

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (Debian package chromium)"),
]


def _windows() -> list[WindowSample]:
    out = []
    for index in range(60):
        load = 2000.0 + 1500.0 * math.sin(index / 6.0)
        borrowing = index % 3 != 0
        ttft = 0.2 + load / 8000.0 + (0.5 if borrowing and load > 3000 else 0.0)
        inter = ClassWindow(prompt_tokens=load * 50, output_tokens=load * 10, succeeded=200,
                            failed=0, revoked=0, ttft_p95_s=ttft, ttft_p99_s=ttft * 1.5,
                            itl_p95_s=0.02 + (0.02 if borrowing else 0.0), itl_p99_s=0.06)
        batch = ClassWindow(prompt_tokens=3e5 if borrowing else 0, output_tokens=2e4
                            if borrowing else 0, succeeded=12 if borrowing else 0, failed=0,
                            revoked=1 if borrowing else 0, ttft_p95_s=math.nan,
                            ttft_p99_s=math.nan, itl_p95_s=math.nan, itl_p99_s=math.nan)
        out.append(WindowSample(end_s=1.8e9 + 60 * (index + 1), window_s=60.0, interactive=inter,
                                batch=batch, revocations=batch.revoked, preemptions=0,
                                kv_usage_mean_frac=0.3 + 0.3 * borrowing,
                                kv_usage_max_frac=0.4 + 0.4 * borrowing,
                                gpu_busy_frac=0.4 + 0.5 * borrowing, redone_tokens=math.nan,
                                reprefill_tokens=math.nan))
    return out


def test_report_renders_in_chromium(tmp_path: Path) -> None:
    """Chromium renders the self-contained page to a large screenshot with real content."""
    report = build_report("chat", _windows(), Slo(), CostModel(2.0, 20000.0, 2500.0))
    page = tmp_path / "report.html"
    page.write_text(render_html(report))
    shot = Path(os.environ.get("BORROWD_REPORT_SCREENSHOT") or tmp_path / "shot.png")
    assert CHROMIUM is not None
    run = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}",
         "--window-size=1280,2000", page.as_uri()],
        capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and shot.exists(), run.stderr[-2000:]
    with Image.open(shot) as image:
        assert image.size == (1280, 2000)
        rgb = image.convert("RGB")
        colors = rgb.getcolors(maxcolors=1 << 20) or []
        # Text, tables and plots: many colours, and ink on a good share of the page.
        assert len(colors) > 200, len(colors)
        inked = sum(count for count, color in colors if sum(color) < 600)
        assert inked > 0.02 * 1280 * 2000, inked
