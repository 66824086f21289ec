"""Traffic shapes of the robustness matrix: length transforms, rate warps, margin SLOs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from borrowd.models.errors import InputError
from borrowd.models.sim.shapes import (
    HELD_OUT,
    SHAPES,
    TUNE,
    BurstSpec,
    LengthTransform,
    RateProfile,
    burst_starts_s,
    get_shape,
    margin_slo,
    rate_multiplier,
    transform_lengths,
    warp_arrivals,
    write_jsonl,
)
from borrowd.models.sim.trace import Trace, load_trace


def _trace() -> Trace:
    return Trace(
        path=Path("t.jsonl"),
        arrival_s=np.arange(5, dtype=float),
        prompt_tokens=np.array([100, 1000, 10000, 3, 50]),
        output_tokens=np.array([10, 200, 30, 1, 5000]),
    )


def test_transform_lengths_scales_and_clips() -> None:
    """Prompts and outputs are scaled, rounded and clipped to [min, clip]; arrivals kept."""
    out = transform_lengths(
        _trace(),
        LengthTransform(prompt_scale=4.0, output_scale=0.5, prompt_min_tokens=16,
                        prompt_clip_tokens=32768, output_clip_tokens=100),
        Path("x.jsonl"),
    )
    assert out.prompt_tokens.tolist() == [400, 4000, 32768, 16, 200]
    assert out.output_tokens.tolist() == [5, 100, 15, 1, 100]
    assert out.arrival_s.tolist() == _trace().arrival_s.tolist()


@pytest.mark.parametrize(
    "profile",
    [
        RateProfile(period_frac=1.0, peak_to_trough=4.0),
        RateProfile(bursts=(BurstSpec(0.1, 60.0, 4.0, 1 / 6),)),
        RateProfile(period_frac=0.5, peak_to_trough=2.0, bursts=(BurstSpec(0.5, 30.0, 3.0),)),
    ],
    ids=["diurnal", "repeated-burst", "both"],
)
def test_rate_multiplier_has_mean_one(profile: RateProfile) -> None:
    """The multiplier keeps the run's mean rate (the calibrated load)."""
    t = np.arange(0.0, 3600.0, 0.5)
    assert np.mean(rate_multiplier(t, profile, 3600.0)) == pytest.approx(1.0, rel=1e-3)


def test_diurnal_peak_to_trough_ratio() -> None:
    """A 4x swing over the run starts at its trough and peaks at mid-run, 4 times higher."""
    m = rate_multiplier(np.array([0.0, 1800.0]), RateProfile(period_frac=1.0,
                                                             peak_to_trough=4.0), 3600.0)
    assert m[1] / m[0] == pytest.approx(4.0, rel=1e-3)


def test_warp_moves_arrivals_to_follow_the_rate() -> None:
    """Uniform arrivals warped by a burst: the burst window holds about k times the density,
    the run keeps every request, and times stay ordered inside the run."""
    duration = 1000.0
    arrivals = np.linspace(0.0, duration, 10001)[:-1]
    burst = RateProfile(bursts=(BurstSpec(0.5, 100.0, 4.0),))
    warped = warp_arrivals(arrivals, burst, duration)
    assert len(warped) == len(arrivals)
    assert np.all(np.diff(warped) >= 0) and warped[-1] <= duration
    inside = np.count_nonzero((warped >= 500) & (warped < 600)) / 100.0
    outside = np.count_nonzero(warped < 500) / 500.0
    assert inside / outside == pytest.approx(4.0, rel=0.05)


def test_flat_profile_leaves_arrivals() -> None:
    """No swing and no burst: arrivals are returned unchanged."""
    arrivals = np.array([0.5, 1.0, 7.0])
    assert warp_arrivals(arrivals, RateProfile(), 10.0).tolist() == arrivals.tolist()


def test_repeated_burst_starts() -> None:
    """A burst repeated every sixth of the run starts six times in it."""
    starts = burst_starts_s(BurstSpec(0.1, 60.0, 4.0, 1 / 6), 3600.0)
    assert starts == pytest.approx([360.0, 960.0, 1560.0, 2160.0, 2760.0, 3360.0])


def test_margin_slo_is_a_quarter_over_the_worst_window() -> None:
    """The margin SLO is 1.25 x the worst measured window; unmeasured windows are skipped."""
    assert margin_slo([0.1, None, float("nan"), 0.4]) == pytest.approx(0.5)
    with pytest.raises(InputError):
        margin_slo([None])


def test_write_jsonl_round_trips(tmp_path: Path) -> None:
    """A written shape trace reads back with the trace loader (times relative to the first)."""
    path = tmp_path / "s.jsonl"
    write_jsonl(path, np.array([1.0, 1.5, 3.25]), np.array([10, 20, 30]), np.array([1, 2, 3]))
    trace = load_trace(path)
    assert trace.arrival_s.tolist() == pytest.approx([0.0, 0.5, 2.25])
    assert trace.prompt_tokens.tolist() == [10, 20, 30]


def test_split_is_fixed_and_both_sides_present() -> None:
    """Shapes have unique names and both a tune and a held-out side."""
    names = [s.name for s in SHAPES]
    assert len(names) == len(set(names))
    assert {s.split for s in SHAPES} == {TUNE, HELD_OUT}
    with pytest.raises(InputError, match="unknown shape"):
        get_shape("nope")
