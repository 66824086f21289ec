"""Controller tick time: law + supervisor + caps, for PI, MPC and the slack law.

Feeds each policy a stream of synthetic observations around the seed operating point (with
noise, a few NaN windows and a burst) and prints the mean, p50, p99 and max tick in ms.
Targets (issue 7): under 5 ms for PI, under 20 ms for MPC.

    python3 benchmarks/bench_controller.py [--ticks N]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from borrowd.controller.policy import ControllerConfig, build_policy
from borrowd.models.plant.model import PlantModel
from borrowd.models.signals import Observation

PLANT = Path(__file__).resolve().parents[1] / "controller" / "plants" / "seed.json"


def observations(ticks: int, seed: int) -> list[Observation]:
    """Synthetic seed-like signals: noisy p95s, a burst in the middle, some empty windows."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(ticks):
        burst = 2.0 if ticks // 3 <= k < ticks // 3 + 120 else 1.0
        empty = rng.random() < 0.05
        out.append(
            Observation(
                now_s=float(k),
                age_s=0.5,
                ttft_p95_s=float("nan") if empty else float(rng.uniform(0.02, 0.6) * burst),
                itl_p95_s=float("nan") if empty else float(rng.choice([0.007, 0.009, 0.06])),
                success_rate=1.0,
                kv_usage_frac=float(rng.uniform(0.05, 0.3)),
                interactive_queue_depth=0.0,
                interactive_oldest_wait_s=float(rng.uniform(0.0, 0.2)),
                preemptions_per_s=0.0,
                interactive_tokens_per_s=float(rng.normal(9000.0, 1500.0) * burst),
                batch_tokens_per_s=60_000.0,
                batch_running_seqs=30.0,
                interactive_requests=0.0 if empty else float(rng.integers(1, 20)),
            )
        )
    return out


def bench(law: str, ticks: int) -> np.ndarray:
    """Per-tick wall times (s) of `law` over the synthetic stream."""
    plant = PlantModel.load(PLANT) if law != "slack" else None
    policy = build_policy(replace(ControllerConfig(), law=law), "bench", plant)
    times = np.empty(ticks)
    for k, obs in enumerate(observations(ticks, seed=1)):
        t0 = time.perf_counter()
        policy.step(obs, obs.now_s)
        times[k] = time.perf_counter() - t0
    return times


def main() -> None:
    """Print the tick-time table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ticks", type=int, default=2000, help="ticks per law (default 2000)")
    args = parser.parse_args()
    print(f"{'law':6s} {'ticks':>6s} {'mean ms':>8s} {'p50 ms':>7s} {'p99 ms':>7s} {'max ms':>7s}"
          f" {'target ms':>9s}")
    for law, target in (("pi", 5.0), ("mpc", 20.0), ("slack", 5.0)):
        t = bench(law, args.ticks) * 1e3
        print(f"{law:6s} {args.ticks:6d} {t.mean():8.3f} {np.percentile(t, 50):7.3f} "
              f"{np.percentile(t, 99):7.3f} {t.max():7.3f} {target:9.1f}")


if __name__ == "__main__":
    main()
