"""How fast interactive p95s come back under their SLOs after the interactive rate doubles.

Runs `seed` under each policy with a recording wrapper around the metrics source its loop
reads (a loop that only observes, for constant budgets), so the controller's own 5 s
sliding-window p95 TTFT and ITL are kept every tick, and prints, for
the burst: the worst p95/SLO seen, the seconds spent above the SLO, and the time from the
burst's start until both p95s are under their SLOs for good (0 when they never crossed),
and, for scale, how often the same 5 s p95s cross their SLOs away from the burst.

    python3 benchmarks/bench_burst_recovery.py --duration 3600 --policies pi static:71640
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field

from borrowd.controller.closed_loop import SimControllers
from borrowd.models.protocols import Election, MetricsSource, Store, TickLoop
from borrowd.models.signals import Observation, Slo
from borrowd.models.sim.policies import PolicySpec, parse_policy
from borrowd.models.sim.run import calibrate_rate_scale, load_inputs
from borrowd.models.sim.scenario import get_scenario
from borrowd.models.sim.simulation import Simulation


@dataclass
class RecordingSource:
    """A metrics source that keeps every observation it hands out."""

    inner: MetricsSource
    seen: list[Observation] = field(default_factory=list)

    def observe(self, pool: str, now_s: float) -> Observation:
        """Observe through the wrapped source and keep the result."""
        obs = self.inner.observe(pool, now_s)
        self.seen.append(obs)
        return obs


@dataclass
class ObservingLoop:
    """A loop that only observes, once a second (for policies without a control loop)."""

    source: MetricsSource
    pool: str
    tick_s: float = 1.0

    def tick(self, now_s: float) -> Observation:
        """Observe once."""
        return self.source.observe(self.pool, now_s)


def recovery(seen: list[Observation], slo: Slo, start_s: float, end_s: float) -> dict:
    """Worst p95/SLO, seconds above the SLO, and recovery time after `start_s`."""
    worst, above_s, last_above_s = 0.0, 0.0, math.nan
    prev_t = start_s
    for obs in seen:
        if obs.now_s < start_s or obs.now_s > end_s + 60.0:
            continue
        norm = max(_finite(obs.ttft_norm(slo)), _finite(obs.itl_norm(slo)))
        worst = max(worst, norm)
        if norm > 1.0:
            above_s += obs.now_s - prev_t
            last_above_s = obs.now_s
        prev_t = obs.now_s
    back_s = 0.0 if math.isnan(last_above_s) else last_above_s - start_s
    outside = [
        max(_finite(o.ttft_norm(slo)), _finite(o.itl_norm(slo)))
        for o in seen
        if o.now_s < start_s - 60.0 or o.now_s > end_s + 120.0
    ]
    baseline = sum(1 for x in outside if x > 1.0) / max(1, len(outside))
    return {"worst_norm": worst, "above_s": above_s, "back_under_after_s": back_s,
            "above_frac_outside_burst": baseline}


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 0.0


def main() -> None:
    """Print the burst recovery of each policy on `seed`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="seed")
    parser.add_argument("--duration", type=float, default=3600.0)
    parser.add_argument("--policies", nargs="+", default=["pi", "mpc", "slack", "static:71640"])
    args = parser.parse_args()
    scenario = get_scenario(args.scenario)
    trace, lengths = load_inputs(scenario)
    scale = calibrate_rate_scale(scenario, trace, duration_s=args.duration)
    assert scenario.burst is not None
    start_s, end_s = scenario.burst.window_s(args.duration)
    slo = scenario.slo
    print(f"{scenario.name}: burst x{scenario.burst.rate_multiplier:g} "
          f"from {start_s:.0f} s to {end_s:.0f} s; p95s over the controller's sliding window")
    print("| policy | worst p95/SLO in burst | s above SLO | back under SLO after s "
          "| share of ticks above SLO away from the burst |")
    print("|---|---|---|---|---|")
    for name in args.policies:
        spec = parse_policy(name, scenario, None, SimControllers())
        seen: list[Observation] = []

        def loop(source: MetricsSource, store: Store, election: Election,
                 spec: PolicySpec = spec, seen: list[Observation] = seen) -> TickLoop:
            recorder = RecordingSource(source, seen)
            if spec.loop is not None:
                return spec.loop(recorder, store, election)
            return ObservingLoop(recorder, scenario.pool)

        wrapped = dataclasses.replace(spec, loop=loop)
        Simulation(scenario, wrapped, duration_s=args.duration, seed=0, trace=trace,
                   rate_scale=scale, lengths=lengths).run()
        r = recovery(seen, slo, start_s, end_s)
        print(f"| {name} | {r['worst_norm']:.2f} | {r['above_s']:.0f} | "
              f"{r['back_under_after_s']:.0f} | {r['above_frac_outside_burst']:.3f} |")


if __name__ == "__main__":
    main()
