"""Running scenarios: load the inputs, find the interactive rate scale, run a policy.

The rate scale makes interactive work alone keep the fleet busy `interactive_load` of the
time over the run (no burst, no batch): it is found by secant iterations on runs of the
run's length (at most `calibration_s`), from a fixed start, with every iterate snapped to
`CALIBRATION_DIGITS` significant digits and every busy fraction to `BUSY_DECIMALS`
decimals, so the same inputs give a bit-identical scale on every machine whatever ran
before (float noise below the snap cannot move it). It is cached in memory only, keyed by
the trace's content and every scenario field that changes it; no file, timing, process
pool or earlier run can change the figure.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from borrowd.models.errors import InputError
from borrowd.models.sim.conversations import multi_turn
from borrowd.models.sim.cores import DEFAULT_ENGINE
from borrowd.models.sim.policies import ControllerCatalog, parse_policy
from borrowd.models.sim.scenario import MULTI_TURN, Scenario
from borrowd.models.sim.simulation import RunResult, Simulation
from borrowd.models.sim.trace import Lengths, Trace, load_lengths, load_trace, resolve_trace

CALIBRATION_TOLERANCE = 0.004
CALIBRATION_ITERATIONS = 6
CALIBRATION_DIGITS = 6
BUSY_DECIMALS = 9
_memory_cache: dict[str, float] = {}


def load_inputs(scenario: Scenario, trace_path: str | Path | None = None) -> tuple[Trace, Lengths]:
    """The interactive trace (given, or the scenario's, in the scenario's shape) and the batch
    length pool."""
    trace = load_trace(resolve_trace(trace_path or scenario.interactive_trace))
    if scenario.interactive_shape == MULTI_TURN:
        trace = multi_turn(trace)
    lengths = load_lengths(resolve_trace(scenario.batch.lengths_file))
    return trace, lengths


def busy_fraction(scenario: Scenario, trace: Trace, rate_scale: float, engine: str,
                  duration_s: float) -> float:
    """GPU busy fraction of interactive work alone at `rate_scale` (calibration run)."""
    sim = Simulation(
        scenario,
        parse_policy("none", scenario),
        duration_s=duration_s,
        seed=0,
        trace=trace,
        rate_scale=rate_scale,
        engine=engine,
        with_burst=False,
    )
    res = sim.run()
    return res.busy_s / (scenario.replicas * duration_s)


def _snap(value: float) -> float:
    """`value` rounded to `CALIBRATION_DIGITS` significant digits."""
    return float(f"{value:.{CALIBRATION_DIGITS - 1}e}")


def _cache_key(scenario: Scenario, trace: Trace, engine: str, duration_s: float) -> str:
    digest = hashlib.sha256()
    for array in (trace.arrival_s, trace.prompt_tokens, trace.output_tokens):
        digest.update(array.tobytes())
    parts = [
        engine, repr(scenario.profile), str(scenario.replicas),
        str(scenario.max_num_batched_tokens), str(scenario.max_num_seqs),
        str(scenario.block_size), str(scenario.long_prefill_token_threshold), scenario.router,
        str(scenario.enable_prefix_caching), scenario.interactive_shape,
        repr(scenario.interactive_load), repr(duration_s),
    ]
    digest.update("|".join(parts).encode())
    return digest.hexdigest()


def calibrate_rate_scale(scenario: Scenario, trace: Trace, engine: str = DEFAULT_ENGINE,
                         duration_s: float | None = None) -> float:
    """Rate scale at which interactive work alone keeps the fleet `interactive_load` busy
    over a run of `duration_s` (capped at the scenario's `calibration_s`); deterministic."""
    span_s = min(duration_s or scenario.calibration_s, scenario.calibration_s)
    key = _cache_key(scenario, trace, engine, span_s)
    if key in _memory_cache:
        return _memory_cache[key]
    target = scenario.interactive_load

    def busy(k: float) -> float:
        return round(busy_fraction(scenario, trace, k, engine, span_s), BUSY_DECIMALS)

    k0 = 1.0
    b0 = busy(k0)
    k1 = _snap(k0 * target / b0)
    b1 = busy(k1)
    for _ in range(CALIBRATION_ITERATIONS):
        if abs(b1 - target) <= CALIBRATION_TOLERANCE or b1 == b0:
            break
        k2 = k1 + (target - b1) * (k1 - k0) / (b1 - b0)
        k2 = _snap(min(max(k2, k1 / 4), k1 * 4))
        k0, b0 = k1, b1
        k1, b1 = k2, busy(k2)
    _memory_cache[key] = k1
    return k1


def slo_json(scenario: Scenario) -> dict[str, float]:
    """The scenario's SLOs as the JSON reports carry them."""
    slo = scenario.slo
    return {"ttft_p95_s": slo.ttft_p95_s, "itl_p95_s": slo.itl_p95_s,
            "success_rate": slo.success_rate}


def run_scenario(
    scenario: Scenario,
    policy: str,
    *,
    duration_s: float,
    seed: int = 0,
    trace_path: str | Path | None = None,
    rate_scale: float | None = None,
    engine: str = DEFAULT_ENGINE,
    plant_path: Path | None = None,
    controllers: ControllerCatalog | None = None,
) -> RunResult:
    """Run `scenario` under `policy` (closed-loop ones from `controllers`) for `duration_s`
    simulated seconds."""
    if not duration_s > 0:
        raise InputError(f"duration must be > 0 seconds, got {duration_s!r}")
    spec = parse_policy(policy, scenario, plant_path, controllers)
    trace, lengths = load_inputs(scenario, trace_path)
    scale = (
        rate_scale
        if rate_scale is not None
        else calibrate_rate_scale(scenario, trace, engine, duration_s)
    )
    sim = Simulation(
        scenario, spec, duration_s=duration_s, seed=seed, trace=trace, rate_scale=scale,
        lengths=lengths, engine=engine,
    )
    return sim.run()
