"""benchmarks/gpu_step_check.py: the compare logic on a synthetic measurements file, the
one-line exit-2 errors on bad files, and the CPU `--quick` measure mode end to end."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from borrowd.models.sim.profiles import PROFILES

from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def gsc() -> ModuleType:
    """benchmarks/gpu_step_check.py as a module (it is a script, not a package)."""
    return load_script("gpu_step_check")


def synthetic(gsc: ModuleType, factor_8b: float, factor_7b: float) -> dict[str, Any]:
    """A measurements file whose every case is `factor` x what the profiles predict: the
    8B cases against h100-llama3-8b, the 7B ones against the unscaled 7B reference."""
    profiles = {gsc.TARGET_SHAPE: (PROFILES["h100-llama3-8b"], factor_8b),
                gsc.REFERENCE_SHAPE: (gsc.reference_profile(), factor_7b)}
    cases = []
    for shape, (profile, factor) in profiles.items():
        for desc in gsc.grid(gsc.QUICK_PLAN):
            predicted = gsc.predict(profile, desc)
            step = 1e-4 if predicted is None else predicted * factor
            layers = 1 if desc["part"] == "lm_head" else gsc.LAYERS
            cases.append({"shape": shape, **desc, "step_s": step, "layer_s": step / layers})
    return {"format": gsc.FORMAT, "info": {"gpu": "synthetic"}, "settings": {},
            "shapes": gsc.SHAPES, "attention_backend": {}, "cases": cases, "skipped": []}


def test_compare_ratios_on_a_synthetic_file(gsc: ModuleType) -> None:
    """Cases at 1.25 x the profile give ratio 1.25 everywhere; the LM head is not compared;
    with the 7B cases at 1.25 x too, measured 8B/7B equals the recipe's implied ratio."""
    data = synthetic(gsc, 1.25, 1.25)
    rows = gsc.profile_rows(data, PROFILES["h100-llama3-8b"])
    n_cases = len(gsc.grid(gsc.QUICK_PLAN)) - len(gsc.QUICK_PLAN.lm_head_rows)
    assert len(rows) == n_cases
    assert all(r.ratio == pytest.approx(1.25) for r in rows)
    srows = gsc.shape_rows(data, PROFILES["h100-llama3-8b"], gsc.reference_profile())
    assert len(srows) == n_cases
    assert all(s.agreement == pytest.approx(1.0) for s in srows)
    assert all(s.reference_vs_profile == pytest.approx(1.25) for s in srows)
    decode = [s for s in srows if gsc.group(s.case) == "decode/attention"]
    assert decode and decode[0].implied_ratio == pytest.approx(8 / 32)  # KV heads 8 vs 32


def test_summary_median_and_worst(gsc: ModuleType) -> None:
    """Worst is the ratio furthest from 1 in log terms, whichever side."""
    assert gsc.summarize([1.0, 1.1, 0.5]) == (3, 1.0, 0.5)
    assert gsc.summarize([1.9, 0.9]) == (2, pytest.approx(1.4), 1.9)


def test_compare_prints_tables_and_summaries(gsc: ModuleType, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The command prints the per-case table, the shape table and the summary, exit 0."""
    path = tmp_path / "m.json"
    path.write_text(json.dumps(synthetic(gsc, 0.8, 1.0)))
    assert gsc.main(["compare", str(path)]) == 0
    out = capsys.readouterr().out
    assert "## llama3-8b measured vs h100-llama3-8b" in out
    assert "## shape scaling" in out
    summary = out.split("## summary")[1]
    for part in ("linear/layer", "linear/gemm", "decode/attention", "prefill/layer",
                 "mixed/layer"):
        line = next(ln for ln in summary.splitlines() if ln.startswith(f"| {part} |"))
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[2] == "0.80" and cells[3] == "0.80"  # 8B vs profile: median, worst
        assert cells[4] == "0.800" and cells[5] == "0.800"  # 8B/7B measured vs implied


def _bad_files(gsc: ModuleType, tmp: Path) -> dict[str, Path]:
    good = synthetic(gsc, 1.0, 1.0)
    negative = json.loads(json.dumps(good))
    negative["cases"][0]["step_s"] = -1.0
    no_key = json.loads(json.dumps(good))
    del no_key["cases"][0]["tokens"]
    files = {
        "missing": tmp / "absent.json",
        "not json": tmp / "garbage.json",
        "wrong format": tmp / "other.json",
        "no cases": tmp / "empty.json",
        "negative time": tmp / "negative.json",
        "missing key": tmp / "nokey.json",
    }
    files["not json"].write_text("{not json\n")
    files["wrong format"].write_text(json.dumps({"cases": good["cases"]}))
    files["no cases"].write_text(json.dumps({**good, "cases": []}))
    files["negative time"].write_text(json.dumps(negative))
    files["missing key"].write_text(json.dumps(no_key))
    return files


def test_bad_files_exit_2_with_one_line(gsc: ModuleType, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Each malformed or missing file: exit 2, nothing on stdout, one 'error:' line."""
    for name, path in _bad_files(gsc, tmp_path).items():
        assert gsc.main(["compare", str(path)]) == 2, name
        captured = capsys.readouterr()
        assert captured.out == "", name
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (name, captured.err)


def test_unknown_profile_exits_2(gsc: ModuleType, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown --profile is a one-line error too."""
    path = tmp_path / "m.json"
    path.write_text(json.dumps(synthetic(gsc, 1.0, 1.0)))
    assert gsc.main(["compare", str(path), "--profile", "no-such-profile"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown profile" in err[0]


def test_shipped_h200_measurements_load(gsc: ModuleType) -> None:
    """docs/gpu-step-check-h200.json (measured on the device) is a valid file with both
    shapes and every case of the full plan."""
    path = ROOT / "docs" / "gpu-step-check-h200.json"
    data = gsc.load_measurements(path)
    assert not data["settings"]["quick"]
    assert len(data["cases"]) == 2 * len(gsc.grid(gsc.FULL_PLAN))


def test_quick_cpu_measure_then_compare(gsc: ModuleType, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """`measure --device cpu --quick` writes a file of every quick case that compare reads
    (tiny shapes, a few seconds; the numbers mean nothing)."""
    pytest.importorskip("torch")
    out = tmp_path / "quick.json"
    assert gsc.main(["measure", "--out", str(out), "--device", "cpu", "--quick"]) == 0
    data = gsc.load_measurements(out)
    assert len(data["cases"]) == 2 * len(gsc.grid(gsc.QUICK_PLAN))
    assert all(c["step_s"] > 0 for c in data["cases"])
    assert gsc.main(["compare", str(out)]) == 0
    assert "--quick measurements" in capsys.readouterr().out
