"""Running scenarios: load the inputs, find the interactive rate scale, run a policy.

The rate scale makes interactive work alone keep the fleet busy `interactive_load` of the
time over the run (no burst, no batch): it is found by secant iterations on runs of the
run's length (at most `calibration_s`) and cached in memory and on disk
($BORROWD_CACHE_DIR, else ~/.cache/borrowd), keyed by everything that changes it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from models.errors import InputError
from models.sim.cores import DEFAULT_ENGINE
from models.sim.policies import ControllerCatalog, parse_policy
from models.sim.scenario import Scenario
from models.sim.simulation import RunResult, Simulation
from models.sim.trace import Lengths, Trace, load_lengths, load_trace, resolve_trace

CACHE_ENV = "BORROWD_CACHE_DIR"
CALIBRATION_TOLERANCE = 0.004
CALIBRATION_ITERATIONS = 6
_memory_cache: dict[str, float] = {}


def load_inputs(scenario: Scenario, trace_path: str | Path | None = None) -> tuple[Trace, Lengths]:
    """The interactive trace (given, or the scenario's) and the batch length pool."""
    trace = load_trace(resolve_trace(trace_path or scenario.interactive_trace))
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


def _cache_key(scenario: Scenario, trace: Trace, engine: str, duration_s: float) -> str:
    stat = trace.path.stat()
    parts = [
        str(trace.path.resolve()), str(stat.st_size), str(int(stat.st_mtime)), engine,
        scenario.profile, str(scenario.replicas), str(scenario.max_num_batched_tokens),
        str(scenario.max_num_seqs), str(scenario.block_size),
        str(scenario.long_prefill_token_threshold), scenario.router,
        str(scenario.interactive_load), str(duration_s), "v2",
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def _cache_file() -> Path:
    base = os.environ.get(CACHE_ENV)
    root = Path(base) if base else Path.home() / ".cache" / "borrowd"
    return root / "rate_scale.json"


def _read_disk_cache() -> dict[str, float]:
    try:
        data = json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_disk_cache(key: str, value: float) -> None:
    path = _cache_file()
    try:
        data = _read_disk_cache()
        data[key] = value
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        return  # a read-only home only costs a recalibration next time


def calibrate_rate_scale(scenario: Scenario, trace: Trace, engine: str = DEFAULT_ENGINE,
                         duration_s: float | None = None) -> float:
    """Rate scale at which interactive work alone keeps the fleet `interactive_load` busy
    over a run of `duration_s` (capped at the scenario's `calibration_s`)."""
    span_s = min(duration_s or scenario.calibration_s, scenario.calibration_s)
    key = _cache_key(scenario, trace, engine, span_s)
    if key in _memory_cache:
        return _memory_cache[key]
    disk = _read_disk_cache().get(key)
    if isinstance(disk, float):
        _memory_cache[key] = disk
        return disk
    target = scenario.interactive_load
    k0 = 1.0
    b0 = busy_fraction(scenario, trace, k0, engine, span_s)
    k1 = k0 * target / b0
    b1 = busy_fraction(scenario, trace, k1, engine, span_s)
    for _ in range(CALIBRATION_ITERATIONS):
        if abs(b1 - target) <= CALIBRATION_TOLERANCE or b1 == b0:
            break
        k2 = k1 + (target - b1) * (k1 - k0) / (b1 - b0)
        k2 = min(max(k2, k1 / 4), k1 * 4)
        k0, b0 = k1, b1
        k1, b1 = k2, busy_fraction(scenario, trace, k2, engine, span_s)
    _memory_cache[key] = k1
    _write_disk_cache(key, k1)
    return k1


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
