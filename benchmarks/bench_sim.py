"""Simulator speed: simulated seconds per wall second of the `seed` scenario, per policy.

Runs each policy once, one after another on one core (no process pool), after the
interactive rate scale is calibrated (cached), and prints the wall time, the speed and the
run's headline figures. The target is 100x real time or faster for one simulated hour.

    python3 benchmarks/bench_sim.py [--duration 3600] [--policies none priority ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from borrowd.controller.closed_loop import SimControllers
from borrowd.models.sim.run import calibrate_rate_scale, load_inputs, run_scenario
from borrowd.models.sim.scenario import get_scenario

DEFAULT_POLICIES = ["none", "unrestricted", "priority", "static:40000"]


def main() -> int:
    """Run the policies and print one line of speed figures per policy."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="seed")
    parser.add_argument("--duration", type=float, default=3600.0, help="simulated seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", nargs="+")
    args = parser.parse_args()
    scenario = get_scenario(args.scenario)
    policies = args.policies or [*DEFAULT_POLICIES, "pi", "slack"]
    trace, _ = load_inputs(scenario)
    t0 = time.perf_counter()
    scale = calibrate_rate_scale(scenario, trace, duration_s=args.duration)
    print(f"scenario {scenario.name}: {scenario.replicas} replicas, {args.duration:g} s "
          f"simulated; rate scale {scale:.4f} (calibration {time.perf_counter() - t0:.1f} s, "
          "cached after the first time)")
    print(f"{'policy':<16} {'wall s':>8} {'sim s / wall s':>15} {'busy':>6} "
          f"{'batch tok/s':>12} {'slo win':>8}")
    for policy in policies:
        t = time.perf_counter()
        res = run_scenario(scenario, policy, duration_s=args.duration, seed=args.seed,
                           rate_scale=scale, controllers=SimControllers())
        wall = time.perf_counter() - t
        s = res.summary()
        print(f"{policy:<16} {wall:>8.1f} {args.duration / wall:>15.0f} "
              f"{s['gpu_busy_frac']:>6.3f} {s['batch']['tokens_per_s']:>12.0f} "
              f"{s['interactive']['slo_windows_met_frac']:>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
