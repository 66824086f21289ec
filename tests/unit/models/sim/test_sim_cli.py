"""Tests of `borrowd sim` and `borrowd bench`: JSON keys, table, one-line errors (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from borrowd.controller.cli import main
from borrowd.models.sim.bench import format_table

INTERACTIVE_KEYS = {
    "requests", "ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "itl_p50_s", "itl_p95_s",
    "itl_p99_s", "success_rate", "slo_windows_met_frac",
}
BATCH_KEYS = {
    "completed", "tokens_per_s", "prompt_tokens_per_s", "output_tokens_per_s",
    "recomputed_tokens_frac", "preemptions",
}
TOP_KEYS = {
    "policy", "scenario", "duration_s", "wall_s", "interactive_rate_scale", "gpu_busy_frac",
    "interactive", "batch", "windows",
}


def test_sim_writes_the_documented_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """`borrowd sim` writes every key of issue #2 and one window per 60 s."""
    monkeypatch.setenv("BORROWD_CACHE_DIR", str(tmp_path))
    (tmp_path / "rate_scale.json").write_text("{}")
    out = tmp_path / "run.json"
    monkeypatch.setattr("borrowd.models.sim.run.calibrate_rate_scale", lambda *a, **k: 0.2672)
    rc = main(["sim", "--scenario", "seed", "--policy", "static:5000", "--duration", "120",
               "--seed", "3", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert set(data) >= TOP_KEYS
    assert set(data["interactive"]) >= INTERACTIVE_KEYS
    assert set(data["batch"]) >= BATCH_KEYS
    assert len(data["windows"]) == 2
    assert INTERACTIVE_KEYS - {"slo_windows_met_frac"} <= set(data["windows"][0])
    assert data["budget_timeline"][0]["batch_tokens_per_s"] == 5000
    assert "static:5000" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["sim", "--scenario", "nope", "--policy", "none"], "unknown scenario 'nope'"),
        (["sim", "--policy", "sometimes"], "unknown policy 'sometimes'"),
        (["sim", "--policy", "none", "--profile", "tpu"], "unknown profile 'tpu'"),
        (["sim", "--policy", "none", "--duration", "0"], "--duration must be > 0"),
        (["sim", "--policy", "none", "--duration", "-5"], "--duration must be > 0"),
        (["sim", "--policy", "none", "--interactive-trace", "/no/such.csv"],
         "/no/such.csv does not exist"),
        (["sim", "--policy", "none", "--interactive-load", "1.5"], "interactive load"),
        (["sim", "--policy", "none", "--engine", "quantum"], "unknown engine core 'quantum'"),
        (["bench", "--policies", "none", "bogus", "--duration", "60"], "unknown policy 'bogus'"),
    ],
    ids=["scenario", "policy", "profile", "zero-duration", "negative-duration",
         "missing-trace", "load-range", "engine", "bench-policy"],
)
def test_bad_input_is_one_line_and_exit_2(argv: list[str], message: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Bad input stops with one line naming the problem and exit code 2."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err
    assert len(err.splitlines()) == 1


def test_malformed_trace_is_one_line_and_exit_2(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A malformed trace file names the file and line, exit code 2."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 1, "input_length": 3}\n')
    assert main(["sim", "--policy", "none", "--interactive-trace", str(bad)]) == 2
    assert "bad.jsonl:1: missing key 'output_length'" in capsys.readouterr().err


def test_table_has_a_row_per_run() -> None:
    """The bench table has a header, a rule and one row per run, dashes for missing."""
    rows = [{"policy": "none", "gpu_busy_frac": 0.4, "interactive": {"ttft_p95_s": None}}]
    lines = format_table(rows).splitlines()
    assert len(lines) == 3
    assert lines[2].startswith("| none | 0.400 | - |")
