"""Interference attributed to batch inside one engine, exported as Prometheus series.

Per engine step an engine (the emulator, or vLLM under the scheduler plugin) counts what the
simulator counts (`models/sim/simulation.py`), split by whether the step carried batch tokens:

    borrowd_engine_interactive_itl_seconds{batch_step}       interactive inter-token gaps,
        each in the step that produced its token (vLLM's inter-token buckets, plus a bound
        at each ITL SLO of the pool, so the daemon reads the gaps above its SLO exactly)
    borrowd_engine_interactive_wait_seconds_total{batch_step} interactive request-seconds
        spent queued or mid-prefill: waiting requests x step time

`batch_step` is "true" or "false"; both children exist from the start, so a pool whose
engines never ran batch reads a share of 0, not a missing series. The recording rules in
`deploy/prometheus/borrowd.rules.yml` turn them into shares for dashboards; the daemon reads
the gap share at the pool's own ITL SLO (`controller.prom_source`).
`StepAttribution` derives the gaps and the wait for an engine that only says which requests
got a token in a step (vLLM's scheduler, in the engine plugin).
"""

from __future__ import annotations

import math
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass

from borrowd.adapters.proxy.buckets import ITL_BUCKETS_S, with_slo_bounds
from borrowd.models.enforcement import MAX_STEP_S
from prometheus_client import CollectorRegistry, Counter, Histogram

ITL_METRIC = "borrowd_engine_interactive_itl_seconds"
WAIT_METRIC = "borrowd_engine_interactive_wait_seconds"
STEP_LABEL = "batch_step"


class InterferenceMetrics:
    """The two interference series of one engine, children bound to (model_name, engine);
    the gap histogram has a bound at each of `slo_itl_s` (the pool's ITL SLOs, seconds)
    besides vLLM's."""

    def __init__(self, registry: CollectorRegistry, model_name: str, engine: str,
                 slo_itl_s: Sequence[float] = ()) -> None:
        labels = ["model_name", "engine", STEP_LABEL]
        itl = Histogram(
            ITL_METRIC,
            "Interactive inter-token gaps, by whether the step that produced the token "
            "carried batch tokens.",
            labels, registry=registry, buckets=with_slo_bounds(ITL_BUCKETS_S, slo_itl_s),
        )
        wait = Counter(
            WAIT_METRIC,
            "Interactive request-seconds spent queued or mid-prefill, by whether the step "
            "carried batch tokens.",
            labels, registry=registry,
        )
        self._itl = {flag: itl.labels(model_name, engine, _flag(flag)) for flag in (True, False)}
        self._wait = {flag: wait.labels(model_name, engine, _flag(flag)) for flag in (True, False)}

    def step(self, *, carried_batch: bool, itl_gaps_s: Iterable[float],
             interactive_waiting: int, step_s: float) -> None:
        """Count one finished step: the interactive gaps it ended and the wait it held."""
        histogram = self._itl[carried_batch]
        for gap_s in itl_gaps_s:
            histogram.observe(max(0.0, gap_s))
        if interactive_waiting > 0 and step_s > 0:
            self._wait[carried_batch].inc(interactive_waiting * step_s)


@dataclass(frozen=True, slots=True)
class StepRequest:
    """One request scheduled in a finished step: its class and what the step did for it
    (`emitted`: the step produced an output token; `prefilling`: its prompt is not done)."""

    request_id: str
    batch: bool
    emitted: bool
    prefilling: bool


class StepAttribution:
    """Per-step gaps and wait of interactive requests, from which requests got a token.

    A gap is the time from a request's previous token to the end of the step that produced
    the next one (the first token opens no gap). The wait is (interactive requests queued +
    interactive requests scheduled but still in prefill) x the step's time, the time since
    the previous step ended (at most `MAX_STEP_S`; the first step counts `first_step_s`).
    """

    def __init__(self, metrics: InterferenceMetrics, first_step_s: float) -> None:
        self.metrics = metrics
        self.first_step_s = first_step_s
        self._last_token_s: dict[str, float] = {}
        self._last_end_s = math.nan

    def finished(self, now_s: float, requests: Iterable[StepRequest], interactive_queued: int,
                 live: Container[str]) -> None:
        """Count the step that ended at `now_s`; forget requests no longer in `live`."""
        step_s = now_s - self._last_end_s if math.isfinite(self._last_end_s) else self.first_step_s
        self._last_end_s = now_s
        carried_batch = False
        gaps_s: list[float] = []
        waiting = interactive_queued
        last_token_s = self._last_token_s
        for req in requests:
            if req.batch:
                carried_batch = True
            elif req.emitted:
                previous_s = last_token_s.get(req.request_id)
                if previous_s is not None:
                    gaps_s.append(now_s - previous_s)
                last_token_s[req.request_id] = now_s
            elif req.prefilling:
                waiting += 1
        self.metrics.step(carried_batch=carried_batch, itl_gaps_s=gaps_s,
                          interactive_waiting=waiting, step_s=min(max(step_s, 0.0), MAX_STEP_S))
        for request_id in [rid for rid in last_token_s if rid not in live]:
            del last_token_s[request_id]


def _flag(carried_batch: bool) -> str:
    return "true" if carried_batch else "false"
