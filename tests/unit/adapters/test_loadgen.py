"""The load generator's pure parts: schedule from the trace, batch lengths, summary, burst."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from borrowd.adapters.loadgen import (
    BATCH,
    ERROR,
    INTERACTIVE,
    REJECTED,
    REVOKED,
    SUCCESS,
    LoadgenConfig,
    RequestRecord,
    batch_lengths,
    failures,
    interactive_schedule,
    parse_burst,
    summarize,
)
from borrowd.models.errors import InputError
from borrowd.models.sim.trace import Lengths, Trace

TRACE = Trace(
    path=Path("synthetic.csv"),
    arrival_s=np.arange(0.0, 100.0, 1.0),  # one request per second
    prompt_tokens=np.full(100, 500),
    output_tokens=np.full(100, 300),
)
LENGTHS = Lengths(path=Path("lengths.csv"), prompt_tokens=np.array([1000, 3000, 9000]),
                  output_tokens=np.array([50, 500, 5000]))


def config(**overrides) -> LoadgenConfig:
    """A config for tests (nothing is sent)."""
    return LoadgenConfig(proxy_url="http://127.0.0.1:1", interactive_key="i", batch_key="b",
                         **overrides)


def test_schedule_follows_rate_scale_and_burst() -> None:
    """Twice the trace rate, and three times that inside the burst; outputs are clipped."""
    schedule = interactive_schedule(TRACE, config(duration_s=30.0, rate_scale=2.0,
                                                  burst=(10.0, 20.0, 3.0),
                                                  interactive_max_output_tokens=64))
    times = np.array([t for t, _, _ in schedule])
    assert np.sum(times < 10) == 20
    assert np.sum((times >= 10) & (times < 20)) == 60
    assert {o for _, _, o in schedule} == {64}
    assert {p for _, p, _ in schedule} == {500}


def test_batch_lengths_are_scaled_clipped_and_repeatable() -> None:
    """Batch prompts are scaled and clipped, outputs clipped; the same index, the same request."""
    cfg = config(batch_prompt_scale=4.0, batch_max_prompt_tokens=16000,
                 batch_max_output_tokens=256)
    drawn = [batch_lengths(LENGTHS, cfg, i) for i in range(50)]
    assert drawn == [batch_lengths(LENGTHS, cfg, i) for i in range(50)]
    assert {p for p, _ in drawn} <= {4000, 12000, 16000}
    assert {o for _, o in drawn} <= {50, 256}


def test_summary_counts_per_class() -> None:
    """Success rate and TTFT percentiles for interactive; completed work for batch; errors
    by HTTP status; strict JSON (None, not NaN, where nothing was measured)."""
    records = [
        RequestRecord(INTERACTIVE, 1.0, 2.0, 200, SUCCESS, 100, 10, ttft_s=0.1),
        RequestRecord(INTERACTIVE, 2.0, 3.0, 200, SUCCESS, 100, 10, ttft_s=0.3),
        RequestRecord(INTERACTIVE, 3.0, 4.0, 502, ERROR, 100, 0),
        RequestRecord(BATCH, 1.0, 9.0, 200, SUCCESS, 3000, 200),
        RequestRecord(BATCH, 2.0, 5.0, 200, REVOKED, 3000, 50),
        RequestRecord(BATCH, 3.0, 4.0, 429, REJECTED, 3000, 0),
        RequestRecord(BATCH, 3.0, 4.0, 0, ERROR, 3000, 0),
        RequestRecord(BATCH, 3.0, 4.0, 400, ERROR, 3000, 0),
    ]
    summary = summarize(records)
    assert summary["interactive_success_rate"] == pytest.approx(2 / 3)
    assert summary["interactive_ttft_p50_s"] == pytest.approx(0.2)
    assert summary["interactive_errors_by_status"] == {"502": 1}
    assert summary["batch_completed"] == 2
    assert summary["batch_revoked"] == 1
    assert summary["batch_rejected"] == 1
    assert summary["batch_errors_by_status"] == {"400": 1, "transport": 1}
    assert summary["batch_output_tokens"] == 250
    assert failures(summary) == []
    later = summarize(records, start_s=50.0)
    assert later["interactive_ttft_p95_s"] is None
    json.dumps(later, allow_nan=False)


def test_record_is_strict_json_named_as_the_proxy_names_things() -> None:
    """A record's JSON line has `class` and the proxy's outcome names, and no NaN."""
    line = RequestRecord(BATCH, 1.0, 2.0, 200, REVOKED, 10, 5, finish_reason="preempted")
    data = json.loads(line.to_json())
    assert data["class"] == "batch" and data["outcome"] == "revoked"
    assert data["ttft_s"] is None and "request_class" not in data


@pytest.mark.parametrize(
    ("records", "expected"),
    [([RequestRecord(INTERACTIVE, 1.0, 2.0, 401, ERROR, 10, 0)] * 3,
      ["every interactive request failed (401: 3)"]),
     ([RequestRecord(BATCH, 1.0, 2.0, 0, ERROR, 10, 0),
       RequestRecord(BATCH, 1.0, 2.0, 404, ERROR, 10, 0)],
      ["every batch request failed (404: 1, transport: 1)"]),
     ([RequestRecord(BATCH, 1.0, 2.0, 429, REJECTED, 10, 0)], [])],
    ids=["interactive-all-401", "batch-all-errors", "batch-only-refused"],
)
def test_failures(records: list[RequestRecord], expected: list[str]) -> None:
    """A class whose every request failed fails the run; refusals by the budget do not."""
    assert failures(summarize(records)) == expected


@pytest.mark.parametrize(
    ("text", "ok"),
    [("40:65:3", True), ("40:65", False), ("a:b:c", False)],
    ids=["valid", "two-parts", "not-numbers"],
)
def test_burst_argument(text: str, ok: bool) -> None:
    """--burst takes START:END:MULT and names the argument when malformed."""
    if ok:
        assert parse_burst(text) == (40.0, 65.0, 3.0)
    else:
        with pytest.raises(InputError, match="--burst"):
            parse_burst(text)


@pytest.mark.parametrize(
    "overrides",
    [{"duration_s": 0.0}, {"batch_workers": -1}, {"burst": (20.0, 10.0, 2.0)},
     {"interactive_max_output_tokens": 0}],
    ids=["no-duration", "negative-workers", "burst-backwards", "no-output"],
)
def test_bad_config_is_refused(overrides: dict) -> None:
    """Settings that cannot describe a run raise InputError."""
    with pytest.raises(InputError):
        config(**overrides)
