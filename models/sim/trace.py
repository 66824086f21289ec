"""Loading request traces: interactive arrivals with token lengths, and batch length pools.

Interactive traces come as the Azure LLM inference CSV (`TIMESTAMP,ContextTokens,
GeneratedTokens`, absolute timestamps) or as JSONL (`timestamp` in ms, `input_length`,
`output_length`, and optionally Mooncake's `hash_ids`: the ids of the prompt's 512-token
blocks, equal ids meaning equal content, which become the requests' content segments for
prefix caching). Arrival times are made relative to the first request. Batch lengths come
from the vidur summarization CSV (`num_prefill_tokens,num_decode_tokens,...`).
A malformed file raises `InputError` naming the file and the line. Any file may be
gzip-compressed (`.gz`).

The default traces ship inside the package, compressed (`models/sim/data/`, licences and
attribution in `models/sim/data/LICENSES.md`); `$BORROWD_TRACES_DIR` names another folder
to read bare trace names from.
"""

from __future__ import annotations

import csv
import gzip
import json
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO

import numpy as np
from borrowd.models.errors import InputError

TRACES_ENV = "BORROWD_TRACES_DIR"
PACKAGED_TRACES_DIR = Path(__file__).resolve().parent / "data"
AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MOONCAKE_BLOCK_TOKENS = 512
Segments = tuple[tuple[int, int], ...]  # (content id, tokens) runs of one prompt
LENGTHS_HEADER = ("num_prefill_tokens", "num_decode_tokens")


@dataclass(frozen=True)
class Trace:
    """Interactive requests of a trace: relative arrival seconds and token lengths."""

    path: Path
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    segments: tuple[Segments, ...] | None = None  # per request, when the trace has content

    @property
    def span_s(self) -> float:
        """Time from the first to the last arrival."""
        return float(self.arrival_s[-1]) if len(self.arrival_s) else 0.0

    @property
    def period_s(self) -> float:
        """Length of one cycle when the trace is repeated: span plus one mean gap."""
        n = len(self.arrival_s)
        return self.span_s + (self.span_s / (n - 1) if n > 1 else 1.0)


@dataclass(frozen=True)
class Lengths:
    """A pool of (prompt, output) token lengths to draw batch requests from."""

    path: Path
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray


def traces_dir() -> Path:
    """Folder bare trace names are read from: $BORROWD_TRACES_DIR, else the packaged traces."""
    env = os.environ.get(TRACES_ENV)
    if not env:
        return PACKAGED_TRACES_DIR
    path = Path(env)
    if not path.is_dir():
        raise InputError(f"traces folder {path} does not exist (set by {TRACES_ENV})")
    return path


def resolve_trace(name_or_path: str | Path) -> Path:
    """A trace path as given if it has a folder part or exists, else inside `traces_dir()`
    (as named, or its `.gz` when only that is there)."""
    path = Path(name_or_path)
    if path.exists() or len(path.parts) > 1:
        return path
    found = traces_dir() / path
    if not found.exists():
        packed = found.with_name(found.name + ".gz")
        if packed.exists():
            return packed
    return found


def _open_text(path: Path) -> IO[str]:
    """A text handle on `path`, decompressing a `.gz` file."""
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return path.open("r", encoding="utf-8", newline="")


def load_trace(path: str | Path) -> Trace:
    """Read an interactive trace, CSV (Azure) or JSONL by its content; sorted by arrival."""
    path = Path(path)
    try:
        with _open_text(path) as fh:
            first = fh.readline()
            fh.seek(0)
            if first.lstrip().startswith("{"):
                rows = _read_jsonl(path, fh)
            else:
                rows = _read_azure_csv(path, fh)
    except FileNotFoundError:
        raise InputError(f"trace file {path} does not exist") from None
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise InputError(f"trace file {path} cannot be read: {exc}") from None
    if not rows:
        raise InputError(f"trace file {path} holds no requests")
    rows.sort(key=lambda r: r[0])
    t = np.array([r[0] for r in rows], dtype=float)
    with_content = any(r[3] for r in rows)
    return Trace(
        path=path,
        arrival_s=t - t[0],
        prompt_tokens=np.array([r[1] for r in rows], dtype=np.int64),
        output_tokens=np.array([r[2] for r in rows], dtype=np.int64),
        segments=tuple(r[3] for r in rows) if with_content else None,
    )


def load_lengths(path: str | Path) -> Lengths:
    """Read a length pool CSV with `num_prefill_tokens,num_decode_tokens` columns."""
    path = Path(path)
    prompts: list[int] = []
    outputs: list[int] = []
    try:
        with _open_text(path) as fh:
            reader = csv.reader(fh)
            header = next(reader, None)
            if header is None or tuple(header[:2]) != LENGTHS_HEADER:
                raise InputError(
                    f"{path}:1: expected header starting {','.join(LENGTHS_HEADER)}, "
                    f"got {','.join(header or [])!r}"
                )
            for lineno, row in enumerate(reader, start=2):
                if not row:
                    continue
                prompts.append(_positive(path, lineno, "num_prefill_tokens", row[0]))
                outputs.append(
                    _positive(path, lineno, "num_decode_tokens", row[1] if len(row) > 1 else "")
                )
    except FileNotFoundError:
        raise InputError(f"lengths file {path} does not exist") from None
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise InputError(f"lengths file {path} cannot be read: {exc}") from None
    if not prompts:
        raise InputError(f"lengths file {path} holds no rows")
    return Lengths(path, np.array(prompts, dtype=np.int64), np.array(outputs, dtype=np.int64))


def _positive(path: Path, lineno: int, name: str, text: str) -> int:
    try:
        value = int(float(text))
    except ValueError:
        raise InputError(f"{path}:{lineno}: {name} is not a number: {text!r}") from None
    if value <= 0:
        raise InputError(f"{path}:{lineno}: {name} must be > 0, got {value}")
    return value


Row = tuple[float, int, int, Segments]


def _read_azure_csv(path: Path, fh: IO[str]) -> list[Row]:
    reader = csv.reader(fh)
    header = next(reader, None)
    no_content: Segments = ()
    if header is None or tuple(h.strip() for h in header[:3]) != AZURE_HEADER:
        raise InputError(
            f"{path}:1: expected header {','.join(AZURE_HEADER)} (or JSONL), got "
            f"{','.join(header or [])!r}"
        )
    rows: list[Row] = []
    for lineno, row in enumerate(reader, start=2):
        if not row:
            continue
        if len(row) < 3:
            raise InputError(f"{path}:{lineno}: expected 3 fields, got {len(row)}")
        try:
            ts = datetime.fromisoformat(row[0].strip()).timestamp()
        except ValueError:
            raise InputError(f"{path}:{lineno}: bad TIMESTAMP {row[0]!r}") from None
        rows.append(
            (
                ts,
                _positive(path, lineno, "ContextTokens", row[1]),
                _positive(path, lineno, "GeneratedTokens", row[2]),
                no_content,
            )
        )
    return rows


def _read_jsonl(path: Path, fh: IO[str]) -> list[Row]:
    rows: list[Row] = []
    for lineno, line in enumerate(fh, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise InputError(f"{path}:{lineno}: not JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise InputError(f"{path}:{lineno}: expected a JSON object")
        for key in ("timestamp", "input_length", "output_length"):
            if key not in obj:
                raise InputError(f"{path}:{lineno}: missing key {key!r}")
        try:
            ts_ms = float(obj["timestamp"])
        except (TypeError, ValueError):
            raise InputError(f"{path}:{lineno}: bad timestamp {obj['timestamp']!r}") from None
        prompt = _positive(path, lineno, "input_length", str(obj["input_length"]))
        segments = _hash_segments(path, lineno, obj.get("hash_ids"), prompt)
        rows.append(
            (
                ts_ms / 1000.0,
                prompt,
                _positive(path, lineno, "output_length", str(obj["output_length"])),
                segments,
            )
        )
    return rows


def _hash_segments(path: Path, lineno: int, hash_ids: object, prompt: int) -> Segments:
    """Mooncake `hash_ids` as content segments of 512 tokens (the last one shorter)."""
    if hash_ids is None:
        return ()
    blocks = -(-prompt // MOONCAKE_BLOCK_TOKENS)
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids
    ):
        raise InputError(f"{path}:{lineno}: hash_ids must be a list of integers >= 0, "
                         f"got {hash_ids!r}")
    if len(hash_ids) > blocks:
        raise InputError(f"{path}:{lineno}: hash_ids has {len(hash_ids)} ids for "
                         f"input_length {prompt} (at most {blocks} blocks of "
                         f"{MOONCAKE_BLOCK_TOKENS} tokens)")
    return tuple(
        (h, min(MOONCAKE_BLOCK_TOKENS, prompt - k * MOONCAKE_BLOCK_TOKENS))
        for k, h in enumerate(hash_ids)
    )
