"""Tests of trace loading (Azure CSV and JSONL) and of the workloads built from traces."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
from borrowd.models.errors import InputError
from borrowd.models.sim.conversations import multi_turn, shared_prefix_frac
from borrowd.models.sim.scenario import BatchWorkload
from borrowd.models.sim.trace import (
    PACKAGED_TRACES_DIR,
    Trace,
    load_lengths,
    load_trace,
    resolve_trace,
    traces_dir,
)
from borrowd.models.sim.workload import BatchSource, interactive_arrivals

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:48.0000000,10,5
"""

JSONL = """{"timestamp": 1000, "input_length": 374, "output_length": 44}
{"timestamp": 5314.579, "input_length": 396, "output_length": 109}

{"timestamp": 2319.41, "input_length": 10, "output_length": 5}
"""


@pytest.mark.parametrize(("name", "text"), [("t.csv", AZURE), ("t.jsonl", JSONL)],
                         ids=["azure-csv", "jsonl"])
def test_trace_formats_parse_to_relative_sorted_arrivals(tmp_path: Path, name: str,
                                                         text: str) -> None:
    """Both formats give arrivals relative to the first, sorted, with their token lengths."""
    path = tmp_path / name
    path.write_text(text)
    trace = load_trace(path)
    assert trace.arrival_s[0] == 0.0
    assert list(trace.prompt_tokens) == [374, 10, 396]
    assert list(trace.output_tokens) == [44, 5, 109]
    assert trace.arrival_s[1] == pytest.approx(1.31941, abs=1e-3)
    assert trace.arrival_s[2] == pytest.approx(4.314579, abs=1e-3)


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("bad.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,374\n",
         r"bad\.csv:2: expected 3 fields"),
        ("bad.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,3,4\n",
         r"bad\.csv:2: bad TIMESTAMP"),
        ("bad.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,x,4\n",
         r"bad\.csv:2: ContextTokens is not a number"),
        ("bad.csv", "time,in,out\n1,2,3\n", r"bad\.csv:1: expected header"),
        ("bad.jsonl", '{"timestamp": 1, "input_length": 3, "output_length": 4}\n{oops\n',
         r"bad\.jsonl:2: not JSON"),
        ("bad.jsonl", '{"timestamp": 1, "input_length": 3}\n',
         r"bad\.jsonl:1: missing key 'output_length'"),
        ("empty.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n", "holds no requests"),
    ],
    ids=["short-row", "bad-time", "bad-number", "bad-header", "bad-json", "missing-key",
         "empty"],
)
def test_malformed_trace_names_file_and_line(tmp_path: Path, name: str, text: str,
                                             message: str) -> None:
    """A malformed trace raises InputError naming the file and the line."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(InputError, match=message):
        load_trace(path)


def test_missing_trace_is_named(tmp_path: Path) -> None:
    """A missing trace file raises InputError naming the path."""
    with pytest.raises(InputError, match=r"nope\.csv does not exist"):
        load_trace(tmp_path / "nope.csv")


def test_missing_traces_dir_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A $BORROWD_TRACES_DIR that does not exist raises InputError naming the path."""
    monkeypatch.setenv("BORROWD_TRACES_DIR", str(tmp_path / "none"))
    with pytest.raises(InputError, match="none does not exist"):
        traces_dir()


def test_packaged_traces_are_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without $BORROWD_TRACES_DIR, bare names resolve to the compressed packaged traces."""
    monkeypatch.delenv("BORROWD_TRACES_DIR", raising=False)
    assert traces_dir() == PACKAGED_TRACES_DIR
    path = resolve_trace("azure2023_conv.csv")
    assert path == PACKAGED_TRACES_DIR / "azure2023_conv.csv.gz"
    assert path.is_file()


def test_traces_dir_env_overrides(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """$BORROWD_TRACES_DIR wins over the packaged traces, plain or gzip-compressed."""
    (tmp_path / "mine.csv").write_text(AZURE)
    with gzip.open(tmp_path / "packed.csv.gz", "wt") as fh:
        fh.write(AZURE)
    monkeypatch.setenv("BORROWD_TRACES_DIR", str(tmp_path))
    assert resolve_trace("mine.csv") == tmp_path / "mine.csv"
    assert list(load_trace(resolve_trace("packed.csv")).prompt_tokens) == [374, 10, 396]


def test_packaged_traces_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """The packaged chat trace and summarization lengths load in full."""
    monkeypatch.delenv("BORROWD_TRACES_DIR", raising=False)
    trace = load_trace(resolve_trace("azure2023_conv.csv"))
    assert len(trace.arrival_s) == 19366
    assert 3500 < trace.span_s < 3700
    lengths = load_lengths(resolve_trace("arxiv_summarization_lengths.csv"))
    assert len(lengths.prompt_tokens) == 28257


def test_packaged_traces_have_attribution() -> None:
    """The licences and attribution of the packaged traces ship beside them."""
    text = (PACKAGED_TRACES_DIR / "LICENSES.md").read_text()
    assert "Azure Public Dataset" in text
    assert "CC-BY-4.0" in text
    assert "MIT License" in text


def uniform_trace(n: int = 100) -> Trace:
    """A trace with one 100-token request per second."""
    return Trace(Path("uniform"), np.arange(n, dtype=float), np.full(n, 100), np.full(n, 10))


def test_rate_scale_and_burst_shape_arrivals() -> None:
    """Arrivals come rate_scale times faster, and multiplier times faster again in a burst."""
    arr = interactive_arrivals(uniform_trace(), 2.0, 40.0, (10.0, 20.0), 3.0)
    t = arr.arrival_s
    assert np.all(np.diff(t) > 0)
    assert np.count_nonzero(t < 10) == 20
    assert np.count_nonzero((t >= 10) & (t < 20)) == 60
    assert np.count_nonzero(t >= 20) == 40  # wraps around the 100 s trace


def test_trace_repeats_cyclically() -> None:
    """A run longer than the scaled trace repeats it, keeping the mean rate."""
    arr = interactive_arrivals(uniform_trace(), 1.0, 250.0)
    assert len(arr.arrival_s) == 250
    assert np.all(np.diff(arr.arrival_s) > 0)


def test_batch_source_scales_clips_and_requeues() -> None:
    """Batch prompts are scaled and clipped, outputs clipped; returned jobs come back first."""
    lengths = load_lengths(resolve_trace("arxiv_summarization_lengths.csv"))
    spec = BatchWorkload()
    src = BatchSource(lengths, spec, np.random.default_rng(3))
    jobs = [src.next_job() for _ in range(2000)]
    assert max(j.prompt_tokens for j in jobs) <= 32768
    assert max(j.output_tokens for j in jobs) <= 1024
    assert min(j.prompt_tokens for j in jobs) >= 4
    src.push_front(jobs[5])
    assert src.next_job() is jobs[5]


MOONCAKE = """{"timestamp": 0, "input_length": 1100, "output_length": 20, "hash_ids": [0, 1, 2]}
{"timestamp": 500, "input_length": 700, "output_length": 10, "hash_ids": [0, 3]}
{"timestamp": 900, "input_length": 30, "output_length": 5}
"""


def test_mooncake_hash_ids_become_content_segments(tmp_path: Path) -> None:
    """Mooncake `hash_ids` give each prompt 512-token content runs (the last one shorter);
    a request without them has content of its own."""
    path = tmp_path / "mooncake.jsonl"
    path.write_text(MOONCAKE)
    trace = load_trace(path)
    assert trace.segments == (((0, 512), (1, 512), (2, 76)), ((0, 512), (3, 188)), ())


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2, 3]}',
         r"hash_ids has 3 ids for input_length 600 \(at most 2 blocks"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, -2]}',
         r"hash_ids must be a list of integers >= 0"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": "ab"}',
         r"hash_ids must be a list of integers >= 0, got 'ab'"),
    ],
    ids=["too-many", "negative", "not-a-list"],
)
def test_bad_hash_ids_are_named(tmp_path: Path, line: str, message: str) -> None:
    """Bad `hash_ids` raise InputError naming the file, the line and the value."""
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(InputError, match=r"bad\.jsonl:1: " + message):
        load_trace(path)


def test_repeated_trace_content_gets_fresh_ids() -> None:
    """When a run outlasts the trace, its repetition keeps the sharing inside a cycle but
    does not share with the first cycle; generated-token runs keep their id."""
    trace = Trace(Path("t"), np.array([0.0, 1.0]), np.array([600, 700]), np.array([5, 5]),
                  segments=(((3, 512), (4, 88)), ((3, 512), (-1, 5), (5, 183))))
    arr = interactive_arrivals(trace, 1.0, 4.5)
    assert arr.segments is not None
    assert len(arr.segments) == len(arr.arrival_s) == 5
    assert arr.segments[:2] == list(trace.segments)
    assert arr.segments[2] == ((9, 512), (10, 88))
    assert arr.segments[3] == ((9, 512), (-1, 5), (11, 183))


def test_multi_turn_prompts_are_the_conversation_so_far() -> None:
    """Each turn's prompt is an earlier turn's prompt and answer plus its own message; the
    first turns are single messages; arrivals and outputs are unchanged; deterministic."""
    n = 400
    trace = Trace(Path("t"), np.arange(n, dtype=float), np.full(n, 100), np.full(n, 20))
    conv = multi_turn(trace)
    assert conv.segments is not None
    assert np.array_equal(conv.arrival_s, trace.arrival_s)
    assert np.array_equal(conv.output_tokens, trace.output_tokens)
    assert conv.segments[0] == ((0, 100),)
    by_prefix = {segs: i for i, segs in enumerate(conv.segments)}
    continued = 0
    for i, segs in enumerate(conv.segments):
        assert segs[-1] == (i, 100)
        assert conv.prompt_tokens[i] == sum(length for _, length in segs)
        if len(segs) > 1:
            continued += 1
            assert segs[-2] == (-1, 20)
            assert by_prefix[segs[:-2]] < i
    assert 0.6 < continued / n < 0.85
    assert 0.4 < shared_prefix_frac(conv) < 0.95
    assert multi_turn(trace).segments == conv.segments
