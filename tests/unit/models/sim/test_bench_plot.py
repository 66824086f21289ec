"""The bench plot: one panel per figure the table reports over time, batch tokens/s included."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import pytest
from borrowd.models.sim.bench import plot

matplotlib.use("Agg")


def _windows(batch_tokens_per_s: float) -> list[dict[str, float]]:
    return [{"start_s": 60.0 * k, "ttft_p95_s": 0.3, "itl_p95_s": 0.02, "gpu_busy_frac": 0.9,
             "batch_tokens_per_s": batch_tokens_per_s} for k in range(5)]


def test_plot_has_a_batch_tokens_panel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plot shows p95 TTFT, p95 ITL, busy fraction and batch tokens/s per window."""
    import matplotlib.pyplot as plt

    closed = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (closed.append(fig), close(fig)))
    rows = [{"policy": "pi", "windows": _windows(73_000.0)},
            {"policy": "none", "windows": _windows(0.0)}]
    png = tmp_path / "bench.png"
    plot(rows, png, slo_ttft_s=1.0, slo_itl_s=0.05)
    assert png.stat().st_size > 0
    axes = closed[0].axes
    assert [ax.get_ylabel() for ax in axes] == [
        "p95 TTFT (s)", "p95 ITL (ms)", "GPU busy fraction", "batch tokens/s (k)"]
    assert list(axes[3].lines[0].get_ydata()) == [73.0] * 5
