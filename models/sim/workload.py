"""Workloads: interactive arrivals replayed from a trace at a scaled rate, and batch jobs.

Interactive: the trace's arrival times are compressed by `rate_scale` (2.0 = twice the
trace's rate), repeated cyclically when the run outlasts the scaled trace, and compressed a
further `multiplier` times inside a burst window; the trace's order and gaps keep their
shape. Content segments (prefix caching) repeat with the trace, their ids moved to a fresh
range in each repetition so that a repeated request does not find its first copy cached.
Batch: jobs drawn with a seeded generator from a length pool, prompt scaled and
clipped; revoked jobs go back to the head of the backlog.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
from borrowd.models.sim.prefix_cache import OUTPUT_ID
from borrowd.models.sim.scenario import BatchWorkload
from borrowd.models.sim.trace import Lengths, Segments, Trace


@dataclass(frozen=True)
class Arrivals:
    """Interactive requests of one run in simulation time (seconds from the start)."""

    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    segments: list[Segments] | None = None  # per request, when the trace has content


def interactive_arrivals(
    trace: Trace,
    rate_scale: float,
    duration_s: float,
    burst_s: tuple[float, float] | None = None,
    multiplier: float = 1.0,
) -> Arrivals:
    """Arrivals in [0, duration_s) from `trace` run `rate_scale` times faster, with a burst.

    Trace time advances at `rate_scale` per simulated second, and at
    `rate_scale * multiplier` inside `burst_s`; trace time is wrapped cyclically.
    """
    k = rate_scale
    b0, b1 = burst_s if burst_s is not None else (duration_s, duration_s)
    m = multiplier if burst_s is not None else 1.0

    def trace_time(t: float) -> float:
        overlap = max(0.0, min(t, b1) - b0)
        return k * t + k * (m - 1.0) * overlap

    tau_end = trace_time(duration_s)
    period = trace.period_s
    cycles = int(tau_end // period) + 1
    offsets = np.repeat(np.arange(cycles) * period, len(trace.arrival_s))
    tau = np.tile(trace.arrival_s, cycles) + offsets
    keep = tau < tau_end
    tau = tau[keep]
    tau_b0 = k * b0
    tau_b1 = tau_b0 + k * m * (b1 - b0)
    t = np.where(
        tau <= tau_b0,
        tau / k,
        np.where(tau <= tau_b1, b0 + (tau - tau_b0) / (k * m), b1 + (tau - tau_b1) / k),
    )
    return Arrivals(
        arrival_s=t,
        prompt_tokens=np.tile(trace.prompt_tokens, cycles)[keep],
        output_tokens=np.tile(trace.output_tokens, cycles)[keep],
        segments=_repeat_segments(trace.segments, int(keep.sum())),
    )


def _repeat_segments(segments: tuple[Segments, ...] | None, count: int) -> list[Segments] | None:
    """The first `count` requests' segments over repeated cycles, ids shifted per cycle."""
    if segments is None:
        return None
    n = len(segments)
    stride = 1 + max((cid for segs in segments for cid, _ in segs), default=0)
    out: list[Segments] = []
    for i in range(count):
        shift = (i // n) * stride
        segs = segments[i % n]
        out.append(segs if shift == 0 else tuple(
            (cid + shift if cid != OUTPUT_ID else cid, length) for cid, length in segs
        ))
    return out


class BatchJob:
    """One batch job across attempts: original sizes, output generated, work recomputed."""

    __slots__ = (
        "attempts",
        "generated_tokens",
        "job_id",
        "output_tokens",
        "prompt_tokens",
        "recomputed_tokens",
    )

    def __init__(self, job_id: int, prompt_tokens: int, output_tokens: int) -> None:
        self.job_id = job_id
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.generated_tokens = 0
        self.recomputed_tokens = 0
        self.attempts = 0

    @property
    def remaining_output_tokens(self) -> int:
        """Output tokens still to generate."""
        return self.output_tokens - self.generated_tokens


class BatchSource:
    """An endless backlog of batch jobs; revoked jobs are served again first."""

    def __init__(self, lengths: Lengths, spec: BatchWorkload, rng: np.random.Generator) -> None:
        self._prompts = np.minimum(
            lengths.prompt_tokens * spec.prompt_scale, spec.prompt_clip_tokens
        ).tolist()
        self._outputs = np.minimum(lengths.output_tokens, spec.output_clip_tokens).tolist()
        self._rng = rng
        self._draws: list[int] = []
        self._front: deque[BatchJob] = deque()
        self._next_id = 0

    def next_job(self) -> BatchJob:
        """The next job: a returned one if any, else a fresh draw from the length pool."""
        if self._front:
            return self._front.popleft()
        if not self._draws:
            self._draws = self._rng.integers(0, len(self._prompts), size=4096).tolist()[::-1]
        i = self._draws.pop()
        job = BatchJob(self._next_id, self._prompts[i], self._outputs[i])
        self._next_id += 1
        return job

    def push_front(self, job: BatchJob) -> None:
        """Put a revoked job back at the head of the backlog."""
        self._front.appendleft(job)

    def peek_cost(self) -> tuple[int, int]:
        """(prompt, remaining output) tokens of the job `next_job()` would return."""
        job = self.next_job()
        self._front.appendleft(job)
        return job.prompt_tokens + job.generated_tokens, job.remaining_output_tokens
