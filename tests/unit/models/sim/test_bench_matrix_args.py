"""The robustness matrix benchmark: the step guard of its runs, bad values, mode counts."""

from __future__ import annotations

from types import ModuleType

import pytest
from borrowd.models.enforcement import DEFAULT_STEP_GUARD_FRAC
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
