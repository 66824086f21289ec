"""Traffic shapes for the robustness matrix: transforms of a real trace into other traffic.

A shape takes an interactive trace (the Azure chat trace by default) and changes it:
token lengths scaled and clipped (long-context chat, short prompts, code completion with a
handful of output tokens), and the arrival rate warped over the run (multi-hour diurnal
swings, heavy bursts) while the mean rate stays that of the calibrated load:

    m(t) = (1 + a sin(2 pi t / P)) * prod_bursts (k_b inside burst b),   normalised to mean 1
    a = (r - 1) / (r + 1)     for a peak-to-trough ratio r
    t' = L^-1(t),  L(t) = integral_0^t m(s) ds      (arrivals of a constant-rate replay)

The fleet side (replicas, a replica failure) and the SLO set ride on the shape too. All
functions here are pure; writing a shape's trace file is the caller's (`write_jsonl`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from borrowd.models.errors import InputError
from borrowd.models.sim.trace import Trace

TUNE = "tune"
HELD_OUT = "held-out"
SPLITS = (TUNE, HELD_OUT)

SLO_SEED = "seed"  # p95 TTFT 1 s, p95 ITL 50 ms, success 99%
SLO_RELAXED = "relaxed"  # p95 TTFT 2 s, p95 ITL 100 ms
SLO_MARGIN = "margin"  # each p95 = 1.25 x its worst 60 s window without borrowing
SLO_SETS = (SLO_SEED, SLO_RELAXED, SLO_MARGIN)
MARGIN = 1.25
WARP_GRID_S = 1.0


@dataclass(frozen=True)
class LengthTransform:
    """Token lengths of every request: scaled, rounded, then clipped to [min, clip]."""

    prompt_scale: float = 1.0
    output_scale: float = 1.0
    prompt_min_tokens: int = 1
    prompt_clip_tokens: int = 32768
    output_min_tokens: int = 1
    output_clip_tokens: int = 4096


@dataclass(frozen=True)
class BurstSpec:
    """The rate multiplied by `multiplier` for `duration_s` from `start_frac` of the run,
    repeated every `every_frac` of the run when that is > 0."""

    start_frac: float
    duration_s: float
    multiplier: float
    every_frac: float = 0.0


@dataclass(frozen=True)
class RateProfile:
    """How the arrival rate moves over a run (mean kept): a sinusoidal swing over
    `period_frac` of the run with peak/trough `peak_to_trough`, and bursts."""

    period_frac: float = 0.0
    peak_to_trough: float = 1.0
    phase_frac: float = 0.75  # starts at the trough, peaks half a period later
    bursts: tuple[BurstSpec, ...] = ()

    @property
    def flat(self) -> bool:
        """True when the rate does not move."""
        return (self.period_frac <= 0 or self.peak_to_trough == 1.0) and not self.bursts


@dataclass(frozen=True)
class FailureSpec:
    """Replica `replica` down from `start_frac` of the run for `duration_frac` of it."""

    replica: int
    start_frac: float
    duration_frac: float


@dataclass(frozen=True)
class Shape:
    """One row group of the matrix: traffic, fleet, failure, SLO set, and its split."""

    name: str
    split: str
    help: str
    lengths: LengthTransform = field(default_factory=LengthTransform)
    rate: RateProfile = field(default_factory=RateProfile)
    interactive_load: float = 0.40
    replicas: int = 4
    failure: FailureSpec | None = None
    slo_set: str = SLO_MARGIN
    trace: str = "azure2023_conv.csv"

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise InputError(f"shape {self.name}: split must be one of {SPLITS}")
        if self.slo_set not in SLO_SETS:
            raise InputError(f"shape {self.name}: SLO set must be one of {SLO_SETS}")


def transform_lengths(trace: Trace, lt: LengthTransform, path: Path) -> Trace:
    """`trace` with its token lengths scaled and clipped (arrivals unchanged), at `path`."""
    prompts = np.clip(
        np.rint(trace.prompt_tokens * lt.prompt_scale), lt.prompt_min_tokens, lt.prompt_clip_tokens
    ).astype(np.int64)
    outputs = np.clip(
        np.rint(trace.output_tokens * lt.output_scale), lt.output_min_tokens, lt.output_clip_tokens
    ).astype(np.int64)
    return Trace(path=path, arrival_s=trace.arrival_s, prompt_tokens=prompts,
                 output_tokens=outputs)


def rate_multiplier(t_s: np.ndarray, profile: RateProfile, duration_s: float) -> np.ndarray:
    """m(t) of the module docstring at times `t_s` of a run of `duration_s` (mean 1 over
    the run, evaluated on a grid of `WARP_GRID_S`)."""
    grid = np.arange(0.0, duration_s + WARP_GRID_S, WARP_GRID_S)
    raw = _raw_multiplier(grid, profile, duration_s)
    return np.interp(t_s, grid, raw) / float(np.mean(raw))


def _raw_multiplier(t_s: np.ndarray, profile: RateProfile, duration_s: float) -> np.ndarray:
    m = np.ones_like(t_s, dtype=float)
    if profile.period_frac > 0 and profile.peak_to_trough != 1.0:
        r = profile.peak_to_trough
        amp = (r - 1.0) / (r + 1.0)
        period_s = profile.period_frac * duration_s
        m = m * (1.0 + amp * np.sin(2 * np.pi * (t_s / period_s + profile.phase_frac)))
    for burst in profile.bursts:
        for start_s in burst_starts_s(burst, duration_s):
            inside = (t_s >= start_s) & (t_s < start_s + burst.duration_s)
            m = np.where(inside, m * burst.multiplier, m)
    return m


def burst_starts_s(burst: BurstSpec, duration_s: float) -> list[float]:
    """Start times of a (repeated) burst within a run of `duration_s`."""
    first = burst.start_frac * duration_s
    if burst.every_frac <= 0:
        return [first] if first < duration_s else []
    step = burst.every_frac * duration_s
    return [float(s) for s in np.arange(first, duration_s, step)]


def warp_arrivals(arrival_s: np.ndarray, profile: RateProfile, duration_s: float) -> np.ndarray:
    """Arrival times of a constant-rate replay moved so that the rate follows m(t).

    t' = L^-1(t) with L the integral of m (module docstring); L(duration) = duration, so
    the run keeps its requests and its mean rate.
    """
    if profile.flat:
        return np.asarray(arrival_s, dtype=float)
    grid = np.arange(0.0, duration_s + WARP_GRID_S, WARP_GRID_S)
    m = rate_multiplier(grid, profile, duration_s)
    cum = np.concatenate([[0.0], np.cumsum(0.5 * (m[1:] + m[:-1]) * np.diff(grid))])
    cum *= duration_s / cum[-1] if cum[-1] > 0 else 1.0
    return np.interp(arrival_s, cum, grid)


def margin_slo(window_p95s_s: list[float | None]) -> float:
    """An SLO 25% above the worst of some windows' p95s (NaN/None ignored)."""
    values = [v for v in window_p95s_s if v is not None and np.isfinite(v)]
    if not values:
        raise InputError("no window measured a p95 to set a margin SLO from")
    return MARGIN * max(values)


def trace_digest(trace: Trace, extra: str) -> str:
    """A short digest of a trace's contents and `extra` (names a derived trace file)."""
    h = hashlib.sha256(extra.encode())
    for arr in (trace.arrival_s, trace.prompt_tokens, trace.output_tokens):
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()[:16]


def write_jsonl(path: Path, arrival_s: np.ndarray, prompt_tokens: np.ndarray,
                output_tokens: np.ndarray) -> None:
    """Write a trace as JSONL (`timestamp` ms, `input_length`, `output_length`), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{path.suffix}.tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for t, p, o in zip(arrival_s.tolist(), prompt_tokens.tolist(), output_tokens.tolist(),
                           strict=True):
            fh.write(json.dumps({"timestamp": round(t * 1000.0, 3), "input_length": int(p),
                                 "output_length": int(o)}) + "\n")
    tmp.replace(path)


# Fixed split: the controller is tuned on TUNE shapes only; HELD_OUT shapes are reported
# apart and never looked at while tuning.
SHAPES: tuple[Shape, ...] = (
    Shape("chat", TUNE, "the Azure chat trace at 40% load, seed SLOs (seed without its burst)",
          slo_set=SLO_SEED),
    Shape("chat-margin", TUNE, "the Azure chat trace at 40% load, margin SLOs"),
    Shape("short-fast", TUNE,
          "short prompts (1/8, at least 16 tokens), short answers, at a high rate, margin SLOs",
          LengthTransform(prompt_scale=0.125, prompt_min_tokens=16, output_scale=0.5)),
    Shape("code", TUNE,
          "code completion: prompts x2, at most 16 output tokens, steady rate, margin SLOs",
          LengthTransform(prompt_scale=2.0, output_clip_tokens=16)),
    Shape("chat-2x-failure", TUNE,
          "two replicas, chat at 40%, one replica down for a fifth of the run, relaxed SLOs",
          replicas=2, failure=FailureSpec(1, 0.4, 0.2),
          slo_set=SLO_RELAXED),
    Shape("long-context", HELD_OUT,
          "long-context chat: prompts x6 (~7k tokens), low request rate, margin SLOs",
          LengthTransform(prompt_scale=6.0), interactive_load=0.30),
    Shape("bursty", HELD_OUT,
          "chat with heavy bursts: 4x the rate for 60 s every sixth of the run, margin SLOs",
          rate=RateProfile(bursts=(BurstSpec(0.1, 60.0, 4.0, 1 / 6),))),
    Shape("code-bursty", HELD_OUT,
          "code completion: prompts x2, at most 16 output tokens, 3x bursts of 90 s, margin SLOs",
          LengthTransform(prompt_scale=2.0, output_clip_tokens=16),
          rate=RateProfile(bursts=(BurstSpec(0.15, 90.0, 3.0, 0.25),))),
    Shape("diurnal", HELD_OUT,
          "chat with a 4x swing over the run (trough, peak, trough), margin SLOs",
          rate=RateProfile(period_frac=1.0, peak_to_trough=4.0)),
    Shape("failure-8x", HELD_OUT,
          "eight replicas, chat at 40%, two swings of 2x, one replica down for a fifth of the "
          "run, seed SLOs",
          rate=RateProfile(period_frac=0.5, peak_to_trough=2.0), replicas=8,
          failure=FailureSpec(3, 0.5, 0.2), slo_set=SLO_SEED),
)


def get_shape(name: str) -> Shape:
    """The shape called `name`; `InputError` naming the known ones otherwise."""
    for shape in SHAPES:
        if shape.name == name:
            return shape
    raise InputError(f"unknown shape {name!r} (known: {', '.join(s.name for s in SHAPES)})")
