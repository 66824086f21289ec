"""Simulation scenarios as frozen dataclasses (`seed` and its variants, DESIGN.md).

A scenario fixes the fleet (replicas, profile, engine settings, router), the interactive
workload (trace, target load, burst), the batch workload (backlog or fixed rate), optional
replica failures, the SLO and how the batch budget is enforced (`enforcement`). Times that
depend on the run length (burst, failure) are given as fractions of the duration so that a
20-minute and a one-hour run both contain them. Scenarios are written as TOML files
(`models.sim.scenario_file`); the built-in ones are such files, `SEED` is their defaults.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from models.errors import InputError
from models.priority import BATCH_PRIORITY
from models.signals import Slo
from models.sim.profiles import DEFAULT_PROFILE

ROUND_ROBIN = "round-robin"
LEAST_TOKENS = "least-tokens"
ROUTERS = (ROUND_ROBIN, LEAST_TOKENS)

ADMISSION = "admission"  # batch budget enforced by the admission gate only
ENGINE = "engine"  # the gate plus the engine plugin's per-step batch token limit
ENFORCEMENTS = (ADMISSION, ENGINE)

BACKLOG = "backlog"
RATE = "rate"

TRACE_SHAPE = "trace"  # interactive requests replayed as the trace has them
MULTI_TURN = "multi-turn"  # each turn's prompt is its conversation so far (shared prefixes)
INTERACTIVE_SHAPES = (TRACE_SHAPE, MULTI_TURN)


@dataclass(frozen=True)
class Burst:
    """Interactive rate multiplied by `rate_multiplier` for `duration_s`, centred in the run."""

    duration_s: float = 120.0
    rate_multiplier: float = 2.0
    centre_frac: float = 0.5

    def window_s(self, run_s: float) -> tuple[float, float]:
        """(start, end) of the burst in a run of `run_s` seconds."""
        start = max(0.0, self.centre_frac * run_s - self.duration_s / 2)
        return start, min(run_s, start + self.duration_s)


@dataclass(frozen=True)
class Failure:
    """Replica `replica` is down from `start_frac` of the run for `duration_s` seconds."""

    replica: int = 0
    start_frac: float = 0.25
    duration_s: float = 300.0

    def window_s(self, run_s: float) -> tuple[float, float]:
        """(start, end) of the outage in a run of `run_s` seconds."""
        start = self.start_frac * run_s
        return start, start + self.duration_s


@dataclass(frozen=True)
class BatchWorkload:
    """Batch class: an always-full backlog (or a fixed submission rate) of summarization jobs.

    Prompt tokens = trace prompt x `prompt_scale` clipped to `prompt_clip_tokens`; output
    tokens = trace output clipped to `output_clip_tokens`. The batch client keeps at most
    `client_concurrency` requests in flight over the fleet.
    """

    mode: str = BACKLOG
    lengths_file: str = "arxiv_summarization_lengths.csv"
    prompt_scale: int = 4
    prompt_clip_tokens: int = 32768
    output_clip_tokens: int = 1024
    submit_rate_per_s: float = 0.0
    client_concurrency: int = 256
    priority: int = BATCH_PRIORITY


@dataclass(frozen=True)
class Scenario:
    """Everything a simulation run needs apart from the policy, duration and seed."""

    name: str
    pool: str = "seed"
    replicas: int = 4
    profile: str = DEFAULT_PROFILE
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    block_size: int = 16
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    router: str = LEAST_TOKENS
    interactive_trace: str = "azure2023_conv.csv"
    interactive_load: float = 0.40
    interactive_priority: int = 0
    interactive_shape: str = TRACE_SHAPE
    burst: Burst | None = field(default_factory=Burst)
    batch: BatchWorkload = field(default_factory=BatchWorkload)
    failure: Failure | None = None
    slo: Slo = field(default_factory=Slo)
    ttft_timeout_s: float = 30.0
    window_s: float = 60.0
    observe_window_s: float = 5.0
    calibration_s: float = 3600.0
    enforcement: str = ADMISSION

    def __post_init__(self) -> None:
        if self.replicas <= 0:
            raise InputError(f"scenario {self.name}: replicas must be > 0")
        if self.router not in ROUTERS:
            raise InputError(f"scenario {self.name}: router must be one of {ROUTERS}")
        if not 0 < self.interactive_load < 1:
            raise InputError(
                f"interactive load must be in (0, 1), got {self.interactive_load!r}"
            )
        if self.enforcement not in ENFORCEMENTS:
            raise InputError(
                f"enforcement must be one of {', '.join(ENFORCEMENTS)}, got {self.enforcement!r}"
            )
        if self.failure is not None and not 0 <= self.failure.replica < self.replicas:
            raise InputError(
                f"failure.replica must be < replicas ({self.replicas}), "
                f"got {self.failure.replica}"
            )
        if self.interactive_shape not in INTERACTIVE_SHAPES:
            raise InputError(
                f"interactive shape must be one of {', '.join(INTERACTIVE_SHAPES)}, "
                f"got {self.interactive_shape!r}"
            )

    def with_overrides(self, **changes: object) -> Scenario:
        """A copy with some fields replaced (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


SEED = Scenario(name="seed")
SEED_FAILURE = Scenario(name="seed-failure", failure=Failure())


def get_scenario(name_or_path: str) -> Scenario:
    """A built-in scenario by name (its file in `models/sim/data/scenarios/`), or a scenario
    TOML file by path; `InputError` naming the known ones otherwise."""
    from models.sim.scenario_file import get_scenario as from_file

    return from_file(name_or_path)
