"""The robustness matrix benchmark: the step guard of its runs, bad values, mode counts."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
from borrowd.models.enforcement import DEFAULT_STEP_GUARD_FRAC
from borrowd.models.signals import Slo
from borrowd.models.sim.shapes import SHAPES

from tests.support.scripts import load_script


@pytest.fixture(scope="module")
def bench_matrix() -> ModuleType:
    """benchmarks/bench_matrix.py as a module (it is a script, not a package)."""
    return load_script("bench_matrix")


def test_runs_carry_the_step_guard_given(bench_matrix: ModuleType) -> None:
    """Each run's scenario holds the step guard asked for (default: the plugin's), so the
    cache keys of runs with and without the guard differ."""
    shape = SHAPES[0]
    assert bench_matrix.base_scenario(shape, 600.0).step_guard_frac == DEFAULT_STEP_GUARD_FRAC
    off = bench_matrix.base_scenario(shape, 600.0, 0.0)
    assert off.step_guard_frac == 0.0
    assert repr(off) != repr(bench_matrix.base_scenario(shape, 600.0))


@pytest.mark.parametrize("value", ["1.5", "-0.1"])
def test_a_step_guard_out_of_range_exits_2_with_one_line(
    bench_matrix: ModuleType, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    """--step-guard-frac outside [0, 1] is one line naming the option, exit code 2."""
    assert bench_matrix.main(["--quick", "--step-guard-frac", value]) == 2
    err = capsys.readouterr().err.strip()
    assert "--step-guard-frac must be in [0, 1]" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(("modes", "changes"), [
    (["closed", "failsafe", "closed", "ramp", "open", "open"], 0),
    (["closed", "ramp", "open", "closed", "open", "open"], 2),
    (["closed", "ramp", "closed", "ramp"], 3),
    ([], 0),
], ids=["cold-start-only", "one-cut-after-start", "never-opens", "empty"])
def test_mode_changes_are_counted_after_the_cold_start(
    bench_matrix: ModuleType, modes: list[str], changes: int
) -> None:
    """The cold start (closed, a failsafe while the first scrapes come in, the ramp) is once
    per daemon start and not counted; a pool that never opens counts every change."""
    assert bench_matrix.mode_changes_after_start(modes) == changes


def row(split: str, ratio: float, met: float, missed: int) -> dict[str, object]:
    """A matrix row with the fields the summaries read."""
    return {"split": split, "ratio": ratio, "law_windows_met_frac": met,
            "law_windows_missed": missed}


def test_several_draws_are_summed_per_split_then_shown_each(bench_matrix: ModuleType) -> None:
    """Rows at the bar (at least 1.0x with every window met) and windows missed add up over
    the draws; each draw has its own line; a split with no rows has no lines."""
    rows_by_seed = {
        0: [row("tune", 1.2, 1.0, 0), row("tune", 0.8, 0.9, 1), row("held-out", 2.0, 0.8, 2)],
        1: [row("tune", 1.1, 0.9, 1), row("tune", 0.9, 1.0, 0), row("held-out", 1.0, 1.0, 0)],
    }
    lines = bench_matrix.draws_summary(rows_by_seed, "tune")
    assert lines[0].startswith("tune shapes over 2 batch draws (seeds 0 1): at the bar 1/4, "
                               "windows missed 2, geometric mean 0.99x, worst 0.80x")
    assert lines[1] == ("  seed 0: at the bar 1/2, windows missed 1, geometric mean 0.98x, "
                        "worst 0.80x")
    assert lines[2].startswith("  seed 1: at the bar 0/2, windows missed 1")
    held = bench_matrix.draws_summary(rows_by_seed, "held-out")
    assert held[0].endswith("at the bar 1/2, windows missed 2, geometric mean 1.41x, worst 1.00x")
    assert bench_matrix.draws_summary({0: []}, "tune") == []


def test_windows_missed_counts_the_run_windows(bench_matrix: ModuleType) -> None:
    """A run with 10 windows, 80% met, missed 2."""
    run = {"windows_met_frac": 0.8, "window_ttft_p95_s": [0.1] * 10}
    assert bench_matrix.windows_missed(run) == 2


def test_explain_prints_each_window_and_each_mode_change(
    bench_matrix: ModuleType, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """--explain runs the law on one row (60 s here) and prints its SLO, one line per 60 s
    window with its p95s over the SLO, and the mode changes from the cold start on."""
    monkeypatch.setenv("BORROWD_CACHE_DIR", str(tmp_path))
    assert bench_matrix.main(["--duration", "60", "--explain", "short-fast:engine"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("SLO p95 TTFT ") and "windows met" in out[0]
    windows = out[2:out.index("mode changes (t s, mode, budget tokens/s, reason)")]
    assert len(windows) == 1 and windows[0].split("|")[0].strip() == "0"
    modes = [line.split()[1] for line in out[out.index(
        "mode changes (t s, mode, budget tokens/s, reason)") + 1:]]
    assert modes[0] == "closed" and "ramp" in modes


def test_explain_lines_mark_missed_windows_and_collapse_repeated_modes(
    bench_matrix: ModuleType,
) -> None:
    """A missed window says so with its p95s as shares of the SLO; consecutive ticks in one
    mode are one line."""
    summary = {
        "batch": {"tokens_per_s": 1234.4, "revocations": 2},
        "interactive": {"slo_windows_met_frac": 0.5},
        "windows": [
            {"start_s": 0.0, "ttft_p95_s": 0.5, "itl_p95_s": 0.01, "batch_tokens_per_s": 10.0,
             "slo_met": True},
            {"start_s": 60.0, "ttft_p95_s": 1.5, "itl_p95_s": 0.02, "batch_tokens_per_s": 20.0,
             "slo_met": False},
        ],
        "budget_timeline": [
            {"t_s": 0.0, "mode": "closed", "batch_tokens_per_s": 0.0, "reason": "start"},
            {"t_s": 1.0, "mode": "closed", "batch_tokens_per_s": 0.0, "reason": "start"},
            {"t_s": 2.0, "mode": "open", "batch_tokens_per_s": 500.0, "reason": "law"},
        ],
    }
    lines = bench_matrix.explain_lines(summary, Slo(ttft_p95_s=1.0, itl_p95_s=0.02))
    assert lines[0] == ("SLO p95 TTFT 1 s, ITL 20 ms; batch 1234 tokens/s, windows met 0.500, "
                        "revocations 2")
    assert [cell.strip() for cell in lines[3].split("|")] == ["60", "1.50", "1.00", "20",
                                                              "MISSED"]
    assert [line.split()[1] for line in lines[5:]] == ["closed", "open"]


@pytest.mark.parametrize(("value", "names"), [
    ("diurnal:gate", "--explain needs SHAPE:ENFORCEMENT"),
    ("diurnal", "--explain needs SHAPE:ENFORCEMENT"),
    ("nope:engine", "unknown shape 'nope'"),
])
def test_a_bad_explain_exits_2_with_one_line(
    bench_matrix: ModuleType, capsys: pytest.CaptureFixture[str], value: str, names: str
) -> None:
    """--explain with no or an unknown enforcement, or an unknown shape: one line, exit 2."""
    assert bench_matrix.main(["--quick", "--explain", value]) == 2
    err = capsys.readouterr().err.strip()
    assert names in err and len(err.splitlines()) == 1
